#!/usr/bin/env python3
"""Write a synthetic GLM-5 slice: a few decoder layers at GLM-5's real widths, with random weights,
straight into colibri's quantized container (no HF checkpoint of that size is needed).

Widths are GLM-5's (the spec's GLM-5 table, = transformers' ``GlmMoeDsaConfig()`` defaults):
vocab 154880, hidden 6144, 64 MLA heads (q_lora 2048, kv_lora 512, nope 192, rope 64, v 256),
dense intermediate 12288, 256 routed experts of intermediate 2048 (top-8, 1 shared), DSA indexer
32 heads x 128 with index_topk 2048 on every layer. Only the layer count is cut:
``--dense-layers`` (default 1) + ``--moe-layers`` (default 3), plus the MTP layer with ``--mtp``.

Container (engine spec 2.3, as ``python -m colibri convert`` writes it): a quantized matrix NAME
[O, I] is NAME (U8 1-D packed payload) + NAME.qs (F32 [O] row scales); norms, the router
(mlp.gate.weight) and e_score_correction_bias are F32. Each tensor is classified with the
converter's own ``classify`` and quantized at the converter's default bits (experts int4, dense
int4, embed/lm_head int8, MTP int8, indexer int8; the ``--*-bits`` flags change them).

Files: ``out-00000.safetensors`` (embed_tokens, lm_head, model.norm), then one file per decoder
layer (``out-00001`` = layer 0, ...), the MTP layer last. Each is written by streaming: the
safetensors header first (8-byte little-endian length + JSON, padded with spaces to a multiple of
8, tensors in ``safetensors.numpy.save_file`` order: dtype descending, then name ascending, so the
three payloads of a routed expert are adjacent, down/gate/up, and the engine reads an expert with
one pread), then the data chunk by chunk, so memory stays bounded whatever the slice size. Every
file goes to a temporary name, is fsynced, checked and renamed; a rerun with the same options
keeps the finished files (the values depend only on the seed and the tensor's name).

Values: a payload byte is uniformly random except that the most negative code (int4 -8, int8
-128, int2 -2) is folded onto 0, so every quantized value is symmetric with zero mean (a biased
code would add the same offset to every output row and grow layer after layer). A row's scale is
``sigma / std(v) * exp(N(0, 0.2))`` with ``sigma = 1/sqrt(fan_in)`` (``2/sqrt(hidden)`` for
lm_head: logits of std ~2; 1 for the embedding), so every projection keeps its input's size and
activations stay finite and of realistic size through the layers. Norm weights are 1 + N(0, 0.05),
biases N(0, 0.02), the router f32 N(0, 1/hidden). The numbers mean nothing: the slice is for
measuring load time, RAM, disk traffic and speed at the real widths, not for text quality.

Tokenizer: the embedded default model's byte-level BPE (4096 tokens) with placeholder tokens
``<|t{id}|>`` for every further id up to vocab_size, so each sampled id decodes to visible text.

``--shrink N`` divides every width by N (rope stays even, the indexer head >= rope, heads >= 1,
experts >= top-k, row lengths multiples of 4, vocab >= the tokenizer's 4096): the tests build such
a slice in seconds.

Example::

    python tools/make_glm5_slice.py /work/glm5-slice            # 17.0 GB, of which 14.5 GB int4 experts
    python -m colibri plan /work/glm5-slice
    python -m colibri run --model /work/glm5-slice "def f(x):" --max-tokens 8 --ram 8
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import shutil
import struct
import sys
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from colibri import quant
from colibri.config import parse_config
from colibri.convert import (DEFAULT_BITS, MANIFEST_NAME, MANIFEST_VERSION, ConvertOptions, _bits_arg,
                             _existing_output_ok, _manifest_bytes, _progress,
                             classify, expected_shape, output_name)
from colibri.st import ContainerError
from colibri.usage import fsync_dir, write_bytes_atomic

PROG = "make_glm5_slice.py"

#: GLM-5's widths (transformers' GlmMoeDsaConfig() defaults).
GLM5 = {
    "vocab_size": 154880,
    "hidden_size": 6144,
    "num_attention_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "intermediate_size": 12288,
    "n_routed_experts": 256,
    "moe_intermediate_size": 2048,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
}

#: GLM-5 / GLM-5.1's published config: rope_parameters.rope_theta 1e6 (GLM-5.2 uses 8e6), 202752
#: positions. (Spec §1/§11.9 only say where the value is read from; glm.c falls back to 10000.)
ROPE_THETA = 1_000_000
MAX_POSITIONS = 202752

#: Bytes generated and written at once (a multiple of 8: random_raw yields 64-bit words; 1 MiB
#: keeps the bit twiddling in cache).
CHUNK_BYTES = 1 << 20

#: log-normal spread of the per-row scales around their nominal value.
ROW_SCALE_SPREAD = 0.2

#: Placeholder token text for ids the small tokenizer has no token for.
FILLER = "<|t{}|>"

#: Bump when the values drawn for a tensor change (a rerun then refuses to mix old and new files).
VALUES_VERSION = 1

SYNTHETIC_NOTE = ("synthetic slice written by tools/make_glm5_slice.py: random weights at GLM-5 widths, "
                  "not a trained model (for measuring load time, RAM, disk traffic and speed)")

# safetensors orders a file's tensors by dtype descending (F32 after U8 in its dtype enum), then name
_DTYPE_RANK = {"U8": 0, "F32": 1}


class SliceError(ValueError):
    """Bad options or destination (the message names the option or the file)."""


# ---------------------------------------------------------------------------------------------
# dimensions and config.json


def shrunk_dims(n: int, tokenizer_vocab: int) -> dict:
    """GLM-5's widths divided by n, keeping the engine's constraints (n = 1: the real widths)."""
    if n < 1:
        raise SliceError(f"--shrink must be >= 1, got {n}")
    g = GLM5

    def width(key, lo=4, mult=4):          # a row length: multiple of 4 (no int4/int2 row padding)
        return max(lo, g[key] // n // mult * mult)

    rope = max(2, g["qk_rope_head_dim"] // n // 2 * 2)
    experts = max(2, g["n_routed_experts"] // n)
    d = {
        "vocab_size": max(g["vocab_size"] // n, tokenizer_vocab),
        "hidden_size": width("hidden_size", lo=16),
        "num_attention_heads": max(1, g["num_attention_heads"] // n),
        "q_lora_rank": width("q_lora_rank"),
        "kv_lora_rank": width("kv_lora_rank"),
        "qk_nope_head_dim": max(2, g["qk_nope_head_dim"] // n // 2 * 2),
        "qk_rope_head_dim": rope,
        "v_head_dim": width("v_head_dim"),
        "intermediate_size": width("intermediate_size"),
        "n_routed_experts": experts,
        "moe_intermediate_size": width("moe_intermediate_size"),
        "num_experts_per_tok": min(g["num_experts_per_tok"], experts),
        "n_shared_experts": g["n_shared_experts"],
        "index_n_heads": max(1, g["index_n_heads"] // n),
        "index_head_dim": max(rope, g["index_head_dim"] // n // 2 * 2),
        "index_topk": max(1, g["index_topk"] // n),
    }
    return d


def build_config(dims: dict, n_dense: int, n_moe: int, mtp: bool, eos_id: int) -> dict:
    """config.json as a GLM-5 checkpoint carries it, cut to n_dense + n_moe layers."""
    nl = n_dense + n_moe
    cfg = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": eos_id,
        "dtype": "bfloat16",
        "eos_token_id": [eos_id],
        "first_k_dense_replace": n_dense,
        "head_dim": dims["qk_rope_head_dim"],
        "hidden_act": "silu",
        "hidden_size": dims["hidden_size"],
        "index_head_dim": dims["index_head_dim"],
        "index_n_heads": dims["index_n_heads"],
        "index_topk": dims["index_topk"],
        "indexer_types": ["full"] * nl,   # GLM-5 runs its indexer on every layer (IndexShare came with 5.2)
        "initializer_range": 0.02,
        "intermediate_size": dims["intermediate_size"],
        "kv_lora_rank": dims["kv_lora_rank"],
        "max_position_embeddings": MAX_POSITIONS,
        "mlp_layer_types": ["dense"] * n_dense + ["sparse"] * n_moe,
        "model_type": "glm_moe_dsa",
        "moe_intermediate_size": dims["moe_intermediate_size"],
        "n_group": 1,
        "n_routed_experts": dims["n_routed_experts"],
        "n_shared_experts": dims["n_shared_experts"],
        "norm_topk_prob": True,
        "num_attention_heads": dims["num_attention_heads"],
        "num_experts_per_tok": dims["num_experts_per_tok"],
        "num_hidden_layers": nl,
        "num_key_value_heads": dims["num_attention_heads"],
        "num_nextn_predict_layers": 1 if mtp else 0,
        "pad_token_id": eos_id,
        "q_lora_rank": dims["q_lora_rank"],
        "qk_head_dim": dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"],
        "qk_nope_head_dim": dims["qk_nope_head_dim"],
        "qk_rope_head_dim": dims["qk_rope_head_dim"],
        "rms_norm_eps": 1e-05,
        "rope_interleave": True,
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_cache": True,
        "v_head_dim": dims["v_head_dim"],
        "vocab_size": dims["vocab_size"],
    }
    parse_config(cfg, "config.json")      # the engine's own validation, before anything is written
    return cfg


# ---------------------------------------------------------------------------------------------
# the plan: which tensors go in which file, and how their values are drawn


@dataclass(frozen=True)
class Tensor:
    """One tensor on disk. kind: 'payload' (packed quantized values of container fmt), 'scales'
    (the .qs row scales of such a payload), 'gauss' (f32 N(0, sigma²)), 'norm' (1 + N(0, 0.05²)),
    'bias' (N(0, 0.02²))."""

    name: str
    dtype: str                  # 'U8' | 'F32'
    shape: Tuple[int, ...]
    kind: str
    fmt: str = "f32"            # container of a payload / of the matrix a .qs belongs to
    sigma: float = 0.0          # std of the dequantized weights (payload/.qs), of the values (gauss)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (1 if self.dtype == "U8" else 4)

    def outputs(self):          # the interface convert._existing_output_ok reads
        return [(self.name, self.dtype, self.shape)]


@dataclass
class FilePlan:
    name: str
    tensors: List[Tensor]      # in on-disk order

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _matrix(name, O, I, cfg, bits, sigma, classes) -> List[Tensor]:
    """A 2-D weight, classified and quantized as the converter would: payload + .qs, or f32."""
    exp = expected_shape(name, cfg)
    assert exp is None or exp == (O, I), (name, exp, (O, I))
    cls = classify(name, 2, cfg["num_hidden_layers"])
    fmt = "f32" if cls == "f32" else quant.storage_format(bits[cls], O, I)
    _count(classes, cls, fmt)
    if fmt == "f32":
        return [Tensor(name, "F32", (O, I), "gauss", sigma=sigma)]
    return [Tensor(name, "U8", (quant.payload_nbytes(fmt, O, I),), "payload", fmt, sigma),
            Tensor(name + ".qs", "F32", (O,), "scales", fmt, sigma)]


def _vector(name, n, kind, cfg, classes) -> Tensor:
    assert classify(name, 1, cfg["num_hidden_layers"]) == "f32", name
    _count(classes, "f32", "f32")
    return Tensor(name, "F32", (n,), kind)


def _count(classes: dict, cls: str, fmt: str) -> None:
    """The manifest's per-class tally, as the converter keeps it."""
    c = classes.setdefault(cls, {"tensors": 0, "formats": {}})
    c["tensors"] += 1
    c["formats"][fmt] = c["formats"].get(fmt, 0) + 1


