"""Model configuration: parse and validate a glm_moe_dsa ``config.json``.

The rules follow HF transformers' ``GlmMoeDsaConfig`` (the definition of the model) and the
validation ranges of colibrì's ``load_cfg`` (spec §1), plus the implicit limits that glm.c does
not check. Every violation raises :class:`ConfigError` naming the file and the field.

This is the one validator of a model's config: ``model_init`` (through :func:`load_config`) and
``python -m colibri convert`` (through :func:`parse_config`, before it reads any weight) use it.
It refuses a config that names another architecture (``model_type`` / ``architectures``), and
reads the text model's fields from ``text_config`` when a checkpoint nests them there.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A config.json field is missing, malformed or out of range."""


#: The one model_type colibri runs (HF transformers' GlmMoeDsaConfig.model_type).
MODEL_TYPE = "glm_moe_dsa"

#: Every name in ``architectures`` starts with this (GlmMoeDsaForCausalLM, GlmMoeDsaModel, ...).
ARCHITECTURE_PREFIX = "GlmMoeDsa"

# field -> (json key, lo, hi, required)
_INT_FIELDS = {
    "vocab": ("vocab_size", 1, 1 << 24, True),
    "hidden": ("hidden_size", 1, 1 << 20, True),
    "n_layers": ("num_hidden_layers", 1, 128, True),
    "n_heads": ("num_attention_heads", 1, 1024, True),
    "n_experts": ("n_routed_experts", 1, 4096, True),
    "topk": ("num_experts_per_tok", 1, 64, True),
    "moe_inter": ("moe_intermediate_size", 1, 1 << 20, True),
    "dense_inter": ("intermediate_size", 1, 1 << 24, True),
    "q_lora": ("q_lora_rank", 1, 1 << 20, True),
    "kv_lora": ("kv_lora_rank", 1, 1 << 20, True),
    "qk_nope": ("qk_nope_head_dim", 1, 65536, True),
    "qk_rope": ("qk_rope_head_dim", 2, 256, True),
    "v_head": ("v_head_dim", 1, 65536, True),
    "n_shared": ("n_shared_experts", 0, 64, False),
    "index_topk": ("index_topk", 0, 1 << 20, False),
    "index_nh": ("index_n_heads", 0, 1024, False),
    "index_hd": ("index_head_dim", 0, 65536, False),
}

# Largest single matrix we accept (elements); 2^34 floats = 64 GiB, far beyond any real model.
_MAX_MATRIX_ELEMS = 1 << 34


@dataclass
class Config:
    vocab: int
    hidden: int
    n_layers: int
    n_heads: int
    n_experts: int
    topk: int
    moe_inter: int
    dense_inter: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    n_shared: int = 0
    index_topk: int = 0
    index_nh: int = 0
    index_hd: int = 0
    first_dense: int = 0
    norm_topk: bool = True
    routed_scale: float = 1.0
    eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    eos_ids: list = field(default_factory=list)
    sparse: list = field(default_factory=list)       # per layer: True = MoE, False = dense MLP
    idx_full: list = field(default_factory=list)     # per layer: True = runs its own DSA indexer
    max_positions: int = 0

    @property
    def qk_head(self) -> int:
        return self.qk_nope + self.qk_rope

    @property
    def dsa(self) -> bool:
        """The config describes a DSA lightning indexer (index_topk, index_n_heads, index_head_dim)."""
        return self.index_topk > 0 and self.index_nh > 0 and self.index_hd > 0

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.qk_head)


def _err(path, key, msg):
    return ConfigError(f"{path}: field '{key}' {msg}")


