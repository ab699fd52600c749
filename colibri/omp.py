"""How the engine's OpenMP threads wait at the end of a parallel region, chosen just before the
extension (and with it libgomp, which reads the variables when it loads) is first imported.

Sleeping (passive) costs a wake-up of ~50 µs per barrier here, a quarter of decode time on the
bench fixture (157 vs 200 tok/s), but spinning threads on a machine whose cores are busy with other
work wait for descheduled peers: libgomp's default spin made decode a hundred times slower while
another process trained a model (0.7 vs 120 tok/s). So: COLIBRI_SPIN=auto (default) spins for a
bounded time (GOMP_SPINCOUNT 10000, then sleeps; 2-2.5x slower than passive if the machine gets
busy later, not 100x) when the CPUs are idle at start-up, and sleeps otherwise; COLIBRI_SPIN=on/off
forces it. An OMP_WAIT_POLICY or GOMP_SPINCOUNT set by the user wins.

``import colibri`` does none of this (``plan`` and ``convert`` never load the engine): an import
hook (:func:`install`) runs :func:`choose` when ``colibri._core`` is first imported.
"""
import os
import sys

from .options import switch

SPIN_COUNT = "10000"
EXTENSION = __package__ + "._core"

_chosen = None


def cpus_busy(seconds=0.03):
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


def choose() -> str:
    """Set the OpenMP wait variables (once) and return the policy: 'passive', 'spin N' or the
    user's own OMP_WAIT_POLICY."""
    global _chosen
    if _chosen is None:
        _chosen = _choose(os.environ)
    return _chosen


def _choose(env) -> str:
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return env.get("OMP_WAIT_POLICY", "spin " + env.get("GOMP_SPINCOUNT", ""))
    mode = switch("SPIN").lower()
    spin = mode == "on"
    if mode == "auto":
        busy = cpus_busy()
        spin = busy is not None and busy < 0.15
    if spin:
        env["GOMP_SPINCOUNT"] = SPIN_COUNT
        return "spin " + SPIN_COUNT
    env["OMP_WAIT_POLICY"] = "passive"
    return "passive"


class _BeforeExtension:
    """A meta-path entry that finds nothing: it only runs choose() before the extension loads."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == EXTENSION:
            choose()
        return None


def install() -> None:
    if not any(isinstance(f, _BeforeExtension) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeExtension())