def _layer_tensors(i: int, cfg: dict, bits: Dict[str, int], classes: dict, *, sparse: bool,
                   indexer: bool, mtp: bool) -> List[Tensor]:
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    Lq, Lkv = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    p = f"model.layers.{i}."
    out: List[Tensor] = []

    def mat(suffix, O, I, sigma=None):
        out.extend(_matrix(p + suffix, O, I, cfg, bits, 1.0 / math.sqrt(I) if sigma is None else sigma,
                           classes))

    def vec(suffix, n, kind="norm"):
        out.append(_vector(p + suffix, n, kind, cfg, classes))

    vec("input_layernorm.weight", D)
    vec("post_attention_layernorm.weight", D)
    mat("self_attn.q_a_proj.weight", Lq, D)
    vec("self_attn.q_a_layernorm.weight", Lq)
    mat("self_attn.q_b_proj.weight", H * (dn + dr), Lq)
    mat("self_attn.kv_a_proj_with_mqa.weight", Lkv + dr, D)
    vec("self_attn.kv_a_layernorm.weight", Lkv)
    mat("self_attn.kv_b_proj.weight", H * (dn + dv), Lkv)
    mat("self_attn.o_proj.weight", D, H * dv)
    if indexer:
        nh, hd = cfg["index_n_heads"], cfg["index_head_dim"]
        mat("self_attn.indexer.wq_b.weight", nh * hd, Lq)
        mat("self_attn.indexer.wk.weight", hd, D)
        mat("self_attn.indexer.weights_proj.weight", nh, D)
        vec("self_attn.indexer.k_norm.weight", hd)
        vec("self_attn.indexer.k_norm.bias", hd, "bias")
    if not sparse:
        Id = cfg["intermediate_size"]
        mat("mlp.gate_proj.weight", Id, D)
        mat("mlp.up_proj.weight", Id, D)
        mat("mlp.down_proj.weight", D, Id)
    else:
        E, Ie = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        Is = Ie * cfg["n_shared_experts"]
        mat("mlp.gate.weight", E, D)                    # the router: classify keeps it f32
        vec("mlp.gate.e_score_correction_bias", E, "bias")
        if Is:
            mat("mlp.shared_experts.gate_proj.weight", Is, D)
            mat("mlp.shared_experts.up_proj.weight", Is, D)
            mat("mlp.shared_experts.down_proj.weight", D, Is)
        for e in range(E):
            mat(f"mlp.experts.{e}.gate_proj.weight", Ie, D)
            mat(f"mlp.experts.{e}.up_proj.weight", Ie, D)
            mat(f"mlp.experts.{e}.down_proj.weight", D, Ie)
    if mtp:
        mat("eh_proj.weight", D, 2 * D)
        vec("enorm.weight", D)
        vec("hnorm.weight", D)
        vec("shared_head.norm.weight", D)
    return out


