"""``python -m colibri plan``: what a model will cost in RAM and disk, from safetensors headers alone.

No weight is loaded and no tensor data is read: only ``config.json`` and the safetensors headers.
The numbers are those the engine uses (or would get) when it runs the model:

- **resident**: the weights ``model_init`` keeps in RAM. ``resident.engine_bytes`` is exactly what
  ``Model.resident_bytes()`` returns: the QT bytes (payload + 4-byte row or group scales, or 4·O·I for f32)
  of embed, lm_head (once when tied), and per layer q_a, q_b, kv_a, kv_b, o_proj, the dense MLP or
  the shared experts, the DSA indexer's wq_b, wk, weights_proj, the norm vectors (f32), the
  indexer's k_norm weight and bias, the MoE router (f32 [n_experts, hidden]) and its correction
  bias, and the MTP head (its decoder layer except the routed experts, eh_proj, enorm, hnorm,
  shared_head.norm). ``uncounted`` is empty (kept for the JSON layout); ``total_bytes`` = engine.
- **experts**: one routed expert of every MoE row (gate, up, down: payloads + ``.qs`` scales for the
  container; for float tensors the bytes after the engine's load-time quantization at
  ``--expert-bits``, the MTP row never below int8) and the row totals; ``disk`` figures are the
  bytes read from disk per expert, as the engine counts its reads (tensor bytes + ``.qs``).
- **ram**: :func:`colibri.budget.plan_ram` with the inputs ``colibri.tiers.configure`` gives it:
  resident (engine count), KV cache of ``--ctx`` positions (``Model.kv_bytes``), work buffers
  (``tiers.work_bytes_estimate``) plus the process's runtime bytes, the largest main row's expert
  (RAM) bytes, the MoE row count, the MTP row's expert bytes. No pins are planned (pin_bytes = 0):
  ``pin_room_bytes`` is what an explicit ``--pin`` could use at most, as configure computes it.
- **per_token**: disk bytes a decoded token reads when no expert is in memory (hit rate 0 assumed:
  top-k experts in every MoE layer), the same under uniform, independent routing with the planned
  LRU (hit rate capacity / n_experts per row), the MTP row's reads per drafted token, and the
  resident weight bytes a token touches (all resident weights of the main model except the
  embedding matrix, of which one row is read; the MTP head only when drafting).

``--json`` prints one object with the keys documented in :func:`build_report`.
Exit status: 0; 1 when even one cached expert per layer does not fit the RAM budget (the report is
still printed, with ``ram.error``); 2 on bad input (missing folder, corrupt header, bad config).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from types import SimpleNamespace

from . import budget as _budget
from .config import ConfigError, indexer_missing, load_config
from .quant import infer_format, payload_nbytes, scale_group_size, storage_format
from .st import FLOAT_DTYPES, ContainerError, SafeTensorsDir

__all__ = ["PlanError", "DEFAULT_CTX", "kv_bytes", "work_bytes", "build_report", "add_arguments", "run",
           "main", "format_report"]

#: Context planned for when --ctx is not given (clamped to max_position_embeddings).
DEFAULT_CTX = 4096

#: Tensors whose presence means an MTP head (mirrors colibri._core.MTP_REQUIRED; tested equal).
MTP_REQUIRED = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                "input_layernorm.weight", "post_attention_layernorm.weight",
                "self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight")

_EXPERT_MATS = ("gate_proj", "up_proj", "down_proj")


class PlanError(ValueError):
    """Bad input for a plan (the message names the file or the option)."""


# ---------------------------------------------------------------------------------------------
# engine formulas, from the config alone


def kv_bytes(cfg, ctx: int, has_dsa: bool, has_mtp: bool) -> int:
    """``Model.kv_bytes(ctx)`` without a model: f32 latent + rope key per position for every layer
    and the MTP row, plus the indexer keys of full DSA layers."""
    per_pos = sum(4 * (cfg.kv_lora + cfg.qk_rope + (cfg.index_hd if (has_dsa and cfg.idx_full[i]) else 0))
                  for i in range(cfg.n_layers)) + (1 if has_mtp else 0) * 4 * (cfg.kv_lora + cfg.qk_rope)
    return per_pos * int(ctx)


def work_bytes(cfg, ctx: int, has_dsa: bool, batch: int = 0) -> int:
    """``tiers.work_bytes_estimate`` (it reads only the config)."""
    from .tiers import work_bytes_estimate
    return work_bytes_estimate(SimpleNamespace(cfg=cfg, has_dsa=has_dsa), ctx, batch)


# ---------------------------------------------------------------------------------------------
# tensor accounting


class _Acc:
    """Bytes of resident tensors, by group, as model_init would hold them."""

    def __init__(self, st: SafeTensorsDir, dense_bits: int, expert_bits: int):
        self.st = st
        self.dense_bits = dense_bits
        self.expert_bits = expert_bits
        self.groups = {}          # group -> bytes
        self.notes = []
        self.n_packed = 0
        self.n_float = 0

    def _info(self, name):
        info = self.st.get(name)
        if info is None:
            raise PlanError(f"{self.st.directory}: missing tensor {name}")
        return info

    def matrix(self, name: str, O: int, I: int, bits: int):
        """(RAM bytes, disk bytes) of a 2-D weight [O, I] loaded as _load_qt / _qt_from_float do."""
        info = self._info(name)
        if name + ".qs" in self.st:
            if info.dtype not in ("U8", "I8"):
                raise PlanError(f"{info.path}: {name} has a .qs scale but dtype {info.dtype}, expected U8")
            qs = self.st.info(name + ".qs")
            try:
                fmt = infer_format(info.nbytes, O, I, f"{info.path}: {name}")
                # per-row [O] or group scales [O, G] / [O·G]: the engine's own check
                scale_group_size(qs.shape, fmt, O, I, f"{qs.path}: {name}")
            except ContainerError as e:
                raise PlanError(str(e)) from None
            self.n_packed += 1
            # RAM: the payload + the scales as f32 (QT.nbytes); disk: both tensors as stored
            return info.nbytes + 4 * qs.numel, info.nbytes + qs.nbytes
        if info.dtype not in FLOAT_DTYPES:
            raise PlanError(f"{info.path}: tensor {name} has dtype {info.dtype}, which is neither a float "
                            "nor a packed payload with a .qs scale")
        if tuple(info.shape) != (O, I):
            raise PlanError(f"{info.path}: tensor {name} has shape {tuple(info.shape)}, expected ({O}, {I})")
        self.n_float += 1
        if bits >= 16:
            return 4 * O * I, info.nbytes
        return payload_nbytes(storage_format(bits, O, I), O, I) + 4 * O, info.nbytes

    def add(self, group: str, name: str, O: int, I: int, bits: int) -> int:
        ram, _ = self.matrix(name, O, I, bits)
        self.groups[group] = self.groups.get(group, 0) + ram
        return ram

    def vec(self, group: str, name: str, n: int) -> int:
        """A vector kept f32 (_load_vec)."""
        info = self._info(name)
        if info.numel != n:
            raise PlanError(f"{info.path}: tensor {name} has {info.numel} elements, expected {n}")
        if info.dtype not in FLOAT_DTYPES:
            raise PlanError(f"{info.path}: tensor {name} has dtype {info.dtype}, expected a float")
        self.groups[group] = self.groups.get(group, 0) + 4 * n
        return 4 * n

    def router(self, prefix: str, cfg) -> None:
        """The router weight, kept f32 whatever --dense-bits says, and its correction bias (zeros
        when the checkpoint has none: the engine allocates them anyway)."""
        name = prefix + "gate.weight"
        info = self._info(name)
        if info.dtype not in FLOAT_DTYPES:
            raise PlanError(f"{info.path}: tensor {name} has dtype {info.dtype}, expected a float")
        if tuple(info.shape) != (cfg.n_experts, cfg.hidden):
            raise PlanError(f"{info.path}: tensor {name} has shape {tuple(info.shape)}, "
                            f"expected ({cfg.n_experts}, {cfg.hidden})")
        self.groups["router"] = self.groups.get("router", 0) + 4 * cfg.n_experts * cfg.hidden
        bias = prefix + "gate.e_score_correction_bias"
        if bias in self.st:
            self.vec("router_bias", bias, cfg.n_experts)
        else:
            self.groups["router_bias"] = self.groups.get("router_bias", 0) + 4 * cfg.n_experts

    def expert(self, layer: int, eid: int, cfg, bits: int):
        """(RAM bytes, disk bytes) of routed expert eid of a layer."""
        p = f"model.layers.{layer}.mlp.experts.{eid}."
        ram = disk = 0
        for m in _EXPERT_MATS:
            O, I = (cfg.hidden, cfg.moe_inter) if m == "down_proj" else (cfg.moe_inter, cfg.hidden)
            r, d = self.matrix(f"{p}{m}.weight", O, I, bits)
            ram += r
            disk += d
        return ram, disk

    def fused_experts(self, layer: int, cfg, bits: int):
        """Per-expert (RAM, disk) bytes from fused 3-D tensors (experts.gate_up_proj [E, 2·inter,
        hidden], experts.down_proj [E, hidden, inter]) — the layout 'convert' splits; the engine
        itself cannot load it. None when the layer has no fused tensors."""
        p = f"model.layers.{layer}.mlp.experts."
        gu, dn = self.st.get(p + "gate_up_proj"), self.st.get(p + "down_proj")
        if gu is None or dn is None:
            return None
        E, inter, H = cfg.n_experts, cfg.moe_inter, cfg.hidden
        for info, shape in ((gu, (E, 2 * inter, H)), (dn, (E, H, inter))):
            if tuple(info.shape) != shape or info.dtype not in FLOAT_DTYPES:
                raise PlanError(f"{info.path}: fused tensor {info.name} is {info.dtype}{list(info.shape)}, "
                                f"expected a float tensor of shape {list(shape)}")
        ram = 0
        for O, I in ((inter, H), (inter, H), (H, inter)):
            ram += 4 * O * I if bits >= 16 else payload_nbytes(storage_format(bits, O, I), O, I) + 4 * O
        return ram, (gu.nbytes + dn.nbytes) // E


def _attention(acc: _Acc, cfg, layer: int, bits: int, group: str, norms: str) -> None:
    a = f"model.layers.{layer}.self_attn."
    acc.add(group, a + "q_a_proj.weight", cfg.q_lora, cfg.hidden, bits)
    acc.add(group, a + "q_b_proj.weight", cfg.n_heads * cfg.qk_head, cfg.q_lora, bits)
    acc.add(group, a + "kv_a_proj_with_mqa.weight", cfg.kv_lora + cfg.qk_rope, cfg.hidden, bits)
    acc.add(group, a + "kv_b_proj.weight", cfg.n_heads * (cfg.qk_nope + cfg.v_head), cfg.kv_lora, bits)
    acc.add(group, a + "o_proj.weight", cfg.hidden, cfg.n_heads * cfg.v_head, bits)
    acc.vec(norms, f"model.layers.{layer}.input_layernorm.weight", cfg.hidden)
    acc.vec(norms, f"model.layers.{layer}.post_attention_layernorm.weight", cfg.hidden)
    acc.vec(norms, a + "q_a_layernorm.weight", cfg.q_lora)
    acc.vec(norms, a + "kv_a_layernorm.weight", cfg.kv_lora)


def _expert_row(acc: _Acc, cfg, layer: int, bits: int) -> dict:
    """One MoE row: expert 0's bytes (what tiers.expert_bytes_by_row reports) and the totals over
    every expert (each one looked up: a missing expert is an error, as at model load)."""
    fused = None
    if f"model.layers.{layer}.mlp.experts.0.gate_proj.weight" not in acc.st:
        fused = acc.fused_experts(layer, cfg, bits)
    if fused is not None:
        ram, disk = fused
        acc.notes.append(f"layer {layer} stores fused 3-D expert tensors: the engine cannot load them, convert "
                         "the checkpoint first ('python -m colibri convert'); its experts are counted as "
                         "converted to --expert-bits")
        tot_ram, tot_disk = ram * cfg.n_experts, disk * cfg.n_experts
    else:
        ram, disk = acc.expert(layer, 0, cfg, bits)
        tot_ram, tot_disk = ram, disk
        for e in range(1, cfg.n_experts):
            r, d = acc.expert(layer, e, cfg, bits)
            tot_ram += r
            tot_disk += d
    return {"layer": layer, "n_experts": cfg.n_experts, "expert_bytes": ram, "expert_disk_bytes": disk,
            "layer_bytes": tot_ram, "layer_disk_bytes": tot_disk}


def _has_mtp(st, n_layers: int) -> bool:
    p = f"model.layers.{n_layers}."
    return all(p + name in st for name in MTP_REQUIRED)


# ---------------------------------------------------------------------------------------------
# the report


def _ctx_for(cfg, ctx):
    if ctx is None:
        return min(DEFAULT_CTX, cfg.max_positions) if cfg.max_positions else DEFAULT_CTX
    ctx = int(ctx)
    if ctx < 1:
        raise PlanError(f"--ctx must be >= 1, got {ctx}")
    if cfg.max_positions and ctx > cfg.max_positions:
        raise PlanError(f"--ctx {ctx} exceeds the model's context of {cfg.max_positions} positions "
                        "(max_position_embeddings)")
    return ctx


def build_report(model_dir, *, dense_bits: int = 32, expert_bits: int = 32, ctx=None, ram_gb=None,
                 cache_experts: int = 0, prefetch: bool = True, runtime_bytes=None, mem_available=None,
                 mtp_tier: bool = True, batch: int = 0) -> dict:
    """The plan of a model directory, as a JSON-ready dict. Raises :class:`PlanError`,
    ``ConfigError`` or ``ContainerError`` (each naming the file) on bad input.

    Keys (bytes everywhere, decimal):

    - ``model``: the directory; ``format``: "container" (every matrix packed with ``.qs``),
      "checkpoint" (floats only) or "mixed"; ``dense_bits``, ``expert_bits``: the bits applied to
      float tensors (container tensors keep theirs).
    - ``config``: n_layers, n_moe_layers, n_dense_layers, n_experts, topk, n_shared, hidden,
      moe_inter, vocab, max_positions, has_dsa, has_mtp, mtp_moe.
    - ``resident``: ``engine_bytes`` (= ``Model.resident_bytes()``), ``uncounted_bytes`` (what it
      leaves out), ``total_bytes`` (their sum), ``groups`` {embed, lm_head, attention, indexer,
      dense_mlp, shared_experts, norms, indexer_norms, router, router_bias, mtp_head} and
      ``uncounted`` (the names of the groups engine_bytes leaves out).
    - ``experts``: ``rows`` (one per main MoE layer: layer, n_experts, expert_bytes,
      expert_disk_bytes, layer_bytes, layer_disk_bytes), ``mtp`` (the same for the MTP row, or
      null), ``main_bytes`` (all main rows), ``total_bytes``, ``total_disk_bytes`` (MTP row included).
    - ``ctx``, ``kv_bytes``, ``kv_bytes_per_position``, ``work_bytes`` (``work_bytes_estimate``),
      ``runtime_bytes`` (added to the work bytes as configure does) and ``runtime_source``.
    - ``ram``: the :class:`~colibri.budget.RamPlan` fields (budget_bytes, budget_source,
      projected_peak_bytes, capacity, n_experts, streaming, resident_bytes, kv_bytes, work_bytes,
      buffers_bytes, lru_bytes, mtp_bytes, call_bytes, page_cache_reserve_bytes, pin_bytes,
      expert_bytes, mtp_expert_bytes, n_moe_rows, expert_avail_bytes, notes), ``requested_capacity``,
      ``pin_room_bytes``, ``one_cached_ram_bytes`` (peak with 1 cached expert per row),
      ``all_cached_ram_bytes`` (peak with every expert cached: no page-cache reserve, so it can be
      the smaller one), ``min_ram_bytes`` (the smallest budget under which this plan succeeds, with
      the requested capacity) and ``error`` (null, or why the budget is below min_ram_bytes; the
      plan fields are then absent).
    - ``per_token``: ``hit_rate_assumed`` (0.0), ``disk_bytes_cold`` (topk × Σ main rows' expert
      disk bytes), ``disk_bytes_uniform`` (cold × (1 − capacity / n_experts): uniform independent
      routing with the planned LRU, null without a plan), ``mtp_draft_disk_bytes`` (per drafted
      token, topk MTP experts, 0 without an MTP MoE row), ``resident_bytes_touched`` (main model)
      and ``mtp_resident_bytes_touched`` (per drafted token).
    - ``notes``: remarks (fused experts, FP8 block scales, disk vs RAM expert sizes).
    """
    model_dir = os.fspath(model_dir)
    for name, b in (("--dense-bits", dense_bits), ("--expert-bits", expert_bits)):
        if b not in (4, 8, 32):
            raise PlanError(f"{name} must be 4, 8 or 32, got {b}")
    if cache_experts < 0:
        raise PlanError(f"--cache-experts must be >= 0, got {cache_experts}")
    if ram_gb is not None and not (ram_gb > 0 and math.isfinite(ram_gb)):
        raise PlanError(f"--ram must be a positive number of GB, got {ram_gb}")
    if not os.path.isdir(model_dir):
        raise PlanError(f"{model_dir}: no such directory")
    cfg = load_config(model_dir)
    ctx = _ctx_for(cfg, ctx)
    with SafeTensorsDir(model_dir) as st:
        rep = _report(st, cfg, model_dir, dense_bits, expert_bits, ctx, batch, ram_gb, mem_available)
    _add_ram(rep, cfg, ctx, ram_gb, cache_experts, prefetch, runtime_bytes, mem_available, mtp_tier)
    return rep


def _report(st, cfg, model_dir, dense_bits, expert_bits, ctx, batch=0, ram_gb=None, mem_available=None) -> dict:
    from .tiers import prefill_batch
    acc = _Acc(st, dense_bits, expert_bits)
    notes = acc.notes
    has_dsa = cfg.dsa and indexer_missing(cfg, st, model_dir) is None
    batch = prefill_batch(SimpleNamespace(cfg=cfg, has_dsa=has_dsa), ctx, ram_gb, batch, mem_available)  # as `run`
    has_mtp = _has_mtp(st, cfg.n_layers)

    # embeddings and head: f32 unless --dense-bits 4 (model_init's io_bits)
    io_bits = 32 if dense_bits >= 8 else dense_bits
    embed = acc.add("embed", "model.embed_tokens.weight", cfg.vocab, cfg.hidden, io_bits)
    tied = "lm_head.weight" not in st
    if not tied:
        acc.add("lm_head", "lm_head.weight", cfg.vocab, cfg.hidden, io_bits)
    elif not cfg.tie_embeddings:
        raise PlanError(f"{model_dir}: missing tensor lm_head.weight")
    acc.vec("norms", "model.norm.weight", cfg.hidden)

    rows = []
    for i in range(cfg.n_layers):
        _attention(acc, cfg, i, dense_bits, "attention", "norms")
        if has_dsa and cfg.idx_full[i]:
            ix = f"model.layers.{i}.self_attn.indexer."
            acc.add("indexer", ix + "wq_b.weight", cfg.index_nh * cfg.index_hd, cfg.q_lora, dense_bits)
            acc.add("indexer", ix + "wk.weight", cfg.index_hd, cfg.hidden, dense_bits)
            acc.add("indexer", ix + "weights_proj.weight", cfg.index_nh, cfg.hidden, dense_bits)
            acc.vec("indexer_norms", ix + "k_norm.weight", cfg.index_hd)
            acc.vec("indexer_norms", ix + "k_norm.bias", cfg.index_hd)
        m = f"model.layers.{i}.mlp."
        if not cfg.sparse[i]:
            acc.add("dense_mlp", m + "gate_proj.weight", cfg.dense_inter, cfg.hidden, dense_bits)
            acc.add("dense_mlp", m + "up_proj.weight", cfg.dense_inter, cfg.hidden, dense_bits)
            acc.add("dense_mlp", m + "down_proj.weight", cfg.hidden, cfg.dense_inter, dense_bits)
            continue
        acc.router(m, cfg)
        if cfg.n_shared > 0:
            si = cfg.moe_inter * cfg.n_shared
            acc.add("shared_experts", m + "shared_experts.gate_proj.weight", si, cfg.hidden, dense_bits)
            acc.add("shared_experts", m + "shared_experts.up_proj.weight", si, cfg.hidden, dense_bits)
            acc.add("shared_experts", m + "shared_experts.down_proj.weight", cfg.hidden, si, dense_bits)
        rows.append(_expert_row(acc, cfg, i, expert_bits))
    main_groups = dict(acc.groups)

    mtp_row, mtp_moe = None, False
    if has_mtp:
        # the MTP head, never below int8 (model_init's _load_mtp); everything in one group
        NL = cfg.n_layers
        p = f"model.layers.{NL}."
        mb = max(dense_bits, 8)
        sub = _Acc(st, dense_bits, expert_bits)
        _attention(sub, cfg, NL, mb, "mtp_head", "mtp_head")
        mtp_moe = p + "mlp.gate.weight" in st
        if mtp_moe:
            sub.router(p + "mlp.", cfg)
            if cfg.n_shared > 0:
                si = cfg.moe_inter * cfg.n_shared
                sub.add("mtp_head", p + "mlp.shared_experts.gate_proj.weight", si, cfg.hidden, mb)
                sub.add("mtp_head", p + "mlp.shared_experts.up_proj.weight", si, cfg.hidden, mb)
                sub.add("mtp_head", p + "mlp.shared_experts.down_proj.weight", cfg.hidden, si, mb)
            mtp_row = _expert_row(sub, cfg, NL, max(expert_bits, 8))
        else:
            sub.add("mtp_head", p + "mlp.gate_proj.weight", cfg.dense_inter, cfg.hidden, mb)
            sub.add("mtp_head", p + "mlp.up_proj.weight", cfg.dense_inter, cfg.hidden, mb)
            sub.add("mtp_head", p + "mlp.down_proj.weight", cfg.hidden, cfg.dense_inter, mb)
        sub.add("mtp_head", p + "eh_proj.weight", cfg.hidden, 2 * cfg.hidden, mb)
        for v in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            sub.vec("mtp_head", p + v, cfg.hidden)
        acc.groups["mtp_head"] = sum(sub.groups.values())
        acc.n_packed += sub.n_packed
        acc.n_float += sub.n_float
        notes.extend(n for n in sub.notes if n not in notes)

    counted = ("embed", "lm_head", "attention", "indexer", "dense_mlp", "shared_experts", "norms",
               "indexer_norms", "router", "router_bias", "mtp_head")
    uncounted = ()                  # Model.resident_bytes() counts every resident group
    groups = {g: acc.groups.get(g, 0) for g in counted + uncounted}
    engine = sum(groups[g] for g in counted)
    extra = sum(groups[g] for g in uncounted)

    fmt = "container" if acc.n_float == 0 else ("checkpoint" if acc.n_packed == 0 else "mixed")
    if any(n.endswith("_scale_inv") for n in st.names()):
        notes.append("FP8 block-scaled tensors (*_scale_inv): the engine reads the e4m3 codes without their "
                     "block scales; convert the checkpoint first ('python -m colibri convert')")
    main_rows = rows
    all_rows = rows + ([mtp_row] if mtp_row else [])
    if any(r["expert_bytes"] != r["expert_disk_bytes"] for r in all_rows):
        notes.append("a float expert is smaller or larger in RAM (after --expert-bits) than on disk; the RAM plan "
                     "budgets the LRU with the RAM bytes, as the engine's tiers.configure does; disk figures use the disk bytes")

    # resident weights one decoded token reads: everything of the main model but the embedding
    # matrix, of which one row (the lm_head, or the tied matrix as lm_head, is read whole)
    main_resident = sum(v for g, v in main_groups.items())
    touched = main_resident - (main_groups["embed"] if not tied else 0) + (embed // cfg.vocab if not tied else 0)
    cold = cfg.topk * sum(r["expert_disk_bytes"] for r in main_rows)
    return {
        "model": model_dir,
        "format": fmt,
        "dense_bits": dense_bits,
        "expert_bits": expert_bits,
        "config": {"n_layers": cfg.n_layers, "n_moe_layers": len(main_rows),
                   "n_dense_layers": cfg.n_layers - len(main_rows), "n_experts": cfg.n_experts,
                   "topk": cfg.topk, "n_shared": cfg.n_shared, "hidden": cfg.hidden, "moe_inter": cfg.moe_inter,
                   "vocab": cfg.vocab, "max_positions": cfg.max_positions, "has_dsa": has_dsa,
                   "has_mtp": has_mtp, "mtp_moe": mtp_moe, "tied_embeddings": tied},
        "resident": {"engine_bytes": engine, "uncounted_bytes": extra, "total_bytes": engine + extra,
                     "groups": groups, "uncounted": list(uncounted)},
        "experts": {"rows": main_rows, "mtp": mtp_row,
                    "main_bytes": sum(r["layer_bytes"] for r in main_rows),
                    "total_bytes": sum(r["layer_bytes"] for r in all_rows),
                    "total_disk_bytes": sum(r["layer_disk_bytes"] for r in all_rows)},
        "ctx": ctx,
        "kv_bytes": kv_bytes(cfg, ctx, has_dsa, has_mtp),
        "kv_bytes_per_position": kv_bytes(cfg, 1, has_dsa, has_mtp),
        "batch": batch,
        "work_bytes": work_bytes(cfg, ctx, has_dsa, batch),
        "per_token": {"hit_rate_assumed": 0.0, "disk_bytes_cold": cold, "disk_bytes_uniform": None,
                      "mtp_draft_disk_bytes": cfg.topk * mtp_row["expert_disk_bytes"] if mtp_row else 0,
                      "resident_bytes_touched": touched,
                      "mtp_resident_bytes_touched": groups["mtp_head"]},
        "notes": notes,
    }


def _add_ram(rep, cfg, ctx, ram_gb, cache_experts, prefetch, runtime_bytes, mem_available, mtp_tier) -> None:
    """The RAM plan, with the inputs tiers.configure gives plan_ram."""
    from .tiers import current_rss_bytes
    res = rep["resident"]
    if runtime_bytes is None:
        # configure measures RSS − resident_bytes() after model_init: this process's RSS now (the
        # interpreter and numpy) plus the weights the engine holds but resident_bytes() leaves out.
        runtime_bytes = current_rss_bytes()
        source = "estimated: this process's RSS"
    else:
        runtime_bytes = int(runtime_bytes)
        source = "given"
    ram_bytes = None if ram_gb is None else int(float(ram_gb) * 1e9)
    rows = rep["experts"]["rows"]
    mtp = rep["experts"]["mtp"]
    out = {"requested_capacity": cache_experts, "error": None}
    if not rows:                       # no routed experts: configure plans a placeholder row
        kw = dict(resident_bytes=res["engine_bytes"], kv_bytes=rep["kv_bytes"], work_bytes=rep["work_bytes"],
                  expert_bytes=1, n_moe_rows=0, n_experts=max(cfg.n_experts, 1), requested_capacity=1,
                  ram_bytes=ram_bytes)
        runtime_bytes, source = 0, "not added (no MoE layer: configure adds none)"
    else:
        kw = dict(resident_bytes=res["engine_bytes"], kv_bytes=rep["kv_bytes"],
                  work_bytes=rep["work_bytes"] + runtime_bytes,
                  expert_bytes=max(r["expert_bytes"] for r in rows), n_moe_rows=len(rows),
                  n_experts=cfg.n_experts, requested_capacity=cache_experts, ram_bytes=ram_bytes,
                  mtp_expert_bytes=(mtp["expert_bytes"] if mtp else 0) or None, prefetch=prefetch)
    rep["runtime_bytes"] = runtime_bytes
    rep["runtime_source"] = source
    def peak(c):        # without the MTP tier: it is taken only where it fits
        return _budget.plan_ram(**dict(kw, requested_capacity=c, ram_bytes=1 << 62),
                                mtp_tier=False).projected_peak_bytes
    # The projection grows with the capacity while experts stream; caching every expert drops the
    # page-cache reserve and the call allowance, so it can need less than one cached expert per row.
    target = kw["n_experts"] if kw["requested_capacity"] == 0 else min(kw["requested_capacity"], kw["n_experts"])
    out["one_cached_ram_bytes"] = peak(1)
    out["all_cached_ram_bytes"] = peak(kw["n_experts"])
    out["min_ram_bytes"] = min(out["one_cached_ram_bytes"], peak(target))
    try:
        plan = _budget.plan_ram(**kw, mem_available=mem_available, mtp_tier=mtp_tier)
    except ValueError as e:
        out["error"] = str(e)
        rep["ram"] = out
        return
    fields = ("budget_bytes", "budget_source", "projected_peak_bytes", "capacity", "n_experts", "streaming",
              "resident_bytes", "kv_bytes", "work_bytes", "buffers_bytes", "lru_bytes", "mtp_bytes",
              "call_bytes", "page_cache_reserve_bytes", "pin_bytes", "expert_bytes", "mtp_expert_bytes",
              "mtp_tier", "n_moe_rows", "expert_avail_bytes")
    out.update({f: getattr(plan, f) for f in fields})
    out["notes"] = list(plan.notes)
    all_rows = [r["expert_disk_bytes"] for r in rows] + ([mtp["expert_disk_bytes"]] if mtp else [])
    out["pin_room_bytes"] = max(plan.expert_avail_bytes - sum(all_rows), 0) if rows else 0
    rep["ram"] = out
    if rows:
        miss = 1.0 - plan.capacity / cfg.n_experts
        rep["per_token"]["disk_bytes_uniform"] = int(round(rep["per_token"]["disk_bytes_cold"] * miss))


# ---------------------------------------------------------------------------------------------
# text


def _fmt(n) -> str:
    if n is None:
        return "-"
    n = int(n)
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.2f} {unit}"
    return f"{n} B"


def format_report(rep: dict) -> str:
    c, res, ex, ram, pt = rep["config"], rep["resident"], rep["experts"], rep["ram"], rep["per_token"]
    g = res["groups"]
    L = []
    kinds = [f"{c['n_layers']} layers ({c['n_moe_layers']} MoE, {c['n_dense_layers']} dense)",
             f"{c['n_experts']} experts top-{c['topk']}" + (f" + {c['n_shared']} shared" if c["n_shared"] else "")]
    if c["has_dsa"]:
        kinds.append("DSA indexer")
    if c["has_mtp"]:
        kinds.append("MTP head" + (" (MoE)" if c["mtp_moe"] else " (dense)"))
    L.append(f"model     {rep['model']}")
    L.append(f"format    {rep['format']}" + ("" if rep["format"] == "container" else
                                             f" (floats run at --dense-bits {rep['dense_bits']}, "
                                             f"--expert-bits {rep['expert_bits']})"))
    L.append(f"config    {', '.join(kinds)}")
    L.append("")
    L.append("resident weights")
    for k, v in g.items():
        if v:
            L.append(f"  {k:<28}{_fmt(v):>12}")
    L.append(f"  {'resident total':<28}{_fmt(res['total_bytes']):>12}   (= Model.resident_bytes)")
    L.append("")
    L.append(f"routed experts{'':<16}{'one expert':>12}{'layer':>12}{'on disk/expert':>16}")
    for r in ex["rows"] + ([ex["mtp"]] if ex["mtp"] else []):
        name = f"layer {r['layer']}" + (" (MTP)" if ex["mtp"] is r else "")
        L.append(f"  {name:<28}{_fmt(r['expert_bytes']):>12}{_fmt(r['layer_bytes']):>12}"
                 f"{_fmt(r['expert_disk_bytes']):>16}")
    L.append(f"  {'all experts':<28}{'':>12}{_fmt(ex['total_bytes']):>12}{_fmt(ex['total_disk_bytes']):>16} total")
    L.append("")
    L.append(f"context   {rep['ctx']} positions: KV cache {_fmt(rep['kv_bytes'])} "
             f"({_fmt(rep['kv_bytes_per_position'])}/position), work buffers {_fmt(rep['work_bytes'])} "
             f"(prompts in forwards of {rep['batch']} rows), "
             f"runtime {_fmt(rep['runtime_bytes'])} ({rep['runtime_source']})")
    if ram["error"]:
        L.append(f"RAM plan  DOES NOT FIT: {ram['error']}")
    else:
        cap = ram["capacity"]
        L.append(f"RAM plan  budget {_fmt(ram['budget_bytes'])} ({ram['budget_source']}): "
                 f"{cap} of {ram['n_experts']} experts cached per layer"
                 + (" (experts stream from disk)" if ram["streaming"] else
                    f" (all cached: run reads their {_fmt(ex['total_disk_bytes'])} at start-up, or on first "
                    "use with --lazy-experts)"))
        L.append(f"  projected peak {_fmt(ram['projected_peak_bytes'])} = resident {_fmt(ram['resident_bytes'])}"
                 f" + KV {_fmt(ram['kv_bytes'])} + work/runtime {_fmt(ram['work_bytes'])}"
                 f" + buffers {_fmt(ram['buffers_bytes'])} + LRU {_fmt(ram['lru_bytes'])}"
                 f" + MTP row {_fmt(ram['mtp_bytes'])} + call {_fmt(ram['call_bytes'])}"
                 f" + page-cache reserve {_fmt(ram['page_cache_reserve_bytes'])} (no pins)")
        L.append(f"  room for pins + LRU {_fmt(ram['expert_avail_bytes'])}; an explicit --pin may use up to "
                 f"{_fmt(ram['pin_room_bytes'])}")
        for n in ram["notes"]:
            L.append(f"  note: {n}")
    L.append(f"  RAM needed: at least {_fmt(ram['min_ram_bytes'])}; {_fmt(ram['one_cached_ram_bytes'])} with 1 "
             f"expert per layer, {_fmt(ram['all_cached_ram_bytes'])} with every expert cached")
    L.append("")
    L.append("per decoded token")
    L.append(f"  disk, cold (hit rate 0 assumed)   {_fmt(pt['disk_bytes_cold']):>12}   "
             f"(top-{c['topk']} x {c['n_moe_layers']} MoE layers x expert bytes)")
    if pt["disk_bytes_uniform"] is not None:
        L.append(f"  disk, uniform routing + this LRU  {_fmt(pt['disk_bytes_uniform']):>12}   "
                 f"(hit rate capacity/n_experts = {ram['capacity']}/{c['n_experts']})")
    if pt["mtp_draft_disk_bytes"]:
        L.append(f"  disk, per MTP draft (cold)        {_fmt(pt['mtp_draft_disk_bytes']):>12}")
    L.append(f"  resident weights read             {_fmt(pt['resident_bytes_touched']):>12}"
             + (f"   (+ {_fmt(pt['mtp_resident_bytes_touched'])} per MTP draft)" if c["has_mtp"] else ""))
    for n in rep["notes"]:
        L.append(f"note: {n}")
    return "\n".join(L)


# ---------------------------------------------------------------------------------------------
# command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` arguments to ``parser``."""
    parser.add_argument("model", nargs="?", default=None,
                        help="model directory (our container or an HF checkpoint; default: the embedded model)")
    from .options import add_arguments as add_options
    parser.add_argument("--ctx", type=int, default=None, metavar="N",
                        help=f"context positions to plan the KV cache for (default {DEFAULT_CTX}, "
                             "clamped to max_position_embeddings)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--cluster", default=None, metavar="N|GB,GB,...",
                        help="plan expert workers (--cluster): N machines of equal RAM, or each machine's RAM "
                             "in GB (the placement's weights): the experts and RAM each needs, the bytes "
                             "per token on the network")
    # the settings the plan depends on, as run takes them
    add_options(parser, only=PLAN_OPTIONS)


