"""Models shipped inside the colibri package.

``default/`` holds the embedded default model that ``python -m colibri run`` uses when no
``--model`` is given: a small glm_moe_dsa MoE (MLA + DSA indexer + sigmoid-routed experts with a
shared expert, native MTP head) trained on the Python standard library, in colibri's quantized
container, with its tokenizer. ``tools/train_tiny.py`` rebuilds it; ``default/MODEL_CARD.md``
describes it.
"""
import os

__all__ = ["DEFAULT_MODEL_DIR", "default_model_dir"]

#: Folder of the embedded default model (config.json, tokenizer.json, out-*.safetensors).
DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default")


def default_model_dir() -> str:
    """The installed path of the embedded default model; raises FileNotFoundError when this
    build of colibri was made without it."""
    if not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
        raise FileNotFoundError(f"the embedded default model is missing from this build ({DEFAULT_MODEL_DIR}); "
                                "give a model folder with --model")
    return DEFAULT_MODEL_DIR