def disk_order(tensors: Sequence[Tensor]) -> List[Tensor]:
    """safetensors.numpy.save_file's order: dtype descending, then name ascending."""
    return sorted(tensors, key=lambda t: (-_DTYPE_RANK[t.dtype], t.name))


def plan_slice(cfg: dict, bits: Dict[str, int], mtp: bool) -> Tuple[List[FilePlan], dict]:
    """Every output file with its tensors in on-disk order, and the manifest's class counts."""
    classes: dict = {}
    V, D, nl = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
    io = _matrix("model.embed_tokens.weight", V, D, cfg, bits, 1.0, classes)
    io += _matrix("lm_head.weight", V, D, cfg, bits, 2.0 / math.sqrt(D), classes)
    io.append(_vector("model.norm.weight", D, "norm", cfg, classes))
    files = [FilePlan(output_name(0), disk_order(io))]
    for i in range(nl):
        ts = _layer_tensors(i, cfg, bits, classes, sparse=cfg["mlp_layer_types"][i] == "sparse",
                            indexer=cfg["indexer_types"][i] == "full", mtp=False)
        files.append(FilePlan(output_name(i + 1), disk_order(ts)))
    if mtp:   # the MTP layer: a MoE layer (no indexer: the engine attends densely there) + its head
        ts = _layer_tensors(nl, cfg, bits, classes, sparse=True, indexer=False, mtp=True)
        files.append(FilePlan(output_name(nl + 1), disk_order(ts)))
    return files, classes