#: The colibri.options settings that change the plan.
PLAN_OPTIONS = ("dense_bits", "expert_bits", "ram_gb", "cache_experts", "prefetch", "batch")


def run(args: argparse.Namespace) -> int:
    """Print the plan; returns 0, 1 (the budget cannot hold even one expert per layer) or 2 (bad input)."""
    from .options import from_args
    try:
        o = from_args(args)
        model = args.model
        if model is None:
            from .models import default_model_dir
            model = default_model_dir()
        rep = build_report(model, dense_bits=o.dense_bits, expert_bits=o.expert_bits, ctx=getattr(args, "ctx", None),
                           ram_gb=o.ram_gb, cache_experts=o.cache_experts,
                           prefetch=o.prefetch_enabled, batch=o.batch)
        if getattr(args, "cluster", None):
            rep["cluster"] = cluster_plan(rep, _parse_workers(args.cluster))
    except (ConfigError, ContainerError, PlanError, ValueError, OSError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"colibri plan: error: {msg}", file=sys.stderr)
        return 2
    if getattr(args, "json", False):
        print(json.dumps(rep, indent=1))
    else:
        print(format_report(rep))
        if "cluster" in rep:
            print(format_cluster(rep["cluster"]))
    return 1 if rep["ram"]["error"] else 0


