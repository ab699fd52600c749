"""colibri: run huge glm_moe_dsa Mixture-of-Experts models on one ordinary machine.

The dense part stays resident in RAM (f32, int8 or int4); routed experts are streamed from disk
through a per-layer LRU cache. The engine lives in :mod:`colibri._core`.
"""
__version__ = "0.1.0"

from .config import Config, ConfigError, load_config  # noqa: F401


def model_init(path, **options):
    """Load a model directory; see :func:`colibri._core.model_init` for the options."""
    from ._core import model_init as _init
    return _init(path, **options)