# ---------------------------------------------------------------------------------------------
# values


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """The generator of one tensor: depends only on the seed and the name (not on the order the
    tensors are written in, nor on the chunk size)."""
    words = np.frombuffer(hashlib.blake2b(name.encode(), digest_size=16).digest(), dtype="<u4")
    ss = np.random.SeedSequence(entropy=int(seed), spawn_key=tuple(int(w) for w in words))
    return np.random.Generator(np.random.SFC64(ss))


def _qmax(fmt: str) -> int:
    return {"int8": 127, "int4": 7, "int2": 1}[fmt]


def value_std(fmt: str) -> float:
    """Std of a quantized value drawn by :func:`fold_codes`: uniform codes with the most negative
    one folded onto 0, i.e. v in [-q, q] with P(v) = 1/(2q+2) and P(0) = 2/(2q+2):
    var = 2·Σ_{k<=q} k² / (2q+2) = q(2q+1)/6."""
    q = _qmax(fmt)
    return math.sqrt(q * (2 * q + 1) / 6.0)


#: per container: (field width in bits, XOR turning its codes into offset binary)
_FIELDS = {"int8": (8, 0x80), "int4": (4, 0x0), "int2": (2, 0x0)}


def _repeat(byte: int) -> np.uint64:
    return np.uint64(int.from_bytes(bytes([byte]) * 8, "little"))