def _parse_workers(spec: str) -> dict:
    """'4' -> 4 workers of weight 1; '64,128' -> w0: 64, w1: 128 (GB of RAM)."""
    parts = [p.strip() for p in str(spec).split(",")]
    try:
        if len(parts) == 1 and parts[0].isdigit():
            n = int(parts[0])
            if not 1 <= n <= 64:
                raise ValueError
            return {f"w{i}": 1.0 for i in range(n)}
        gb = [float(p) for p in parts]
        if not all(g > 0 and g == g and g != float("inf") for g in gb):
            raise ValueError
    except ValueError:
        raise ValueError(f"--cluster {spec!r}: give N (1..64 machines) or each machine's RAM in GB (64,128,...)") from None
    return {f"w{i}": g for i, g in enumerate(gb)}


def cluster_plan(rep: dict, workers: dict) -> dict:
    """What each expert worker holds under colibri.cluster's placement (the same function), and
    the network bytes of a decoded token."""
    from .cluster_wire import placement, token_bytes
    c = rep["config"]
    rows = list(rep["experts"]["rows"]) + ([rep["experts"]["mtp"]] if rep["experts"]["mtp"] else [])
    owner = placement(c["n_layers"] + 1, c["n_experts"], [r["layer"] for r in rows], workers)
    names = sorted(workers)
    out = []
    for i, name in enumerate(names):
        n = sum(int((owner[r["layer"]] == i).sum()) for r in rows)
        b = sum(int((owner[r["layer"]] == i).sum()) * r["expert_bytes"] for r in rows)
        row = {"name": name, "weight": workers[name], "experts": n, "expert_bytes": b}
        out.append(row)
    return {"workers": out,
            "network_bytes_per_token": token_bytes(c["hidden"], c["topk"], len(names), c["n_moe_layers"]),
            "coordinator_bytes": rep["resident"]["total_bytes"] + rep["kv_bytes"]}


def format_cluster(cl: dict) -> str:
    lines = ["cluster: expert workers (RAM for their experts; add ~1 GB each for the process)"]
    for w in cl["workers"]:
        lines.append(f"  {w['name']}: {w['experts']} experts, {_fmt(w['expert_bytes'])}")
    lines.append(f"  coordinator: {_fmt(cl['coordinator_bytes'])} resident + KV; network "
                 f"{_fmt(cl['network_bytes_per_token'])} per decoded token")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m colibri plan",
                                 description="RAM and disk plan of a model, from its safetensors headers.")
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
