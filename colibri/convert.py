"""Convert an HF ``glm_moe_dsa`` checkpoint into colibri's quantized container.

Usage (through the CLI dispatcher)::

    python -m colibri convert SRC DST [--expert-bits 4] [--dense-bits 4]
                                      [--io-bits 8] [--mtp-bits 8] [--indexer-bits 8]
                                      [--group-size 0]

SRC is a directory of safetensors shards (BF16, F16, F32, or FP8 ``F8_E4M3``
with ``*_scale_inv`` 128x128 block scales) plus ``config.json``.  DST receives
``out-{i:05d}.safetensors`` for source shard i (sorted by name), the copied
config/tokenizer files and ``colibri_convert.json``.

A conversion of GLM-5 takes hours, so it fails in the first second or not at
all: before DST is touched, ``config.json`` passes the engine's own validator
(:func:`colibri.config.parse_config`: a ``glm_moe_dsa`` model the engine can
run), the shards pass :class:`~colibri.st.SafeTensorsDir` (with a
``model.safetensors.index.json``: every shard it names present and holding the
tensors it names; other ``.safetensors`` files, an adapter say, skipped with a
warning), every output tensor is planned from the headers, and DST's file
system must have room for the planned output (:func:`output_bytes`).

Container (engine spec 2.3): a quantized matrix NAME [O, I] is stored as NAME
(U8, 1-D packed payload) plus NAME.qs (F32 [O] row scales, or with
``--group-size GS`` for the int4 matrices F32 [O, ceil(I/GS)], one scale per GS
inputs of a row as colibrì's converter writes by default with GS = 64);
everything else is F32.  Files are written with ``safetensors.numpy.save_file`` (dtype-descending,
then name-ascending order), so the three payloads of one routed expert are
adjacent on disk (down, gate, up) and the files are byte-compatible with the
reference converter's.

The conversion works one source shard at a time (and one row block of a matrix
at a time), writes each output to a temporary name, fsyncs it and renames it
into place, so an interrupted run can simply be started again: finished shards
whose files still match the plan are kept, everything else is redone.  A disk
that fills up while writing ends the run with one line (:class:`NoSpaceError`)
and the partial file removed; the manifest stays ``"complete": false`` and the
same command resumes.  Output files get the permissions of any file the user
creates (0644 under umask 022).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import quant
from .config import parse_config, read_config_json, text_config
from .st import DTYPE_SIZES, INDEX_NAME, ContainerError, SafeTensorsDir, TensorInfo, decode_f32, scan_file
from .options import switch
from .usage import fsync_dir, unlink_quietly, write_bytes_atomic

__all__ = [
    "DEFAULT_BITS",
    "COPY_FILES",
    "MANIFEST_NAME",
    "STOP_ENV",
    "ConvertInterrupted",
    "NoSpaceError",
    "ConvertOptions",
    "PlanItem",
    "classify",
    "expected_shape",
    "load_config",
    "plan_conversion",
    "output_name",
    "output_bytes",
    "save_file_atomic",
    "convert",
    "add_arguments",
    "run",
    "main",
]

#: Default bit widths per class of weight.
DEFAULT_BITS = {"expert": 4, "dense": 4, "io": 8, "mtp": 8, "indexer": 8}

#: Files copied verbatim from SRC to DST when present.
COPY_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

MANIFEST_NAME = "colibri_convert.json"
MANIFEST_VERSION = 1

#: Test hook: raise :class:`ConvertInterrupted` after this many shards were written.
STOP_ENV = "COLIBRI_CONVERT_STOP_AFTER"

#: Float elements decoded/quantized at once (bounds memory for huge matrices).
CHUNK_ELEMS = 1 << 24

#: Source dtypes the converter reads.
_SOURCE_FLOATS = ("F32", "F16", "BF16", "F8_E4M3")
_FP8 = "F8_E4M3"

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED_RE = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_OUT_RE = re.compile(r"^out-(\d{5,})\.safetensors$")
_TMP_RE = re.compile(r"^\.out-(\d{5,})\.safetensors\.tmp$")

_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

_IO_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


class ConvertInterrupted(RuntimeError):
    """Raised by the stop-after-N-shards test hook."""


@dataclass(frozen=True)
class ConvertOptions:
    expert_bits: int = DEFAULT_BITS["expert"]
    dense_bits: int = DEFAULT_BITS["dense"]
    io_bits: int = DEFAULT_BITS["io"]
    mtp_bits: int = DEFAULT_BITS["mtp"]
    indexer_bits: int = DEFAULT_BITS["indexer"]
    group_size: int = 0  # int4 matrices: 0 = one scale per row, else one per group of this many inputs

    def __post_init__(self):
        for cls, bits in self.bits().items():
            try:
                quant.container_format(bits)
            except (TypeError, ValueError):
                raise ValueError(
                    f"--{cls}-bits {bits!r}: use 2..8 to quantize or >= 16 to keep float32"
                ) from None
        quant.check_group_size(self.group_size, "--group-size")

    def bits(self) -> Dict[str, int]:
        return {
            "expert": int(self.expert_bits),
            "dense": int(self.dense_bits),
            "io": int(self.io_bits),
            "mtp": int(self.mtp_bits),
            "indexer": int(self.indexer_bits),
        }


@dataclass(frozen=True)
class PlanItem:
    """One output tensor (or quantized matrix) and where its data come from."""

    out_name: str
    cls: str  # 'f32' | 'io' | 'mtp' | 'indexer' | 'expert' | 'dense'
    fmt: str  # 'f32' | 'int8' | 'int4' | 'int2'
    bits: int  # 32 for float32
    src: TensorInfo
    scale: Optional[TensorInfo]  # FP8 block scales (F8_E4M3 sources only)
    lead: Optional[int]  # index into the leading (expert) dim of a fused tensor
    row0: int  # first row of this matrix inside the source matrix
    shape: Tuple[int, ...]  # logical shape of the output ([O, I] for matrices)
    matrix: bool  # 2-D, read by row blocks
    group: int = 0  # inputs per scale (0: one scale per row)

    def outputs(self) -> List[Tuple[str, str, Tuple[int, ...]]]:
        """(name, dtype, shape) of the tensors this item writes."""
        if self.fmt == "f32":
            return [(self.out_name, "F32", self.shape)]
        O, I = self.shape
        qs_shape = (O,) if self.group == 0 else (O, quant.n_groups(I, self.group))
        return [
            (self.out_name, "U8", (quant.payload_nbytes(self.fmt, O, I),)),
            (self.out_name + ".qs", "F32", qs_shape),
        ]


# ---------------------------------------------------------------------------
# configuration and classification


def _pos_int(x) -> Optional[int]:
    if isinstance(x, int) and not isinstance(x, bool) and x > 0:
        return x
    return None


def load_config(src: str) -> dict:
    """Read ``SRC/config.json`` and validate it with the engine's own validator
    (:func:`colibri.config.parse_config`: every field ``model_init`` checks, and the
    ``glm_moe_dsa`` architecture), before any weight is read.  Returns the text model's
    fields as a dict (``text_config`` when the checkpoint nests them).  Raises
    :class:`~colibri.config.ConfigError` naming the file and the field."""
    raw, path = read_config_json(src)
    parse_config(raw, path)
    return text_config(raw, path)


def fp8_block_size(cfg: dict, config_path: str = "config.json") -> Tuple[int, int]:
    """FP8 block size from ``quantization_config.weight_block_size`` (default 128x128)."""
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict) and qc.get("weight_block_size") is not None:
        b = qc["weight_block_size"]
        if not (isinstance(b, list) and len(b) == 2 and all(_pos_int(x) for x in b)):
            raise ContainerError(
                f"{config_path}: quantization_config.weight_block_size {b!r} is not two positive integers"
            )
        return int(b[0]), int(b[1])
    return 128, 128


def _layer_of(name: str) -> Tuple[Optional[int], str]:
    m = _LAYER_RE.match(name)
    if not m:
        return None, name
    return int(m.group(1)), m.group(2)


def classify(name: str, ndim: int, num_hidden_layers: int) -> str:
    """Class of an (already split) tensor name.

    Returns 'scale_inv' (consumed with its weight), 'drop' (MTP copies of the
    embedding/head), 'f32', or a quantized class: 'io', 'mtp', 'indexer',
    'expert', 'dense'.  Quantized classes apply to 2-D tensors only.
    """
    if name.endswith("_scale_inv"):
        return "scale_inv"
    layer, rest = _layer_of(name)
    is_mtp = layer is not None and layer >= num_hidden_layers
    if is_mtp and (rest.startswith("shared_head.head.") or rest.startswith("embed_tokens.")):
        return "drop"
    if (name.endswith("e_score_correction_bias") or name.endswith("mlp.gate.weight")
            or name.endswith("norm.weight") or name.endswith("norm.bias")):
        return "f32"
    if ndim != 2:
        return "f32"
    if name in _IO_NAMES:
        return "io"
    if not name.endswith(".weight"):
        return "f32"
    if is_mtp:
        return "mtp"
    if ".self_attn.indexer." in name:
        return "indexer"
    if ".mlp.experts." in name:
        return "expert"
    return "dense"


def expected_shape(name: str, cfg: dict) -> Optional[Tuple[int, int]]:
    """Shape a 2-D weight must have according to config.json, or None if unknown."""

    def g(key):
        return _pos_int(cfg.get(key))

    def both(*dims):
        return None if any(d is None for d in dims) else tuple(dims)

    V, D = g("vocab_size"), g("hidden_size")
    if name in _IO_NAMES:
        return both(V, D)
    layer, rest = _layer_of(name)
    if layer is None:
        return None
    H, Lq, Lkv = g("num_attention_heads"), g("q_lora_rank"), g("kv_lora_rank")
    dn, dr, dv = g("qk_nope_head_dim"), g("qk_rope_head_dim"), g("v_head_dim")
    E, Ie, Id = g("n_routed_experts"), g("moe_intermediate_size"), g("intermediate_size")
    nsh = g("n_shared_experts")
    inh, ihd = g("index_n_heads"), g("index_head_dim")

    def mul(a, b):
        return None if a is None or b is None else a * b

    def add(a, b):
        return None if a is None or b is None else a + b

    table = {
        "self_attn.q_a_proj.weight": (Lq, D),
        "self_attn.q_b_proj.weight": (mul(H, add(dn, dr)), Lq),
        "self_attn.kv_a_proj_with_mqa.weight": (add(Lkv, dr), D),
        "self_attn.kv_b_proj.weight": (mul(H, add(dn, dv)), Lkv),
        "self_attn.o_proj.weight": (D, mul(H, dv)),
        "self_attn.indexer.wq_b.weight": (mul(inh, ihd), Lq),
        "self_attn.indexer.wk.weight": (ihd, D),
        "self_attn.indexer.weights_proj.weight": (inh, D),
        "mlp.gate.weight": (E, D),
        "mlp.gate_proj.weight": (Id, D),
        "mlp.up_proj.weight": (Id, D),
        "mlp.down_proj.weight": (D, Id),
        "mlp.shared_experts.gate_proj.weight": (mul(Ie, nsh), D),
        "mlp.shared_experts.up_proj.weight": (mul(Ie, nsh), D),
        "mlp.shared_experts.down_proj.weight": (D, mul(Ie, nsh)),
        "eh_proj.weight": (D, mul(D, 2)),
    }
    if rest in table:
        return both(*table[rest])
    m = _EXPERT_RE.match(rest)
    if m:
        return both(D, Ie) if m.group(2) == "down_proj" else both(Ie, D)
    return None


def _config_desc(name: str) -> str:
    layer, rest = _layer_of(name)
    m = _EXPERT_RE.match(rest)
    if m:
        return ("[hidden_size, moe_intermediate_size]" if m.group(2) == "down_proj"
                else "[moe_intermediate_size, hidden_size]")
    return {
        "model.embed_tokens.weight": "[vocab_size, hidden_size]",
        "lm_head.weight": "[vocab_size, hidden_size]",
    }.get(name) or {
        "self_attn.q_a_proj.weight": "[q_lora_rank, hidden_size]",
        "self_attn.q_b_proj.weight": "[num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim), q_lora_rank]",
        "self_attn.kv_a_proj_with_mqa.weight": "[kv_lora_rank+qk_rope_head_dim, hidden_size]",
        "self_attn.kv_b_proj.weight": "[num_attention_heads*(qk_nope_head_dim+v_head_dim), kv_lora_rank]",
        "self_attn.o_proj.weight": "[hidden_size, num_attention_heads*v_head_dim]",
        "self_attn.indexer.wq_b.weight": "[index_n_heads*index_head_dim, q_lora_rank]",
        "self_attn.indexer.wk.weight": "[index_head_dim, hidden_size]",
        "self_attn.indexer.weights_proj.weight": "[index_n_heads, hidden_size]",
        "mlp.gate.weight": "[n_routed_experts, hidden_size]",
        "mlp.gate_proj.weight": "[intermediate_size, hidden_size]",
        "mlp.up_proj.weight": "[intermediate_size, hidden_size]",
        "mlp.down_proj.weight": "[hidden_size, intermediate_size]",
        "mlp.shared_experts.gate_proj.weight": "[moe_intermediate_size*n_shared_experts, hidden_size]",
        "mlp.shared_experts.up_proj.weight": "[moe_intermediate_size*n_shared_experts, hidden_size]",
        "mlp.shared_experts.down_proj.weight": "[hidden_size, moe_intermediate_size*n_shared_experts]",
        "eh_proj.weight": "[hidden_size, 2*hidden_size]",
    }.get(rest, "per config.json")


# ---------------------------------------------------------------------------
# planning (headers only: every check that needs no tensor data happens here)


def _item_for_matrix(out_name, src, scale, lead, row0, rows, cols, cfg, nl, opts, what):
    cls = classify(out_name, 2, nl)
    if cls in ("scale_inv", "drop"):  # pragma: no cover - callers filter these
        raise AssertionError(out_name)
    layer, rest = _layer_of(out_name)
    m = _EXPERT_RE.match(rest)
    E = _pos_int(cfg.get("n_routed_experts"))
    if m and E is not None and int(m.group(1)) >= E:
        raise ContainerError(
            f"{what}: {out_name}: expert id {m.group(1)} is out of range "
            f"(n_routed_experts = {E} in config.json)"
        )
    exp = expected_shape(out_name, cfg)
    if exp is not None and exp != (rows, cols):
        raise ContainerError(
            f"{what}: shape [{rows}, {cols}] of {out_name} does not match config.json "
            f"(expected {list(exp)} = {_config_desc(out_name)})"
        )
    if cls == "f32" or rows == 0 or cols == 0:
        fmt, bits = "f32", 32
    else:
        bits = opts.bits()[cls]
        fmt = quant.storage_format(bits, rows, cols)
        if fmt == "f32":
            bits = 32
    # group scales for the int4 matrices (colibrì's layout) whose rows hold more than one group
    group = opts.group_size if fmt == "int4" and quant.n_groups(cols, opts.group_size) > 1 else 0
    return PlanItem(out_name=out_name, cls=cls,
                    fmt=fmt, bits=bits, src=src, scale=scale, lead=lead, row0=row0,
                    shape=(rows, cols), matrix=True, group=group)


def _scale_for(index: SafeTensorsDir, info: TensorInfo, block: Tuple[int, int]) -> Optional[TensorInfo]:
    what = f"{info.path}: tensor {info.name!r}"
    sname = info.name + "_scale_inv"
    sinfo = index.get(sname)
    if info.dtype != _FP8:
        if sinfo is not None:
            raise ContainerError(
                f"{what}: has a {sname} block scale but is {info.dtype}, not F8_E4M3 "
                "(refusing to guess whether it applies)"
            )
        return None
    if sinfo is None:
        raise ContainerError(f"{what}: FP8 (F8_E4M3) weight without its {sname} tensor")
    if len(info.shape) < 2:
        raise ContainerError(f"{what}: FP8 tensor with shape {list(info.shape)}; only matrices are supported")
    if sinfo.dtype not in ("F32", "BF16", "F16"):
        raise ContainerError(f"{sinfo.path}: tensor {sname!r}: unsupported scale dtype {sinfo.dtype}")
    R, C = info.shape[-2:]
    want = tuple(info.shape[:-2]) + (-(-R // block[0]), -(-C // block[1]))
    if tuple(sinfo.shape) != want:
        raise ContainerError(
            f"{sinfo.path}: tensor {sname!r}: shape {list(sinfo.shape)} does not match "
            f"{list(info.shape)} in {block[0]}x{block[1]} blocks (expected {list(want)})"
        )
    return sinfo


def _plan_tensor(index, info, cfg, nl, opts, block) -> List[PlanItem]:
    name = info.name
    what = f"{info.path}: tensor {name!r}"
    kind = classify(name, len(info.shape), nl)
    if kind == "scale_inv":
        wname = name[: -len("_scale_inv")]
        if wname not in index:
            raise ContainerError(f"{what}: block scale without its weight {wname}")
        return []
    if kind == "drop":
        return []
    if info.dtype not in _SOURCE_FLOATS:
        raise ContainerError(
            f"{what}: unsupported dtype {info.dtype} (expected one of {', '.join(_SOURCE_FLOATS)})"
        )
    scale = _scale_for(index, info, block)

    fused = _FUSED_RE.match(name)
    if fused:
        if len(info.shape) != 3:
            raise ContainerError(f"{what}: fused expert tensor must be 3-D, got shape {list(info.shape)}")
        E, R, C = info.shape
        prefix = fused.group("prefix")
        E_cfg = _pos_int(cfg.get("n_routed_experts"))
        if E_cfg is not None and E != E_cfg:
            raise ContainerError(
                f"{what}: {E} experts in the fused tensor but n_routed_experts = {E_cfg} in config.json"
            )
        items = []
        if fused.group("kind") == "gate_up_proj":
            if R % 2:
                raise ContainerError(f"{what}: fused gate_up_proj has an odd row count {R}")
            half = R // 2
            for e in range(E):
                for part, row0 in (("gate_proj", 0), ("up_proj", half)):
                    items.append(_item_for_matrix(
                        f"{prefix}.{e}.{part}.weight", info, scale, e, row0, half, C, cfg, nl, opts, what))
        else:
            for e in range(E):
                items.append(_item_for_matrix(
                    f"{prefix}.{e}.down_proj.weight", info, scale, e, 0, R, C, cfg, nl, opts, what))
        return items

    if len(info.shape) == 2:
        R, C = info.shape
        return [_item_for_matrix(name, info, scale, None, 0, R, C, cfg, nl, opts, what)]
    if name in _IO_NAMES:
        raise ContainerError(f"{what}: expected a 2-D [vocab_size, hidden_size] matrix, got {list(info.shape)}")
    return [PlanItem(out_name=name, cls="f32", fmt="f32", bits=32, src=info, scale=None,
                     lead=None, row0=0, shape=tuple(info.shape), matrix=False)]


def plan_conversion(index: SafeTensorsDir, cfg: dict, opts: ConvertOptions,
                    block: Tuple[int, int] = (128, 128)) -> List[List[PlanItem]]:
    """Plan every output shard (one list of items per source file), from headers only."""
    nl = int(cfg["num_hidden_layers"])
    plans: List[List[PlanItem]] = []
    seen: Dict[str, TensorInfo] = {}
    for fi in range(len(index.paths)):
        items: List[PlanItem] = []
        for info in index.tensors_in_file(fi):
            for it in _plan_tensor(index, info, cfg, nl, opts, block):
                for oname, _, _ in it.outputs():
                    if oname in seen:
                        prev = seen[oname]
                        raise ContainerError(
                            f"{it.src.path}: tensor {it.src.name!r} produces {oname}, which "
                            f"{prev.path}: tensor {prev.name!r} also produces"
                        )
                    seen[oname] = it.src
                items.append(it)
        plans.append(items)
    return plans


#: Header bytes allowed per output tensor on top of its name (its JSON entry: dtype, shape,
#: data_offsets, quotes and separators take < 100 for any real size).
_HEADER_ENTRY_BYTES = 128


def output_bytes(items: List[PlanItem]) -> int:
    """Size bound of the output file of one shard's plan: the bytes of every tensor its items
    write (:meth:`PlanItem.outputs`) plus a header entry each."""
    total = 8  # the header length
    for it in items:
        for name, dtype, shape in it.outputs():
            n = DTYPE_SIZES[dtype]
            for d in shape:
                n *= int(d)
            total += n + len(name.encode("utf-8")) + _HEADER_ENTRY_BYTES
    return total


def output_name(file_index: int) -> str:
    return f"out-{file_index:05d}.safetensors"


def _tmp_name(file_index: int) -> str:
    return f".out-{file_index:05d}.safetensors.tmp"


# ---------------------------------------------------------------------------
# conversion of one shard


class _ScaleCache:
    def __init__(self, index: SafeTensorsDir):
        self.index = index
        self.name = None
        self.arr = None

    def get(self, sinfo: TensorInfo) -> np.ndarray:
        if self.name != sinfo.name:
            self.arr = self.index.read_f32(sinfo.name)
            self.name = sinfo.name
        return self.arr


def _read_rows(index: SafeTensorsDir, it: PlanItem, r0: int, r1: int,
               scales: _ScaleCache, block: Tuple[int, int]) -> np.ndarray:
    src = it.src
    O, C = it.shape
    R_src = src.shape[-2]
    isz = src.itemsize
    first = (it.lead * R_src if it.lead is not None else 0) + it.row0 + r0
    raw = index.read_raw_range(src.name, first * C * isz, (r1 - r0) * C * isz)
    x = decode_f32(raw, src.dtype, f"{src.path}: tensor {src.name!r}").reshape(r1 - r0, C)
    if it.scale is not None:
        sc = scales.get(it.scale)
        if it.lead is not None:
            sc = sc[it.lead]
        rows = (np.arange(r0, r1) + it.row0) // block[0]
        cols = np.arange(C) // block[1]
        x = x * sc[rows][:, cols]
    return x


def _finite_rows(index, it, r0, r1, scales, block):
    """Rows r0 .. r1-1 of ``it`` as f32 [r1 - r0, I]; a NaN or infinity is an error naming the row."""
    x = _read_rows(index, it, r0, r1, scales, block)
    bad = ~np.isfinite(x)
    if bad.any():
        raise _nonfinite_error(it, r0 + int(np.argmax(bad.any(axis=1))))
    return x


def _nonfinite_error(it: PlanItem, row: Optional[int]) -> ContainerError:
    where = f"{it.src.path}: tensor {it.src.name!r}"
    if it.out_name != it.src.name:
        where += f" ({it.out_name})"
    at = f" (row {row})" if row is not None else ""
    return ContainerError(f"{where}: contains NaN or Inf{at}; refusing to convert")


def _convert_item(index: SafeTensorsDir, it: PlanItem, out: Dict[str, np.ndarray],
                  scales: _ScaleCache, block: Tuple[int, int]) -> None:
    if not it.matrix:
        x = index.read_f32(it.src.name)
        if not np.all(np.isfinite(x)):
            raise _nonfinite_error(it, None)
        out[it.out_name] = np.ascontiguousarray(x, dtype=np.float32)
        return
    O, I = it.shape
    step = max(1, CHUNK_ELEMS // max(I, 1))
    if it.fmt == "f32":
        dst = np.empty((O, I), dtype=np.float32)
        for r0 in range(0, O, step):
            r1 = min(O, r0 + step)
            dst[r0:r1] = _finite_rows(index, it, r0, r1, scales, block)
        out[it.out_name] = dst
        return
    rb = quant.payload_nbytes(it.fmt, 1, I)
    payload = np.empty(O * rb, dtype=np.uint8)
    qs = np.empty(O if it.group == 0 else (O, quant.n_groups(I, it.group)), dtype=np.float32)
    for r0 in range(0, O, step):
        r1 = min(O, r0 + step)
        x = _finite_rows(index, it, r0, r1, scales, block)
        v, s = quant.quantize_groups(x, it.bits, it.group)   # groups lie within rows: any row block
        payload[r0 * rb : r1 * rb] = quant.pack(v, it.fmt).reshape(-1)
        qs[r0:r1] = s
    out[it.out_name] = payload
    out[it.out_name + ".qs"] = qs


# ---------------------------------------------------------------------------
# atomic writing


#: errno values of a full file system: no space left, disk quota exceeded.
_FULL_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e is not None)

# how the safetensors library (Rust) reports an I/O error: "... (os error 28) ..."
_RUST_OS_ERROR_RE = re.compile(r"\(os error (\d+)\)")


class NoSpaceError(OSError):
    """DST's file system cannot hold the conversion: refused up front, or full while writing
    (then the partial file is removed and a rerun resumes).  ``errno`` is ENOSPC."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_error_of(e: Exception, path: str) -> Optional[OSError]:
    """The OSError behind a writer's exception: itself, or the one a SafetensorError message
    carries; None for any other error."""
    if isinstance(e, OSError):
        return e
    m = _RUST_OS_ERROR_RE.search(str(e))
    if m is None:
        return None
    code = int(m.group(1))
    return OSError(code, os.strerror(code), path)