def fold_codes(w: np.ndarray, fmt: str, tmp: Optional[np.ndarray] = None) -> None:
    """In place on packed uint64 words: map the most negative code of every value onto the code
    of 0 (int4 nibble 0 = -8 -> 8, int2 crumb 0 = -2 -> 2, int8 0x80 = -128 -> 0x00), so the
    values are symmetric with zero mean. SWAR: in offset binary (int8: XOR 0x80) the most negative
    code is an all-zero field; OR-ing each field's bits down into its lowest bit finds them, and
    setting such a field's top bit makes it the code of 0."""
    width, flip = _FIELDS[fmt]
    lsb = _repeat({8: 0x01, 4: 0x11, 2: 0x55}[width])
    if tmp is None:
        tmp = np.empty_like(w)
    if flip:
        np.bitwise_xor(w, _repeat(flip), out=w)
    np.right_shift(w, np.uint64(1), out=tmp)
    np.bitwise_or(tmp, w, out=tmp)                 # bit 0 of a field: bits 0..1 of it
    shift = 2
    while shift < width:                            # ... bits 0..width-1 (never the next field's)
        tmp |= tmp >> np.uint64(shift)
        shift *= 2
    np.bitwise_and(tmp, lsb, out=tmp)
    np.bitwise_xor(tmp, lsb, out=tmp)               # 1 at bit 0 of every all-zero field
    np.left_shift(tmp, np.uint64(width - 1), out=tmp)
    np.bitwise_or(w, tmp, out=w)
    if flip:
        np.bitwise_xor(w, _repeat(flip), out=w)


