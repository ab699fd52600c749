"""colibri: run huge glm_moe_dsa Mixture-of-Experts models on one ordinary machine.

The dense part stays resident in RAM (f32, int8 or int4); routed experts are streamed from disk
through a per-layer LRU cache. The engine lives in :mod:`colibri._core`.
"""
import os as _os
import sys as _sys

__version__ = "0.1.0"

# OpenMP threads sleep at barriers instead of spinning (as colibrì's glm.c does): on a machine whose
# cores are also busy with other work, spinning threads wait for descheduled peers and decode slows
# down a hundredfold (measured here: 0.7 vs 120 tok/s on the bench fixture while another process
# trained a model). libgomp reads this when the extension loads it, so it is set before that.
_os.environ.setdefault("OMP_WAIT_POLICY", "passive")


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


def model_init(path, **options):
    """Load a model directory; see :func:`colibri._core.model_init` for the options."""
    from ._core import model_init as _init
    return _init(path, **options)
