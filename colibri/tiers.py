"""Expert tiers at start-up and after a generation: RAM budget, pins and usage learning.

``configure`` runs once after ``model_init`` (spec §7.2, §7.3, §7.8): it projects the RAM peak of
this configuration (resident weights, KV cache, working buffers, MTP row, LRU rows, pins), sizes the
per-layer LRU to the budget, and pins experts into the hot-store, from an explicit stats file
(``--pin FILE --pin-gb N``) or, with enough routing history saved next to the model, from that
history (autopin). ``Tiers.save_usage`` adds this run's routing counts to the history, atomically.
"""
from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from . import budget as _budget
from . import usage as _usage

#: Default hot-store budget of an explicit ``--pin FILE`` (the reference's PIN_GB).
PIN_GB_DEFAULT = 10.0


def expert_bytes_by_row(model) -> list:
    """RAM bytes of one cached expert for every cache row: the main layers (0 for dense ones) and
    the MTP row (0 without an MTP head). Container experts keep their stored size (payloads + row or group
    scales); float checkpoint experts are held at the precision they are quantized to at load
    time (``expert_bits``; the MTP row at least int8)."""
    c = model.cfg
    st = model.st
    out = []
    for layer in range(c.n_layers + 1):
        moe = (c.sparse[layer] if layer < c.n_layers else model.has_mtp)
        n = 0
        if moe and f"model.layers.{layer}.mlp.experts.0.gate_proj.weight.qs" in st:
            n = expert_disk_bytes(model, layer)            # container experts: as stored
        elif moe:
            bits = model.expert_bits if layer < c.n_layers else max(model.expert_bits, 8)
            for m in ("gate_proj", "up_proj", "down_proj"):
                O, I = st.info(f"model.layers.{layer}.mlp.experts.0.{m}.weight").shape
                n += _float_matrix_bytes(O, I, bits)
        out.append(n)
    return out


def expert_disk_bytes(model, layer: int, eid: int = 0) -> int:
    """Bytes one expert of this layer occupies on disk (payloads and their row or group scales)."""
    st, n = model.st, 0
    for m in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.{layer}.mlp.experts.{eid}.{m}.weight"
        n += st.info(name).nbytes
        if name + ".qs" in st:
            n += st.info(name + ".qs").nbytes
    return n