def _payload_chunks(t: Tensor, rng: np.random.Generator) -> Iterator[np.ndarray]:
    left = t.nbytes
    bitgen = rng.bit_generator
    tmp = np.empty(CHUNK_BYTES // 8, np.uint64)
    while left > 0:
        n = min(left, CHUNK_BYTES)
        w = bitgen.random_raw(-(-n // 8))            # the stream does not depend on the chunk size
        fold_codes(w, t.fmt, tmp[:w.shape[0]])
        yield w.view(np.uint8)[:n]
        left -= n


def _f32_chunks(t: Tensor, rng: np.random.Generator) -> Iterator[np.ndarray]:
    n_all = math.prod(t.shape)
    if t.kind == "scales":   # one scale per row: nominal sigma / std(v), log-normally spread
        s = t.sigma / value_std(t.fmt) * np.exp(rng.normal(0.0, ROW_SCALE_SPREAD, n_all))
        yield s.astype(np.float32)
        return
    if t.kind == "norm":
        yield (1.0 + 0.05 * rng.standard_normal(n_all, dtype=np.float32)).astype(np.float32)
        return
    if t.kind == "bias":
        yield (0.02 * rng.standard_normal(n_all, dtype=np.float32)).astype(np.float32)
        return
    assert t.kind == "gauss", t
    step = CHUNK_BYTES // 4
    for at in range(0, n_all, step):
        yield rng.standard_normal(min(step, n_all - at), dtype=np.float32) * np.float32(t.sigma)


def tensor_chunks(t: Tensor, seed: int) -> Iterator[np.ndarray]:
    """The bytes of tensor t (uint8 or float32 arrays, little-endian, in order)."""
    rng = tensor_rng(seed, t.name)
    return _payload_chunks(t, rng) if t.kind == "payload" else _f32_chunks(t, rng)


# ---------------------------------------------------------------------------------------------
# streaming safetensors writer


def header_bytes(tensors: Sequence[Tensor]) -> bytes:
    """The safetensors header for tensors in this (on-disk) order: u64 LE length + compact JSON
    padded with spaces to a multiple of 8 (as the safetensors library writes it)."""
    at = 0
    entries = {}
    for t in tensors:
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    js = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js


def write_file(path: str, plan: FilePlan, seed: int, bar=None, headers_only: bool = False) -> None:
    """Stream plan's tensors to a temporary name, fsync, check the header, rename into place.
    headers_only: the data region is left a hole (a sparse file of the full size, all zeros)."""
    d, base = os.path.split(path)
    tmp = os.path.join(d, f".{base}.tmp")
    with open(tmp, "wb") as f:
        head = header_bytes(plan.tensors)
        f.write(head)
        if headers_only:
            f.truncate(len(head) + plan.nbytes)
        for t in (() if headers_only else plan.tensors):
            wrote = 0
            for chunk in tensor_chunks(t, seed):
                raw = np.ascontiguousarray(chunk, dtype=chunk.dtype.newbyteorder("<")).view(np.uint8)
                f.write(raw)
                wrote += raw.nbytes
                if bar is not None:
                    bar.update(raw.nbytes)
            assert wrote == t.nbytes, (t.name, wrote, t.nbytes)
        f.flush()
        os.fsync(f.fileno())
        if hasattr(os, "posix_fadvise"):     # don't leave the slice in the page cache: runs start cold
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    ok, why = _existing_output_ok(tmp, plan.tensors)
    if not ok:   # pragma: no cover - a bug in this writer
        raise ContainerError(why)
    os.replace(tmp, path)
    fsync_dir(d or ".")


# ---------------------------------------------------------------------------------------------
# tokenizer and manifest


def small_tokenizer(vocab: int) -> Tuple[bytes, bytes, int]:
    """(tokenizer.json, tokenizer_config.json, eos id): the embedded default model's BPE, padded
    with placeholder tokens up to vocab ids."""
    from colibri.models import default_model_dir
    src = default_model_dir()
    with open(os.path.join(src, "tokenizer.json"), "rb") as f:
        tok = json.loads(f.read().decode("utf-8"))
    with open(os.path.join(src, "tokenizer_config.json"), "rb") as f:
        tcfg = f.read()
    base = tokenizer_base_vocab(tok)
    if vocab < base:
        raise SliceError(f"vocab_size {vocab} is below the tokenizer's {base} tokens")
    words = tok["model"]["vocab"]
    for i in range(base, vocab):
        w = FILLER.format(i)
        if w in words:   # pragma: no cover - the default tokenizer has no such token
            raise SliceError(f"placeholder token {w!r} already exists in the tokenizer")
        words[w] = i
    eos = next(a["id"] for a in tok["added_tokens"] if a["content"] == "<|endoftext|>")
    return json.dumps(tok, ensure_ascii=False, separators=(",", ":")).encode("utf-8"), tcfg, eos


def tokenizer_base_vocab(tok: Optional[dict] = None) -> int:
    """Ids the default tokenizer uses (learned tokens and added ones)."""
    if tok is None:
        from colibri.models import default_model_dir
        with open(os.path.join(default_model_dir(), "tokenizer.json"), "rb") as f:
            tok = json.loads(f.read().decode("utf-8"))
    ids = list(tok["model"]["vocab"].values()) + [a["id"] for a in tok.get("added_tokens", [])]
    return max(ids) + 1


def build_manifest(cfg, opts: ConvertOptions, files, classes, params, complete) -> dict:
    """colibri_convert.json as the converter writes it, plus a 'synthetic' section."""
    bits = opts.bits()
    return {
        "format": "colibri-container",
        "format_version": MANIFEST_VERSION,
        "complete": bool(complete),
        "source": "synthetic (tools/make_glm5_slice.py)",
        "source_shards": [],
        "shards": [{"source": None, "output": fp.name} for fp in files],
        "num_hidden_layers": int(cfg["num_hidden_layers"]),
        "bits": bits,
        "containers": {k: quant.container_format(v) for k, v in bits.items()},
        "quantization": {
            "scheme": "per-row symmetric, scale = max(amax/qmax, 1e-8), v = rint(w/s)",
            "payload": "NAME U8 1-D packed rows + NAME.qs F32 [O]",
        },
        "fp8_block_size": [128, 128],
        "classes": classes,
        "copied_files": [],
        "synthetic": dict(params, note=SYNTHETIC_NOTE),
    }


# ---------------------------------------------------------------------------------------------
# driver


def _check_destination(dst: str, files: List[FilePlan], manifest: dict) -> None:
    """A rerun may keep the files of an identical earlier run; anything else is refused."""
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise SliceError(f"{dst}: exists and is not a directory")
    if not os.path.isdir(dst):
        return
    mpath = os.path.join(dst, MANIFEST_NAME)
    present = sorted(n for n in os.listdir(dst) if n.endswith(".safetensors"))
    if os.path.exists(mpath):
        try:
            with open(mpath, "rb") as f:
                old = json.loads(f.read().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise SliceError(f"{mpath}: unreadable ({e}); use an empty destination directory") from None
        if not isinstance(old, dict) or "synthetic" not in old:
            raise SliceError(f"{dst}: holds a converted model, not a synthetic slice; use an empty "
                             "destination directory")
        for key in ("synthetic", "bits"):
            if old.get(key) != manifest[key]:
                raise SliceError(f"{dst}: holds a slice made with different options ({key} differ, see "
                                 f"{MANIFEST_NAME}); use an empty destination directory or the same options")
    elif present:
        raise SliceError(f"{dst}: holds .safetensors files but no {MANIFEST_NAME}; use an empty "
                         "destination directory")
    planned = {fp.name for fp in files}
    foreign = [n for n in present if n not in planned]
    if foreign:
        raise SliceError(f"{dst}: holds .safetensors files this slice would not write ({', '.join(foreign[:5])}); "
                         "the engine would index them too - remove them or use an empty destination directory")


def _check_space(dst: str, need: int) -> None:
    probe = dst
    while not os.path.isdir(probe):
        probe = os.path.dirname(os.path.abspath(probe))
    free = shutil.disk_usage(probe).free
    if need > free:
        raise SliceError(f"{dst}: the slice needs {need / 1e9:.1f} GB, only {free / 1e9:.1f} GB are free there")


def make_slice(dst: str, *, dense_layers: int = 1, moe_layers: int = 3, mtp: bool = False, seed: int = 0,
               shrink: int = 1, opts: Optional[ConvertOptions] = None, verbose: bool = True,
               headers_only: bool = False) -> dict:
    """Write the slice into dst. Returns a summary dict (files, bytes, seconds, ...).
    headers_only: every file is its header and a hole (sparse, zeros): for ``plan`` of a full-size
    model (e.g. 3 dense + 75 MoE layers + MTP, ~390 GB) in a few MB of disk. Not for running."""
    t0 = time.perf_counter()
    opts = opts or ConvertOptions()
    if dense_layers < 0 or moe_layers < 0 or dense_layers + moe_layers < 1:
        raise SliceError(f"--dense-layers {dense_layers} --moe-layers {moe_layers}: give at least one layer")
    if dense_layers + moe_layers > 128:
        raise SliceError("at most 128 layers (the engine's limit)")
    if seed < 0:
        raise SliceError(f"--seed must be >= 0, got {seed}")
    base_vocab = tokenizer_base_vocab()
    dims = shrunk_dims(shrink, base_vocab)
    tok_json, tok_cfg, eos = small_tokenizer(dims["vocab_size"])
    cfg = build_config(dims, dense_layers, moe_layers, mtp, eos)
    files, classes = plan_slice(cfg, opts.bits(), mtp)
    params = {"tool": "tools/make_glm5_slice.py", "values_version": VALUES_VERSION, "seed": int(seed),
              "shrink": int(shrink), "dense_layers": int(dense_layers), "moe_layers": int(moe_layers),
              "mtp": bool(mtp), "headers_only": bool(headers_only)}
    manifest = build_manifest(cfg, opts, files, classes, params, complete=False)
    _check_destination(dst, files, manifest)

    keep = set()
    if os.path.isdir(dst):
        for fp in files:
            path = os.path.join(dst, fp.name)
            if os.path.exists(path) and _existing_output_ok(path, fp.tensors)[0]:
                keep.add(fp.name)
    todo = [fp for fp in files if fp.name not in keep]
    sizes = {fp.name: len(header_bytes(fp.tensors)) + fp.nbytes for fp in files}
    need = sum(len(header_bytes(fp.tensors)) if headers_only else sizes[fp.name] for fp in todo)
    _check_space(dst, need)
    os.makedirs(dst, exist_ok=True)
    for n in os.listdir(dst):                  # leftovers of an interrupted run
        if n.startswith(".out-") and n.endswith(".safetensors.tmp"):
            os.remove(os.path.join(dst, n))

    write_bytes_atomic(os.path.join(dst, MANIFEST_NAME), _manifest_bytes(manifest))
    write_bytes_atomic(os.path.join(dst, "config.json"), (json.dumps(cfg, indent=2) + "\n").encode())
    gen = {"bos_token_id": eos, "eos_token_id": [eos], "pad_token_id": eos, "do_sample": True,
           "temperature": 1.0, "top_p": 0.95}
    write_bytes_atomic(os.path.join(dst, "generation_config.json"), (json.dumps(gen, indent=2) + "\n").encode())
    write_bytes_atomic(os.path.join(dst, "tokenizer.json"), tok_json)
    write_bytes_atomic(os.path.join(dst, "tokenizer_config.json"), tok_cfg)

    t_write = time.perf_counter()
    bar = _progress(total=need, desc="slice", unit="B", unit_scale=True, unit_divisor=1000)
    try:
        for fp in todo:
            if verbose and hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(fp.name, refresh=False)
            write_file(os.path.join(dst, fp.name), fp, seed, bar, headers_only)
    finally:
        bar.close()
    t_write = time.perf_counter() - t_write

    manifest = build_manifest(cfg, opts, files, classes, params, complete=True)
    write_bytes_atomic(os.path.join(dst, MANIFEST_NAME), _manifest_bytes(manifest))
    return {
        "dst": os.path.abspath(dst),
        "files": [fp.name for fp in files],
        "written": [fp.name for fp in todo],
        "kept": sorted(keep),
        "file_bytes": sizes,
        "bytes_total": sum(sizes.values()),
        "bytes_written": need,
        "write_s": t_write,
        "total_s": time.perf_counter() - t0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "config": {k: cfg[k] for k in ("num_hidden_layers", "first_k_dense_replace", "vocab_size",
                                       "hidden_size", "n_routed_experts", "moe_intermediate_size")},
        "resident_bytes": sum(t.nbytes for fp in files for t in fp.tensors if ".mlp.experts." not in t.name),
        "expert_bytes": _expert_bytes(files),
    }


def _expert_bytes(files: List[FilePlan]) -> Dict[int, int]:
    """Disk bytes of routed expert 0 of every MoE row (payloads + .qs), as `plan` counts them.
    (resident_bytes above: every other tensor, = Model.resident_bytes() for a container.)"""
    out = {}
    for fp in files:
        for t in fp.tensors:
            if ".mlp.experts.0." in t.name:
                layer = int(t.name.split(".")[2])
                out[layer] = out.get(layer, 0) + t.nbytes
    return out


def summary_text(s: dict) -> str:
    gb = s["bytes_written"] / 1e9
    if s["written"]:
        done = (f"wrote {len(s['written'])} file(s), {gb:.2f} GB in {s['write_s']:.1f} s "
                f"({gb / max(s['write_s'], 1e-9):.2f} GB/s)"
                + (f"; kept {len(s['kept'])} from an earlier run" if s["kept"] else ""))
    else:
        done = f"nothing to write: all {len(s['kept'])} files kept from an earlier run"
    lines = [done + f"; peak RSS {s['peak_rss_bytes'] / 1e6:.0f} MB",
             f"slice: {s['dst']} ({len(s['files'])} files, {s['bytes_total'] / 1e9:.2f} GB, "
             f"{s['config']['num_hidden_layers']} layers, {s['config']['n_routed_experts']} experts of "
             f"{max(s['expert_bytes'].values(), default=0) / 1e6:.1f} MB)",
             "try:",
             f"  python -m colibri plan {s['dst']}",
             f"  python -m colibri run --model {s['dst']} \"def f(x):\" --max-tokens 8 --ram 8"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="Write a synthetic GLM-5 slice (GLM-5's real widths, a few layers, random weights) "
                    "straight into colibri's quantized container.",
        epilog="example:\n"
               "  python tools/make_glm5_slice.py /work/glm5-slice            # 1 dense + 3 MoE layers, 17.0 GB\n"
               "  python tools/make_glm5_slice.py /tmp/s --shrink 16 --mtp    # every width / 16: a few MB\n"
               "  python -m colibri run --model /work/glm5-slice \"def f(x):\" --max-tokens 8 --ram 8",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dst", metavar="DST", help="output directory (created; a rerun keeps finished files)")
    ap.add_argument("--dense-layers", type=int, default=1, metavar="N", help="dense-MLP layers first (default 1)")
    ap.add_argument("--moe-layers", type=int, default=3, metavar="N", help="MoE layers after them (default 3)")
    ap.add_argument("--mtp", action="store_true",
                    help="add the MTP layer model.layers.{num_hidden_layers} (a MoE layer + eh_proj, enorm, "
                         "hnorm, shared_head.norm; int8 by default: +10 GB at full width)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0); same seed, same bytes")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")
    ap.add_argument("--headers-only", action="store_true",
                    help="write only the headers (the data are sparse holes, zeros): 'colibri plan' of a "
                         "full-size model, e.g. --dense-layers 3 --moe-layers 75 --mtp, in a few MB")
    ap.add_argument("--shrink", type=int, default=1, metavar="N",
                    help="divide every width by N (default 1: GLM-5's real widths)")
    for cls, what in (("expert", "routed experts"), ("dense", "attention, dense MLP, shared expert"),
                      ("io", "embed_tokens and lm_head"), ("mtp", "every matrix of the MTP layer"),
                      ("indexer", "DSA indexer projections")):
        ap.add_argument(f"--{cls}-bits", type=_bits_arg, default=DEFAULT_BITS[cls], metavar="N",
                        help=f"{what} (default {DEFAULT_BITS[cls]}, as 'colibri convert'; >= 16 keeps f32)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = ConvertOptions(expert_bits=args.expert_bits, dense_bits=args.dense_bits, io_bits=args.io_bits,
                              mtp_bits=args.mtp_bits, indexer_bits=args.indexer_bits)
        s = make_slice(args.dst, dense_layers=args.dense_layers, moe_layers=args.moe_layers, mtp=args.mtp,
                       seed=args.seed, shrink=args.shrink, opts=opts, headers_only=args.headers_only)
    except (SliceError, ContainerError, ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(s, indent=2) if args.json else summary_text(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