def _get_int(raw, path, key, lo, hi, required):
    if key not in raw or raw[key] is None:
        if required:
            raise _err(path, key, "is missing")
        return 0
    v = raw[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise _err(path, key, f"must be an integer, got {v!r}")
    v = int(v)
    if not lo <= v <= hi:
        raise _err(path, key, f"= {v} is out of range [{lo}, {hi}]")
    return v


def _get_float(raw, path, key, default, lo, hi):
    v = raw.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _err(path, key, f"must be a finite number, got {v!r}")
    if not lo <= v <= hi:
        raise _err(path, key, f"= {v} is out of range [{lo}, {hi}]")
    return float(v)


def _rope_theta(raw, path):
    """rope_theta: nested ``rope_parameters.rope_theta`` (HF 5.x) or top-level ``rope_theta``.

    glm.c reads only the nested key and silently falls back to 10000 (spec §11.9); we read both and
    reject a conflict or an unsupported rope type.
    """
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise _err(path, "rope_parameters", "must be an object")
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype not in ("default", None):
        raise _err(path, "rope_parameters.rope_type", f"= {rtype!r} is not supported (only 'default' RoPE)")
    nested = params.get("rope_theta")
    top = raw.get("rope_theta")
    if nested is not None and top is not None and float(nested) != float(top):
        raise _err(path, "rope_theta", f"conflicts: rope_parameters.rope_theta={nested} vs rope_theta={top}")
    theta = nested if nested is not None else top
    if theta is None:
        return 10000.0
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (0 < theta < 1e12):
        raise _err(path, "rope_theta", f"must be a positive number, got {theta!r}")
    return float(theta)


def _layer_kinds(raw, path, n_layers, first_dense):
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is not None:
        if not isinstance(mlp_types, list) or len(mlp_types) < n_layers or any(
                t not in ("dense", "sparse") for t in mlp_types[:n_layers]):
            raise _err(path, "mlp_layer_types", "must list 'dense'/'sparse' for every layer")
        return [t == "sparse" for t in mlp_types[:n_layers]]
    return [i >= first_dense for i in range(n_layers)]


def _indexer_kinds(raw, path, n_layers):
    """Per-layer DSA indexer kind, derived exactly as GlmMoeDsaConfig.__post_init__ does."""
    types = raw.get("indexer_types")
    if types is None:
        pattern = raw.get("index_topk_pattern")
        if pattern is not None:
            if isinstance(pattern, str):
                if any(c not in "FS" for c in pattern):
                    raise _err(path, "index_topk_pattern", "must contain only 'F' and 'S'")
                types = ["full" if c == "F" else "shared" for c in pattern]
            else:
                types = list(pattern)
        else:
            freq = max(int(raw.get("index_topk_freq", 1) or 1), 1)
            off = int(raw.get("index_skip_topk_offset", 2))
            types = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) < n_layers or any(
            t not in ("full", "shared") for t in types[:n_layers]):
        raise _err(path, "indexer_types", "must list 'full'/'shared' for every layer")
    return [t == "full" for t in types[:n_layers]]


def _check_architecture(raw: dict, path: str, where: str = "") -> None:
    """Refuse a config naming another model (a missing model_type / architectures is accepted)."""
    model_type = raw.get("model_type")
    if model_type is not None and model_type != MODEL_TYPE:
        raise _err(path, where + "model_type", f"= {model_type!r}: colibri runs only '{MODEL_TYPE}' models "
                   "(GLM-5.x); this checkpoint is another architecture")
    archs = raw.get("architectures")
    if archs is None:
        return
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise _err(path, where + "architectures", f"must be a list of class names, got {archs!r}")
    other = [a for a in archs if not a.startswith(ARCHITECTURE_PREFIX)]
    if other:
        raise _err(path, where + "architectures", f"names {other[0]!r}: colibri runs only "
                   f"{ARCHITECTURE_PREFIX}* ('{MODEL_TYPE}') models; this checkpoint is another architecture")