def _float_matrix_bytes(O: int, I: int, bits: int) -> int:
    """RAM of an [O, I] float matrix quantized at load time: f32, or int8/int4 rows + f32 scales."""
    if bits >= 16:
        return 4 * O * I
    return O * (I if bits == 8 else (I + 1) // 2) + 4 * O


#: The default ``--batch``: the whole context in one prefill forward (each streamed expert read
#: once per layer), halved down to MIN_BATCH rows while the forward's scratch would pass
#: WORK_SHARE of the RAM budget (every piece reads the experts it needs again).
MIN_BATCH = 256
WORK_SHARE = 0.125


def prefill_batch(model, ctx: int, ram_gb=None, requested: int = 0, mem_available=None) -> int:
    """Rows per prefill forward (Model.prefill's batch) in a context of ctx positions: requested
    when > 0, else the whole context, halved (not below MIN_BATCH) while the forward's scratch
    (work_bytes_estimate) would take more than WORK_SHARE of the RAM plan's budget
    (budget.budget_bytes of ram_gb and mem_available)."""
    if requested < 0:
        raise ValueError(f"--batch must be >= 1 (or 0 for the default), got {requested}")
    if requested:
        return int(requested)
    ctx = max(int(ctx), 1)
    budget, _, _ = _budget.budget_bytes(_gb(ram_gb), mem_available)
    n = ctx
    while n > MIN_BATCH and budget > 0 and work_bytes_estimate(model, ctx, n) > WORK_SHARE * budget:
        n = max(n // 2, MIN_BATCH)
    return max(n, 1)


def work_bytes_estimate(model, ctx: int, batch: int = 0) -> int:
    """Scratch of forwards in a context of ctx positions, the prompt forwarded batch rows at a time
    (0: all of it at once): the engine's Work buffers for a forward of min(ctx, batch) rows
    (``_core.work_bytes``, the formula Work allocates by), the prompt's
    residual rows and their copy (2 x [ctx, D]), a verify batch's logits and the fused FFN
    group's buffers, the batch GEMMs' packed rows and weight panels (``_core.gemm_scratch_bytes``),
    and the huge pages the expert buffers are being carved from (``_core.BUFFER_SLACK_BYTES``). ``model`` needs ``cfg`` and ``has_dsa``."""
    from . import _core
    c = model.cfg
    ctx = max(int(ctx), 1)
    S = _core.ABSORB_MAX_ROWS                  # verify batches (1 + up to 16 drafts)
    rows = min(ctx, batch) if batch > 0 else ctx    # a prefill forward's rows
    inter = max(c.dense_inter, c.moe_inter * max(c.n_shared, 1), c.moe_inter)
    kvb_rows = _core.expanded_key_rows(c, ctx, int(getattr(model, "absorb", -1)))
    work = _core.work_bytes(c, max(S, rows), ctx, bool(getattr(model, "has_dsa", True)), kvb_rows,
                            max(_core.max_threads(), 1))
    floats = 2 * ctx * c.hidden + S * c.vocab
    pairs = S * (c.topk + 1)
    ffn = _core.ffn_scratch_bytes(pairs, c.hidden, inter, max(_core.max_threads(), 1))
    # int4 matmuls' split activations (Model._split_scratch): a chunk of the widest rows
    widest = max(2 * c.hidden, c.q_lora, c.kv_lora, c.n_heads * c.v_head, inter)
    split = 2 * max(_core.chunk_rows(ctx) * _core.split_len(widest), kvb_rows * _core.split_len(c.kv_lora))
    nt = max(_core.max_threads(), 1)
    gemm = max(_core.gemm_scratch_bytes(_core.chunk_rows(ctx), widest, nt),
               _core.gemm_scratch_bytes(kvb_rows, c.kv_lora, nt))
    return int(work + 4 * floats + ffn + split + gemm + _core.BUFFER_SLACK_BYTES)


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc/self/statm; else the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(r) if sys.platform == "darwin" else int(r) * 1024


def runtime_bytes(model) -> int:
    """What the process holds besides the model's resident weights (interpreter, numpy, the
    tokenizer, loaded config): the RSS now minus the weights model_init loaded."""
    return max(current_rss_bytes() - int(model.resident_bytes()), 0)


@dataclass
class Tiers:
    """What ``configure`` decided, and the routing history to extend after the run."""
    plan: _budget.RamPlan
    pinned: int = 0
    pinned_bytes: int = 0
    pin_source: str = ""
    usage_file: str = ""
    history: np.ndarray = None
    history_total: int = 0
    warmed: int = 0
    warmed_bytes: int = 0
    warm_s: float = 0.0
    mtp_tier_bytes: int = 0         # the MTP row's experts pinned whole (the MTP tier)
    batch: int = 0                  # prompt rows per prefill forward (prefill_batch)
    notes: list = field(default_factory=list)

    def summary(self) -> str:
        s = self.plan.summary()
        if self.pinned:
            s += f"\n[PIN] hot-store: {self.pinned} experts in RAM ({self.pinned_bytes / 1e6:.1f} MB) from {self.pin_source}"
        if self.mtp_tier_bytes:
            s += (f"\n[PIN] MTP tier: every expert of the MTP layer in RAM ({self.mtp_tier_bytes / 1e6:.1f} MB): "
                  "drafts never wait on the disk")
        if self.warmed:
            s += (f"\n[RAM] every expert fits: {self.warmed} read at start-up ({self.warmed_bytes / 1e6:.1f} MB "
                  f"in {self.warm_s:.2f}s; --lazy-experts reads them on first use)")
        for n in self.notes:
            s += f"\n[RAM] {n}"
        return s

    def save_usage(self, model) -> str:
        """Add this run's routing counts to the history file (atomic write); returns its path."""
        if not self.usage_file:
            return ""
        counts = model.cache.usage.astype(np.int64)
        if self.history is not None and self.history.shape == counts.shape:
            counts = counts + self.history
        if counts.any():
            _usage.save_counts(self.usage_file, counts)
        return self.usage_file


def configure(model, ctx: int, *, requested: int = 0, ram_gb=None, pin=None, pin_gb=None,
              autopin: bool = True, prefetch: bool = True, learn: bool = True, runtime=None,
              warm: bool = True, progress=None, mtp_tier: bool = True, batch: int = 0) -> Tiers:
    """Size the expert cache for the RAM budget and pin experts; see the module docstring.

    requested: experts per layer asked for (0 = as many as the budget allows, up to all);
    ram_gb: the budget in GB (default 0.88 × available memory); pin/pin_gb: explicit pins from a
    stats file (``layer eid count`` lines); autopin: pin from the saved routing history;
    learn: keep the history file up to date (``Tiers.save_usage``); runtime: bytes the process holds
    besides the model (default: measured, see ``runtime_bytes``); warm: when the budget holds every
    routed expert, read them all now (``warm_all``; progress(done, total) after
    each) rather than on their first use mid-generation. mtp_tier: pin every expert of the MTP
    row when the plan takes the MTP tier (budget.MTP_TIER_SHARE; pass False without drafting).
    batch: prompt rows per prefill forward (prefill_batch; 0 = its default), kept in Tiers.batch."""
    c = model.cfg
    avail = None
    if ram_gb is None:
        # the budget counts what this process holds already (the resident weights model_init
        # loaded are no longer in MemAvailable, and the projection counts them)
        avail = _budget.mem_available_bytes()
        avail = avail + current_rss_bytes() if avail > 0 else None
    batch = prefill_batch(model, ctx, ram_gb, batch, avail)
    rows = expert_bytes_by_row(model)
    main = [b for b in rows[:c.n_layers] if b > 0]
    if not main:                                   # no routed experts at all: nothing to size
        plan = _budget.plan_ram(model.resident_bytes(), model.kv_bytes(ctx), work_bytes_estimate(model, ctx, batch),
                                1, 0, max(c.n_experts, 1), 1, ram_bytes=_gb(ram_gb))
        return Tiers(plan=plan, batch=batch)
    kw = dict(resident_bytes=model.resident_bytes(), kv_bytes=model.kv_bytes(ctx),
              work_bytes=work_bytes_estimate(model, ctx, batch) + (runtime_bytes(model) if runtime is None else int(runtime)),
              expert_bytes=max(main), n_moe_rows=len(main),
              n_experts=c.n_experts, requested_capacity=requested, ram_bytes=_gb(ram_gb),
              mtp_expert_bytes=rows[c.n_layers] or None, prefetch=prefetch, mtp_tier=mtp_tier)
    if ram_gb is None:
        kw["mem_available"] = avail
    plan = _budget.plan_ram(**kw)
    t = Tiers(plan=plan, batch=batch)
    if learn or autopin:
        t.usage_file = _usage.usage_path(model.path)
        t.history, skipped = _usage.load_counts(t.usage_file, c.n_layers + 1, c.n_experts, missing_ok=True)
        t.history_total = int(t.history.sum())
        if skipped:
            t.notes.append(f"{skipped} records of {t.usage_file} do not fit this model; ignored")
    items = []
    if pin:
        counts, _ = _usage.load_counts(pin, c.n_layers + 1, c.n_experts, strict="--pin")
        want = int((PIN_GB_DEFAULT if pin_gb is None else pin_gb) * 1e9)
        room = max(plan.expert_avail_bytes - sum(rows), 0)   # leave at least one LRU expert per row
        if want > room:
            t.notes.append(f"--pin-gb {want / 1e9:.2f} exceeds the {room / 1e9:.2f} GB left for experts; "
                           "pinning that much")
            want = room
        items = _usage.choose_pins(counts, want, rows)
        t.pin_source = pin
    elif autopin and plan.capacity < c.n_experts and t.history_total:
        want = _usage.autopin_budget(t.history_total, plan.expert_avail_bytes,
                                     _usage.autopin_floor(min(main)))
        if want:
            items = _usage.choose_pins(t.history, want, rows)
            t.pin_source = f"{t.usage_file} (autopin, {t.history_total} selections of history)"
    if plan.mtp_tier:
        items = [it for it in items if it[0] != c.n_layers]    # the tier holds that row whole
    if items:
        t.pinned_bytes = int(model.cache.pin(items))
        t.pinned = len(items)
        kw["pin_bytes"] = sum(rows[layer] for layer, _ in items)
        t.plan = plan = _budget.plan_ram(**kw)
    if plan.mtp_tier:
        # counted in the plan's mtp term, not in pin_bytes
        t.mtp_tier_bytes = int(model.cache.pin([(c.n_layers, e) for e in range(c.n_experts)]))
    # experts evicted from the LRU stay in memory (mapped, or in their buffers) within the plan's
    # page-cache reserve (the call allowance covers the experts a call adds to its row's LRU beyond
    # capacity)
    model.set_cache_capacity(plan.capacity, bool(prefetch), keep_bytes=plan.page_cache_reserve_bytes)
    if warm and plan.capacity >= c.n_experts:
        t0 = time.perf_counter()
        t.warmed, t.warmed_bytes = warm_all(model, progress)
        t.warm_s = time.perf_counter() - t0
    return t


def warm_all(model, progress=None):
    """Read every routed expert of the MoE layers and of the MTP head into the cache
    (ExpertCache.warm): (experts read, their bytes). They stay for the whole run, so each is read
    into memory of its own with its rows laid out for the integer tiles (Model.expert_load with
    own=True) rather than used in place in the file mapping. With a tqdm bar on a terminal when progress is None."""
    c = model.cfg
    rows = [layer for layer in range(c.n_layers) if c.sparse[layer]] + ([c.n_layers] if model.has_mtp else [])
    items = [(layer, e) for layer in rows for e in range(c.n_experts)]
    bar = None
    if progress is None and items:
        from tqdm import tqdm
        bar = tqdm(total=len(items), unit="expert", desc="[colibri] reading experts", disable=None,
                   leave=False, file=sys.stderr)
        progress = lambda done, total: bar.update(1) if total else None  # noqa: E731
    try:
        return model.cache.warm(items, progress, loader=functools.partial(model.expert_load, own=True))
    finally:
        if bar is not None:
            bar.close()


def _gb(x):
    return None if x is None else int(float(x) * 1e9)