def _creation_mode(path: str) -> int:
    """Create ``path`` empty and return its permission bits: 0o666 less the umask, as for any
    file the user creates (safetensors writes through a temporary of its own, created 0600,
    and renames it over ``path``; the written file gets these bits back)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)


def save_file_atomic(tensors: Dict[str, np.ndarray], path: str, tmp_path: Optional[str] = None) -> None:
    """Write ``tensors`` with ``safetensors.numpy.save_file`` to a temporary file,
    check it, fsync it and rename it to ``path`` (permissions per the umask).

    On any error the temporary is removed and ``path`` is left as it was; an I/O error
    (a full disk: errno ENOSPC) is raised as an :class:`OSError`, also when the safetensors
    library reports it as a ``SafetensorError``."""
    from safetensors.numpy import save_file

    path = os.fspath(path)
    d, base = os.path.split(path)
    if tmp_path is None:
        tmp_path = os.path.join(d, f".{base}.tmp")
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    try:
        mode = _creation_mode(tmp_path)
        try:
            save_file(arrays, tmp_path)
        except Exception as e:
            err = _os_error_of(e, tmp_path)
            if err is None or err is e:
                raise
            raise err from e
        os.chmod(tmp_path, mode)
        scan_file(tmp_path)  # the file we just wrote must parse
        _fsync_path(tmp_path)
        os.replace(tmp_path, path)
    except BaseException:
        unlink_quietly(tmp_path)
        raise
    fsync_dir(d or ".")


def _write_bytes_atomic(data: bytes, path: str) -> None:
    d, base = os.path.split(path)
    write_bytes_atomic(path, data, os.path.join(d, f".{base}.tmp"))


def _existing_output_ok(path: str, items: List[PlanItem]) -> Tuple[bool, str]:
    """Does an existing output file parse and hold exactly the planned tensors?"""
    try:
        tensors, hlen, data_end = scan_file(path)
    except ContainerError as e:
        return False, str(e)
    want = {n: (dt, tuple(sh)) for it in items for n, dt, sh in it.outputs()}
    have = {n: (t.dtype, t.shape) for n, t in tensors.items()}
    if have != want:
        return False, f"{path}: tensors differ from the plan"
    total = sum(t.nbytes for t in tensors.values())
    size = os.path.getsize(path)
    if data_end != total or size != 8 + hlen + total:
        return False, f"{path}: size {size} does not match its header"
    return True, ""


# ---------------------------------------------------------------------------
# manifest


def _manifest(src_abs, index, cfg, opts, block, plans, copied, complete) -> dict:
    bits = opts.bits()
    classes: Dict[str, dict] = {}
    for items in plans:
        for it in items:
            c = classes.setdefault(it.cls, {"tensors": 0, "formats": {}})
            c["tensors"] += 1
            c["formats"][it.fmt] = c["formats"].get(it.fmt, 0) + 1
    shards = []
    for fi, items in enumerate(plans):
        shards.append({
            "source": os.path.basename(index.paths[fi]),
            "output": output_name(fi) if items else None,
        })
    return {
        "format": "colibri-container",
        "format_version": MANIFEST_VERSION,
        "complete": bool(complete),
        "source": src_abs,
        "source_shards": [os.path.basename(p) for p in index.paths],
        "shards": shards,
        "num_hidden_layers": int(cfg["num_hidden_layers"]),
        "bits": bits,
        "group_size": int(opts.group_size),
        "containers": {k: quant.container_format(v) for k, v in bits.items()},
        "quantization": {
            "scheme": ("per-row symmetric, scale = max(amax/qmax, 1e-8), v = rint(w/s)" if not opts.group_size
                       else f"symmetric per group of {opts.group_size} inputs of each row for int4 "
                            "(per row for int8 / int2 and rows of one group), "
                            "scale = max(amax/qmax, 1e-8), v = rint(w/s)"),
            "payload": ("NAME U8 1-D packed rows + NAME.qs F32 [O]" if not opts.group_size
                        else f"NAME U8 1-D packed rows + NAME.qs F32 [O, ceil(I/{opts.group_size})] (int4), [O] else"),
        },
        "fp8_block_size": list(block),
        "classes": classes,
        "copied_files": list(copied),
    }


def _manifest_bytes(m: dict) -> bytes:
    return (json.dumps(m, indent=2, sort_keys=True) + "\n").encode("utf-8")


_MANIFEST_KEYS = ("format", "format_version", "source_shards", "num_hidden_layers", "bits", "fp8_block_size",
                  "group_size")
#: Value of a key that manifests written before it existed imply.
_MANIFEST_DEFAULTS = {"group_size": 0}


def _check_resumable(dst: str, manifest: dict, plans: List[List[PlanItem]]) -> None:
    mpath = os.path.join(dst, MANIFEST_NAME)
    planned = {output_name(fi) for fi, items in enumerate(plans) if items}
    present = sorted(n for n in os.listdir(dst) if n.endswith(".safetensors"))
    foreign = [n for n in present if n not in planned]
    if os.path.exists(mpath):
        try:
            with open(mpath, "rb") as f:
                old = json.loads(f.read().decode("utf-8"))
            if not isinstance(old, dict):
                raise ValueError("not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ContainerError(f"{mpath}: unreadable ({e}); use an empty destination directory") from e
        diff = [k for k in _MANIFEST_KEYS if old.get(k, _MANIFEST_DEFAULTS.get(k)) != manifest.get(k)]
        if diff:
            raise ContainerError(
                f"{dst}: already holds a conversion with different {', '.join(diff)} "
                f"(see {MANIFEST_NAME}); use an empty destination directory or the same options"
            )
    elif present:
        raise ContainerError(
            f"{dst}: holds .safetensors files but no {MANIFEST_NAME}; refusing to mix "
            "conversions (use an empty destination directory)"
        )
    if foreign:
        raise ContainerError(
            f"{dst}: holds .safetensors files this conversion would not write "
            f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); the engine would "
            "index them too - remove them or use an empty destination directory"
        )


# ---------------------------------------------------------------------------
# driver


def _progress(iterable=None, **kw):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return iterable if iterable is not None else _NoBar()
    kw.setdefault("disable", None)  # off when not a TTY
    kw.setdefault("file", sys.stderr)
    return tqdm(iterable, **kw)


class _NoBar:  # pragma: no cover
    def update(self, n=1):
        pass

    def close(self):
        pass


def _log(msg: str) -> None:
    print(f"[convert] {msg}", file=sys.stderr, flush=True)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _free_bytes(path: str) -> int:
    """Bytes an unprivileged user may still write on the file system of ``path`` (or of its
    nearest existing parent, when ``path`` is yet to be created)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def _shards_to_write(dst: str, plans: List[List[PlanItem]], verbose: bool) -> List[int]:
    """Source shards whose output this run writes: every one with items, but for outputs an
    earlier run finished that still match the plan."""
    todo = []
    for fi, items in enumerate(plans):
        if not items:
            continue
        final = os.path.join(dst, output_name(fi))
        if os.path.exists(final):
            ok, why = _existing_output_ok(final, items)
            if ok:
                continue
            if verbose:
                _log(f"redoing {output_name(fi)}: {why}")
        todo.append(fi)
    return todo