def text_config(raw: dict, path: str = "config.json") -> dict:
    """The text model's fields: ``raw`` itself, or ``raw["text_config"]`` when the checkpoint nests
    them there (with the top level's ``quantization_config`` when the nested one has none).
    Either level naming another architecture is a :class:`ConfigError`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a JSON object")
    _check_architecture(raw, path)
    inner = raw.get("text_config")
    if "num_hidden_layers" in raw or not isinstance(inner, dict):
        return raw
    _check_architecture(inner, path, "text_config.")
    out = dict(inner)
    if out.get("quantization_config") is None and raw.get("quantization_config") is not None:
        out["quantization_config"] = raw["quantization_config"]
    return out


def parse_config(raw: dict, path: str = "config.json") -> Config:
    """Validate the parsed ``config.json`` (top level, nesting allowed) into a :class:`Config`."""
    raw = text_config(raw, path)
    vals = {name: _get_int(raw, path, key, lo, hi, req) for name, (key, lo, hi, req) in _INT_FIELDS.items()}
    if vals["qk_rope"] % 2:
        raise _err(path, "qk_rope_head_dim", f"= {vals['qk_rope']} must be even (RoPE rotates pairs)")
    if vals["topk"] > vals["n_experts"]:
        raise _err(path, "num_experts_per_tok", f"= {vals['topk']} exceeds n_routed_experts = {vals['n_experts']}")
    n_group = raw.get("n_group", 1)
    if n_group not in (1, None):
        raise _err(path, "n_group", f"= {n_group!r}: only n_group = 1 is supported")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise _err(path, "hidden_act", f"= {act!r}: only 'silu' is supported")
    if raw.get("attention_bias", False) or raw.get("mlp_bias", False):
        raise _err(path, "attention_bias", "biases in projections are not supported")
    scoring = raw.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise _err(path, "scoring_func", f"= {scoring!r}: only 'sigmoid' routing is supported")
    first_dense = _get_int(raw, path, "first_k_dense_replace", 0, vals["n_layers"], False)
    norm_topk = raw.get("norm_topk_prob", True)
    if not isinstance(norm_topk, bool):
        raise _err(path, "norm_topk_prob", f"must be true or false, got {norm_topk!r}")
    eos = raw.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < vals["vocab"] for e in eos_ids):
        raise _err(path, "eos_token_id", f"must be token ids below vocab_size, got {eos!r}")
    cfg = Config(
        **vals,
        first_dense=first_dense,
        norm_topk=norm_topk,
        routed_scale=_get_float(raw, path, "routed_scaling_factor", 1.0, 0.0, 1e6),
        eps=_get_float(raw, path, "rms_norm_eps", 1e-5, 0.0, 1.0),
        rope_theta=_rope_theta(raw, path),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_ids=eos_ids,
        max_positions=int(raw.get("max_position_embeddings") or 0),
    )
    cfg.sparse = _layer_kinds(raw, path, cfg.n_layers, first_dense)
    cfg.idx_full = _indexer_kinds(raw, path, cfg.n_layers)
    if cfg.dsa:
        if cfg.index_hd < cfg.qk_rope:
            raise _err(path, "index_head_dim", f"= {cfg.index_hd} is smaller than qk_rope_head_dim")
        if not cfg.idx_full[0]:
            raise _err(path, "indexer_types", "layer 0 must be 'full' (shared layers reuse an earlier selection)")
    _check_sizes(cfg, path)
    return cfg


def _check_sizes(cfg: Config, path: str):
    """Reject dims whose matrices could not exist (guards every later allocation)."""
    mats = {
        "vocab_size*hidden_size": cfg.vocab * cfg.hidden,
        "num_attention_heads*qk_head_dim*q_lora_rank": cfg.n_heads * cfg.qk_head * cfg.q_lora,
        "num_attention_heads*(qk_nope+v_head)*kv_lora_rank": cfg.n_heads * (cfg.qk_nope + cfg.v_head) * cfg.kv_lora,
        "hidden_size*num_attention_heads*v_head_dim": cfg.hidden * cfg.n_heads * cfg.v_head,
        "intermediate_size*hidden_size": cfg.dense_inter * cfg.hidden,
        "n_routed_experts*moe_intermediate_size*hidden_size": cfg.n_experts * cfg.moe_inter * cfg.hidden,
        "index_n_heads*index_head_dim*q_lora_rank": cfg.index_nh * cfg.index_hd * cfg.q_lora,
    }
    for what, n in mats.items():
        if n > _MAX_MATRIX_ELEMS:
            raise ConfigError(f"{path}: dims give a matrix of {n} elements ({what}); refusing (limit 2^34)")


#: The DSA indexer tensors of a 'full' layer i (prefix model.layers.{i}.self_attn.indexer.).
INDEXER_TENSORS = ("wq_b.weight", "wk.weight", "weights_proj.weight", "k_norm.weight", "k_norm.bias")


def indexer_missing(cfg: Config, tensors, where: str):
    """Which DSA indexer the container holds: None when every 'full' layer has its indexer tensors,
    else the name of the first one missing (the model then attends densely: exact while the
    context fits in index_topk, when the indexer would select every key anyway).

    colibrì's converter leaves the indexer out unless its --indexer pass ran, so a container
    without any indexer tensor is common and valid; one that holds some of them but not all is
    damaged and raises ContainerError naming the first missing tensor. ``tensors`` is anything
    with ``in`` (a SafeTensorsDir); a config without DSA dims gives None.
    """
    from .st import ContainerError
    if not cfg.dsa:
        return None
    names = [f"model.layers.{i}.self_attn.indexer.{t}" for i in range(cfg.n_layers) if cfg.idx_full[i]
             for t in INDEXER_TENSORS]
    missing = [n for n in names if n not in tensors]
    if missing and len(missing) < len(names):
        raise ContainerError(f"{where}: the DSA indexer is incomplete: missing tensor {missing[0]} "
                             f"({len(missing)} of its {len(names)} tensors are missing)")
    return missing[0] if missing else None


def read_config_json(model_dir: str):
    """``(raw, path)``: the parsed ``MODEL_DIR/config.json`` (not validated) and its path."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found (is '{model_dir}' a model directory?)") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return raw, path


def load_config(model_dir: str) -> Config:
    raw, path = read_config_json(model_dir)
    return parse_config(raw, path)
