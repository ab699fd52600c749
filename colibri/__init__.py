"""colibri: run huge glm_moe_dsa Mixture-of-Experts models on one ordinary machine.

The dense part stays resident in RAM (f32, int8 or int4); routed experts are streamed from disk
through a per-layer LRU cache. The engine lives in :mod:`colibri._core`.
"""
import os as _os
import sys as _sys

__version__ = "0.1.0"

# numpy's OpenBLAS keeps a pool of threads, one per core, that spin for a while after each BLAS
# call; the engine threads with OpenMP and calls no BLAS per token, so on a 2-core machine such a
# pool only competes with the OpenMP team (it showed up as ~2% of decode samples). One BLAS thread
# unless the user chose otherwise; it takes effect when numpy is first imported.
_os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# The OpenMP wait policy is chosen when the engine extension is first imported (colibri.omp).
from . import omp as _omp  # noqa: E402

_omp.install()


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


def __getattr__(name):
    if name == "WAIT_POLICY":              # the OpenMP wait policy of this process (colibri.omp)
        return _omp.choose()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def model_init(path, **options):
    """Load a model directory; see :func:`colibri._core.model_init` for the options."""
    from ._core import model_init as _init
    return _init(path, **options)