def _check_free_space(dst: str, need: int) -> None:
    free = _free_bytes(dst)
    if need > free:
        raise NoSpaceError(
            f"{dst}: not enough free space: the conversion writes {_gb(need)}, the file system has "
            f"{_gb(free)} free; free {_gb(need - free)} or choose another destination"
        )


def _disk_full_error(dst: str, writing: str, left: int) -> NoSpaceError:
    try:
        free = f", {_gb(_free_bytes(dst))} free"
    except OSError:
        free = ""
    return NoSpaceError(
        f"{dst}: no space left on the device while writing {writing} ({_gb(left)} still to write{free}); "
        f"the partial file was removed and {MANIFEST_NAME} records the conversion as incomplete: "
        "free some space and run the same command again to resume"
    )


def convert(src, dst, opts: Optional[ConvertOptions] = None, *,
            stop_after_shards: Optional[int] = None, verbose: bool = True) -> dict:
    """Convert SRC into DST (see the module docstring).  Returns the manifest.

    Everything that can be checked without tensor data is checked before DST is
    touched: ``config.json`` (:class:`~colibri.config.ConfigError`), the shards and
    their index, every planned tensor (:class:`ContainerError`, a ``ValueError``,
    naming the file and tensor) and the free space of DST (:class:`NoSpaceError`,
    an ``OSError``).  A file system that fills up while writing raises
    :class:`NoSpaceError` too, leaving DST resumable.  :class:`ConvertInterrupted`
    is raised when ``stop_after_shards`` shards were written in this call.
    """
    opts = opts or ConvertOptions()
    src = os.fspath(src)
    dst = os.fspath(dst)
    if not os.path.isdir(src):
        raise ContainerError(f"{src}: source directory does not exist")
    cfg = load_config(src)
    block = fp8_block_size(cfg, os.path.join(src, "config.json"))
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise ContainerError(f"{dst}: destination exists and is not a directory")
    if os.path.isdir(dst) and os.path.samefile(src, dst):
        raise ContainerError(f"{dst}: destination must differ from the source directory")

    with SafeTensorsDir(src) as index:
        plans = plan_conversion(index, cfg, opts, block)
        for t in index.shadowed():
            _log(f"warning: {t.path}: tensor {t.name!r} duplicates an entry of an earlier file; ignored")
        for path in index.skipped:
            _log(f"warning: {path}: not a shard named by {INDEX_NAME}; skipped")
        for need in _IO_NAMES:
            if need not in index and verbose:
                _log(f"warning: {need} is missing from {src}; the engine needs it")
        copied = [n for n in COPY_FILES if os.path.isfile(os.path.join(src, n))]
        src_abs = os.path.abspath(src)
        manifest = _manifest(src_abs, index, cfg, opts, block, plans, copied, complete=False)

        if os.path.isdir(dst):
            _check_resumable(dst, manifest, plans)
            for n in os.listdir(dst):  # leftovers of an interrupted run
                if _TMP_RE.match(n):
                    os.remove(os.path.join(dst, n))
        todo = _shards_to_write(dst, plans, verbose)
        left = sum(output_bytes(plans[fi]) for fi in todo)
        _check_free_space(dst, left + 2 * len(_manifest_bytes(manifest))
                          + sum(os.path.getsize(os.path.join(src, n)) for n in copied))

        os.makedirs(dst, exist_ok=True)
        written = 0
        writing = MANIFEST_NAME
        bar = _progress(total=len(plans), desc="shards", unit="shard")
        try:
            _write_bytes_atomic(_manifest_bytes(manifest), os.path.join(dst, MANIFEST_NAME))
            for n in copied:
                writing = n
                _copy_if_changed(os.path.join(src, n), os.path.join(dst, n))
            bar.update(len(plans) - len(todo))
            for fi in todo:
                items = plans[fi]
                writing = output_name(fi)
                out: Dict[str, np.ndarray] = {}
                scales = _ScaleCache(index)
                for it in _progress(items, desc=output_name(fi), unit="t", leave=False):
                    _convert_item(index, it, out, scales, block)
                save_file_atomic(out, os.path.join(dst, output_name(fi)), os.path.join(dst, _tmp_name(fi)))
                del out
                left -= output_bytes(items)
                written += 1
                bar.update(1)
                if verbose:
                    _log(f"wrote {output_name(fi)} ({len(items)} tensors from "
                         f"{os.path.basename(index.paths[fi])})")
                if stop_after_shards is not None and written >= stop_after_shards:
                    raise ConvertInterrupted(f"stopped after {written} shard(s) as requested")
            writing = MANIFEST_NAME
            manifest = _manifest(src_abs, index, cfg, opts, block, plans, copied, complete=True)
            _write_bytes_atomic(_manifest_bytes(manifest), os.path.join(dst, MANIFEST_NAME))
        except OSError as e:
            if e.errno not in _FULL_ERRNOS:
                raise
            raise _disk_full_error(dst, writing, left) from e
        finally:
            bar.close()
        if verbose:
            kept = sum(1 for items in plans if items) - len(todo)
            _log(f"done: {written} shard(s) written, {kept} kept from an earlier run -> {dst}")
        return manifest


