"""colibri: run huge glm_moe_dsa Mixture-of-Experts models on one ordinary machine.

The dense part stays resident in RAM (f32, int8 or int4); routed experts are streamed from disk
through a per-layer LRU cache. The engine lives in :mod:`colibri._core`.
"""
import os as _os
import sys as _sys

__version__ = "0.1.0"

# How OpenMP threads wait at the end of a parallel region. Sleeping (passive) costs a wake-up of
# ~50 µs per barrier here, a quarter of decode time on the bench fixture (157 vs 200 tok/s), but
# spinning threads on a machine whose cores are busy with other work wait for descheduled peers:
# libgomp's default spin made decode a hundred times slower while another process trained a model
# (0.7 vs 120 tok/s). So: COLIBRI_SPIN=auto (default) spins for a bounded time (GOMP_SPINCOUNT
# 10000, then sleeps; 2-2.5x slower than passive if the machine gets busy later, not 100x) when
# the CPUs are idle at start-up, and sleeps otherwise; COLIBRI_SPIN=on/off forces it. An
# OMP_WAIT_POLICY or GOMP_SPINCOUNT set by the user wins. libgomp reads these when the extension
# loads it, so they are set here, before that.
SPIN_COUNT = "10000"


def _cpus_busy(seconds=0.03):
    """Fraction of the machine's CPU time used by other processes over a short sample (Linux);
    None when unknown."""
    import time

    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:          # this process's threads (e.g. BLAS spinning)
            own = f.read().rsplit(")", 1)[1].split()
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0), int(own[11]) + int(own[12])
    try:
        t0, i0, s0 = sample()
        time.sleep(seconds)
        t1, i1, s1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if t1 <= t0:
        return None
    return max((t1 - t0) - (i1 - i0) - (s1 - s0), 0) / (t1 - t0)


def _choose_wait_policy():
    env = _os.environ
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return env.get("OMP_WAIT_POLICY", "spin " + env.get("GOMP_SPINCOUNT", ""))
    mode = env.get("COLIBRI_SPIN", "auto").strip().lower()
    spin = mode == "on"
    if mode == "auto":
        busy = _cpus_busy()
        spin = busy is not None and busy < 0.15
    if spin:
        env["GOMP_SPINCOUNT"] = SPIN_COUNT
        return "spin " + SPIN_COUNT
    env["OMP_WAIT_POLICY"] = "passive"
    return "passive"


#: The OpenMP wait policy this process chose (see above).
WAIT_POLICY = _choose_wait_policy()

# numpy's OpenBLAS keeps a pool of threads, one per core, that spin for a while after each BLAS
# call; the engine threads with OpenMP and calls no BLAS per token, so on a 2-core machine such a
# pool only competes with the OpenMP team (it showed up as ~2% of decode samples). One BLAS thread
# unless the user chose otherwise; it takes effect when numpy is first imported, i.e. below.
_os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _find_installed_extension():
    """When colibri is imported from a source checkout (e.g. ``python -m colibri`` run in the
    repository after ``pip install .``), the compiled ``_core`` lives in the installed copy: add
    that copy's folder to this package's search path so ``colibri._core`` resolves to it."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    if any(f.startswith("_core.") and f.endswith((".so", ".pyd")) for f in _os.listdir(here)):
        return
    for entry in _sys.path:
        cand = _os.path.join(_os.path.abspath(entry or "."), "colibri")
        if cand == here or not _os.path.isdir(cand):
            continue
        if any(f.startswith("_core.") and f.endswith((".so", ".pyd")) for f in _os.listdir(cand)):
            __path__.append(cand)
            return


_find_installed_extension()

from .config import Config, ConfigError, load_config  # noqa: E402,F401
from .api import LLM, Completion, Options, load  # noqa: E402,F401
from .tokenizer import ModelFileError  # noqa: E402,F401


def model_init(path, **options):
    """Load a model directory; see :func:`colibri._core.model_init` for the options."""
    from ._core import model_init as _init
    return _init(path, **options)