def _copy_if_changed(src_path: str, target: str) -> None:
    with open(src_path, "rb") as f:
        data = f.read()
    if os.path.isfile(target):
        with open(target, "rb") as f:
            if f.read() == data:
                return
    _write_bytes_atomic(data, target)


# ---------------------------------------------------------------------------
# command line


def _bits_arg(text: str) -> int:
    try:
        bits = int(text)
        quant.container_format(bits)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid bit width {text!r}: use 2..8 to quantize or >= 16 to keep float32"
        ) from None
    return bits


def _group_arg(text: str) -> int:
    try:
        return quant.check_group_size(int(text), "group size")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid group size {text!r}: use 0 (one scale per row) or 64, 128, 256, ... (64 times a power of 2)"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``convert`` arguments to ``parser``."""
    parser.add_argument("src", metavar="SRC", help="directory with the HF safetensors shards and config.json "
                        "(a model.safetensors.index.json, when present, must match the shards)")
    parser.add_argument("dst", metavar="DST", help="output directory (created; resumable; its file system "
                        "must have room for the whole output, checked before anything is written)")
    parser.add_argument("--expert-bits", type=_bits_arg, metavar="N", default=DEFAULT_BITS["expert"],
                        help="routed experts (default %(default)s)")
    parser.add_argument("--dense-bits", type=_bits_arg, metavar="N", default=DEFAULT_BITS["dense"],
                        help="attention, dense MLP, shared expert, eh_proj (default %(default)s)")
    parser.add_argument("--io-bits", type=_bits_arg, metavar="N", default=DEFAULT_BITS["io"],
                        help="embed_tokens and lm_head (default %(default)s)")
    parser.add_argument("--mtp-bits", type=_bits_arg, metavar="N", default=DEFAULT_BITS["mtp"],
                        help="every matrix of the MTP layer model.layers.{num_hidden_layers} "
                             "(default %(default)s)")
    parser.add_argument("--indexer-bits", type=_bits_arg, metavar="N", default=DEFAULT_BITS["indexer"],
                        help="DSA indexer projections (default %(default)s)")
    parser.add_argument("--group-size", type=_group_arg, metavar="N", default=0,
                        help="int4 matrices: one scale per N inputs of each row (64, 128, 256, ...; the "
                             "last group of a row partial) instead of one per row (0, the default). "
                             "colibrì's own converter writes 64 by default; the engine reads both. "
                             "Example: convert SRC DST --group-size 64")


def run(args: argparse.Namespace, _stop_after_shards: Optional[int] = None) -> int:
    """Run a conversion from parsed arguments; returns the exit status.

    ``_stop_after_shards`` (or the environment variable COLIBRI_CONVERT_STOP_AFTER)
    is a test hook that raises :class:`ConvertInterrupted` after that many shards
    were written.
    """
    stop = _stop_after_shards
    if stop is None and switch("CONVERT_STOP_AFTER"):
        stop = int(switch("CONVERT_STOP_AFTER"))
    try:
        opts = ConvertOptions(expert_bits=args.expert_bits, dense_bits=args.dense_bits,
                              io_bits=args.io_bits, mtp_bits=args.mtp_bits,
                              indexer_bits=args.indexer_bits, group_size=getattr(args, "group_size", 0))
        convert(args.src, args.dst, opts, stop_after_shards=stop)
    except (ContainerError, ValueError, OSError) as e:
        print(f"colibri convert: error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m colibri convert",
        description="Convert an HF glm_moe_dsa checkpoint into colibri's quantized container.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
