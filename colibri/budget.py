"""RAM budget and expert-cache sizing (spec §7.8), as an explicit, checkable projection.

Everything is in bytes (decimal GB only in messages). :func:`plan_ram` is a pure function of its
arguments; it reads the machine's available memory only when no ``ram_bytes`` is given.

Differences from the reference's ``cap_for_ram``:

- the budget's fallback (8 GB) applies only when available memory cannot be read at all; the
  reference also substitutes 8 GB when 0.88 × MemAvailable is below 4 GB, which overstates RAM on a
  small machine;
- MemAvailable is read in bytes (``kB`` in /proc/meminfo means KiB) and, on Linux, clamped to what
  the process's cgroup memory limit still allows (a container sees the host's MemAvailable);
- the MTP row is budgeted at its own expert size (``mtp_expert_bytes``) instead of "two more rows";
- the fixed slack of the reference (1.2 GB + 2.5 GB + 64 experts) is replaced by the caller's own
  numbers (``work_bytes``), the call working set below, and a page-cache reserve that scales with
  the model and is counted only when experts will actually stream from disk (see :func:`plan_ram`).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

__all__ = ["mem_available_bytes", "linux_mem_available_bytes", "RamPlan", "plan_ram", "budget_bytes", "BUDGET_FRACTION", "FALLBACK_BUDGET",
           "PAGE_CACHE_RESERVE_MAX", "EXTRA_CALL_EXPERTS"]

BUDGET_FRACTION = 0.88              # share of MemAvailable the engine may plan for
FALLBACK_BUDGET = 8_000_000_000     # when available memory is unknown
PAGE_CACHE_RESERVE_MAX = 2_500_000_000
EXTRA_CALL_EXPERTS = 16             # experts a call may hold beyond the LRU capacity
# The MTP tier: every expert of the MTP row held in RAM (pinned) when that takes at most this share
# of the room left for experts. Each draft step routes through the MTP layer, so a drafted token
# reads its experts up to depth times per iteration: per byte they are the most used experts of all,
# and a draft that waits on the disk for them costs more than it saves.
MTP_TIER_SHARE = 0.25
_UNLIMITED = 1 << 60                # cgroup v1 reports "no limit" as a huge number


# -- available memory ----------------------------------------------------------------------------

def _read_int(path):
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return -1
    try:
        return int(text)
    except ValueError:
        return None


def _stat_field(path, key):
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[0] == key:
                    return int(parts[1])
    except (OSError, ValueError):
        return None
    return 0


def _cgroup_level(d, v2):
    """Bytes the cgroup at folder d still allows (limit − usage + reclaimable file cache), or None
    when it has no limit (or no readable files)."""
    if v2:
        limit, usage = _read_int(os.path.join(d, "memory.max")), _read_int(os.path.join(d, "memory.current"))
        inactive = _stat_field(os.path.join(d, "memory.stat"), "inactive_file")
    else:
        limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
        usage = _read_int(os.path.join(d, "memory.usage_in_bytes"))
        inactive = _stat_field(os.path.join(d, "memory.stat"), "total_inactive_file")
    if limit is None or usage is None or limit < 0 or limit >= _UNLIMITED:
        return None
    return max(0, limit - usage + (inactive or 0))


def _cgroup_available(cgroup_root, proc_cgroup):
    """The tightest cgroup memory allowance of this process (v1 or v2), or None if unlimited."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":
            roots, v2 = [cgroup_root, os.path.join(cgroup_root, "unified")], True
        elif "memory" in controllers.split(","):
            roots, v2 = [os.path.join(cgroup_root, "memory")], False
        else:
            continue
        for root in roots:
            if not os.path.isdir(root):
                continue
            # Inside a container the mount usually shows the process's own cgroup at its root.
            leaf = os.path.join(root, rel) if rel and os.path.isdir(os.path.join(root, rel)) else root
            d = leaf
            while True:
                v = _cgroup_level(d, v2)
                if v is not None:
                    found.append(v)
                if os.path.normpath(d) == os.path.normpath(root):
                    break
                d = os.path.dirname(d)
            break
    return min(found) if found else None


def _darwin_available():
    try:
        page = int(subprocess.run(["sysctl", "-n", "hw.pagesize"], capture_output=True, text=True,
                                  timeout=5).stdout.strip())
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0
    pages = 0
    for key in ("Pages free", "Pages inactive", "Pages purgeable"):
        m = re.search(re.escape(key) + r":\s+(\d+)", out)
        if m:
            pages += int(m.group(1))
    return pages * page


def mem_available_bytes() -> int:
    """Memory available to this process now, in bytes; 0 if unknown.

    macOS: (free + inactive + purgeable pages) × page size, best effort. Elsewhere
    :func:`linux_mem_available_bytes` (0 where /proc/meminfo does not exist)."""
    if sys.platform == "darwin":
        return _darwin_available()
    return linux_mem_available_bytes()


def linux_mem_available_bytes(meminfo="/proc/meminfo", cgroup_root="/sys/fs/cgroup",
                              proc_cgroup="/proc/self/cgroup") -> int:
    """``MemAvailable`` of /proc/meminfo in bytes (MemFree + Buffers + Cached on kernels without
    it), lowered to what the process's cgroup memory limit still allows (limit − usage + inactive
    file cache, the tightest of the cgroup and its ancestors), v1 or v2; 0 if unreadable. The paths
    are parameters for testing."""
    fields = {}
    try:
        with open(meminfo) as f:
            for line in f:
                m = re.match(r"(\w+):\s+(\d+)\s*(kB)?", line)
                if m:
                    fields[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    except OSError:
        return 0
    if "MemAvailable" in fields:
        avail = fields["MemAvailable"]
    elif "MemFree" in fields:
        avail = fields["MemFree"] + fields.get("Buffers", 0) + fields.get("Cached", 0)
    else:
        return 0
    cg = _cgroup_available(cgroup_root, proc_cgroup)
    if cg is not None:
        avail = min(avail, cg)
    return int(avail)


# -- the plan ----------------------------------------------------------------------------------------

def _gb(n):
    """Bytes as GB, or MB below 1 GB (a small model's parts would all read 0.00 GB)."""
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e9 else f"{n / 1e6:.1f} MB"


@dataclass
class RamPlan:
    """The RAM projection of one engine configuration. ``projected_peak_bytes`` is exactly the sum
    of :meth:`components` (test it with that method, not by hand)."""
    budget_bytes: int
    resident_bytes: int             # dense weights and everything else the engine keeps resident
    kv_bytes: int                   # KV cache
    work_bytes: int                 # forward scratch, activations, logits (the caller's number)
    mtp_bytes: int                  # the MTP row's LRU: capacity × mtp_expert_bytes (0 without MTP)
    buffers_bytes: int              # the prefetch thread's expert in flight (largest row's size)
    page_cache_reserve_bytes: int   # counted only when experts stream from disk (see plan_ram); mapped
                                    # experts evicted from the LRU stay mapped within it
    expert_bytes: int               # one expert of a main MoE layer
    n_moe_rows: int                 # main MoE layers (the MTP row is not counted here)
    capacity: int                   # experts per row in the LRU
    pin_bytes: int                  # pinned hot-store
    projected_peak_bytes: int
    notes: list = field(default_factory=list)
    lru_bytes: int = 0              # capacity × n_moe_rows × expert_bytes
    call_bytes: int = 0             # experts a call holds beyond capacity (see plan_ram)
    mtp_expert_bytes: int = 0
    mtp_tier: bool = False          # every MTP expert pinned (mtp_bytes = n_experts × mtp_expert_bytes)
    n_experts: int = 0
    streaming: bool = False
    expert_avail_bytes: int = 0     # budget left for pins + LRU rows (for autopin_budget)
    budget_source: str = ""

    def components(self) -> dict:
        """The additive parts of the projection (their sum is projected_peak_bytes)."""
        return {"resident": self.resident_bytes, "kv": self.kv_bytes, "work": self.work_bytes,
                "buffers": self.buffers_bytes, "pins": self.pin_bytes, "lru": self.lru_bytes,
                "mtp": self.mtp_bytes, "call": self.call_bytes,
                "page_cache_reserve": self.page_cache_reserve_bytes}

    def summary(self) -> str:
        """One line: capacity, the projection by part, and the budget."""
        parts = ", ".join(f"{k} {_gb(v)}" for k, v in self.components().items() if v)
        return (f"[RAM] cache {self.capacity}/{self.n_experts} experts per layer "
                f"({self.n_moe_rows} MoE rows × {self.expert_bytes / 1e6:.2f} MB"
                + (f" + MTP row × {self.mtp_expert_bytes / 1e6:.2f} MB" if self.mtp_expert_bytes else "")
                + f"): projected peak {_gb(self.projected_peak_bytes)} of {_gb(self.budget_bytes)} "
                f"budget ({self.budget_source}) = {parts}"
                + (f"; {'; '.join(self.notes)}" if self.notes else ""))


def budget_bytes(ram_bytes=None, mem_available=None):
    """The RAM budget: (bytes, where it comes from, a note or None). ``ram_bytes`` when given, else
    BUDGET_FRACTION × ``mem_available`` (default: :func:`mem_available_bytes`), else
    FALLBACK_BUDGET when that is unknown."""
    if ram_bytes is not None:
        return int(ram_bytes), "given", None
    avail = mem_available_bytes() if mem_available is None else int(mem_available)
    if avail > 0:
        return int(BUDGET_FRACTION * avail), f"{BUDGET_FRACTION:g} × available {_gb(avail)}", None
    return FALLBACK_BUDGET, "assumed", f"available memory unknown: assuming a {_gb(FALLBACK_BUDGET)} budget"


def plan_ram(resident_bytes, kv_bytes, work_bytes, expert_bytes, n_moe_rows, n_experts,
             requested_capacity, pin_bytes=0, ram_bytes=None, mtp_expert_bytes=None,
             page_cache_reserve=None, *, extra_call_experts=EXTRA_CALL_EXPERTS, streaming=None,
             prefetch=True, mem_available=None, mtp_tier=True) -> RamPlan:
    """Size the per-layer expert LRU for the RAM budget.

    Budget: ``ram_bytes`` when given, else 0.88 × :func:`mem_available_bytes` (8 GB, with a note,
    when that is unknown). ``mem_available`` overrides the measurement (tests, or a value sampled
    once before model load as the reference does).

    Projection for a capacity c (all terms in bytes, each a field of the plan)::

        resident + kv + work + buffers + pins
        + c · n_moe_rows · expert_bytes            (lru)
        + c · mtp_expert_bytes                     (mtp; 0 without an MTP row)
        + min(extra_call_experts, n_experts − c) · max row expert size    (call)
        + page-cache reserve, when streaming

    - call: while one get() call runs, its experts are protected, so a row may briefly hold up to
      topk·S experts beyond capacity; ``extra_call_experts`` (default 16) bounds that, and a row
      never holds more than n_experts.
    - buffers: with ``prefetch``, the one expert the prefetch thread may hold before inserting it.
    - page-cache reserve (default ``min(2.5 GB, bytes of all experts of all rows)``): room left to
      the OS page cache under the loader. Unless the engine reads with O_DIRECT, the experts
      evicted from the LRU stay in memory within this reserve (the cache's kept tier,
      ``Model.keeps_evicted``): mapped ones as page-cache pages counted in the process's RSS while
      mapped, read ones in their buffers; a later use costs no read. It is counted only when experts are expected to stream
      from disk: ``streaming=None`` (auto) means "when the capacity is below n_experts" — a cache
      that holds every expert reads each one once and needs no page cache afterwards, and a reserve
      larger than the model's experts is pointless. ``streaming=True/False`` forces it.

    Capacity: ``requested_capacity`` > 0 is honoured (clamped to n_experts) unless the projection
    exceeds the budget, then lowered to the largest capacity that fits (with a note); 0 means auto,
    the largest capacity ≤ n_experts that fits. It is at least 1: if capacity 1 does not fit,
    ``ValueError`` says how much RAM is needed and what the budget was.

    ``expert_avail_bytes`` = budget − (resident + kv + work + buffers + call + reserve), at least 0:
    the room for pins and LRU rows under this plan, the input of ``usage.autopin_budget`` (plan
    once with pin_bytes=0, choose pins, plan again with their bytes).

    MTP tier (``mtp_tier``, an MTP row with routed experts, a capacity below n_experts): when
    n_experts × mtp_expert_bytes is at most ``MTP_TIER_SHARE`` of expert_avail_bytes, the MTP row
    holds every expert (``mtp_tier``; the engine pins them) and its term becomes
    n_experts × mtp_expert_bytes; the capacity is sized again with that term.
    """
    def nonneg(name, v):
        v = int(v)
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
        return v

    resident_bytes = nonneg("resident_bytes", resident_bytes)
    kv_bytes = nonneg("kv_bytes", kv_bytes)
    work_bytes = nonneg("work_bytes", work_bytes)
    expert_bytes = nonneg("expert_bytes", expert_bytes)
    n_moe_rows = nonneg("n_moe_rows", n_moe_rows)
    n_experts = int(n_experts)
    if n_experts < 1:
        raise ValueError(f"n_experts must be >= 1, got {n_experts}")
    requested_capacity = nonneg("requested_capacity", requested_capacity)
    pin_bytes = nonneg("pin_bytes", pin_bytes)
    mtp_eb = nonneg("mtp_expert_bytes", mtp_expert_bytes or 0)
    extra_call_experts = nonneg("extra_call_experts", extra_call_experts)
    notes = []

    if ram_bytes is not None:
        nonneg("ram_bytes", ram_bytes)
    budget, source, note = budget_bytes(ram_bytes, mem_available)
    if note:
        notes.append(note)

    row_sum = n_moe_rows * expert_bytes + mtp_eb       # one expert in every row
    max_eb = max(expert_bytes, mtp_eb)
    buffers = max_eb if prefetch else 0
    reserve_full = (min(PAGE_CACHE_RESERVE_MAX, n_experts * row_sum) if page_cache_reserve is None
                    else nonneg("page_cache_reserve", page_cache_reserve))
    fixed = resident_bytes + kv_bytes + work_bytes + buffers + pin_bytes

    def streams(c):
        return (c < n_experts) if streaming is None else bool(streaming)

    tier = False                        # the MTP row holds every expert (see mtp_tier)

    def parts(c):
        return (c * n_moe_rows * expert_bytes, (n_experts if tier else c) * mtp_eb,
                min(extra_call_experts, n_experts - c) * max_eb,
                reserve_full if streams(c) else 0)

    def total(c):
        return fixed + sum(parts(c))

    def fits(target):
        """The largest capacity <= target that fits (target when it does), or None (not even 1)."""
        if total(target) <= budget:
            return target
        if total(1) > budget:
            return None
        lo, hi = 1, target - 1                  # total(lo) fits, total(target) does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if total(mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def room(c):
        return max(0, budget - (resident_bytes + kv_bytes + work_bytes + buffers + sum(parts(c)[2:])))

    target = min(requested_capacity, n_experts) if requested_capacity > 0 else n_experts
    if requested_capacity > n_experts:
        notes.append(f"capacity {requested_capacity} clamped to the {n_experts} experts per layer")
    cap = fits(target)
    if cap is not None and mtp_tier and mtp_eb and cap < n_experts and \
            n_experts * mtp_eb <= MTP_TIER_SHARE * room(cap):
        tier = True
        cap = fits(target)
        if cap is None:                         # pins leave no room for the tier and one LRU expert
            tier = False
            cap = fits(target)
    if cap is None:
        need = total(1)
        l1, m1, c1, r1 = parts(1)
        raise ValueError(
            f"not enough RAM: even 1 cached expert per layer needs {_gb(need)} ({need} bytes: "
            f"resident {_gb(resident_bytes)}, KV {_gb(kv_bytes)}, work {_gb(work_bytes)}, pins "
            f"{_gb(pin_bytes)}, experts {_gb(l1 + m1 + c1 + buffers)}, page-cache reserve {_gb(r1)}), "
            f"but the budget is {_gb(budget)} ({budget} bytes, {source}); give more RAM, fewer pins "
            f"or a shorter context")
    if cap < target and requested_capacity > 0:
        notes.append(f"capacity lowered {target} -> {cap}: {target} would need "
                     f"{_gb(total(target))} of a {_gb(budget)} budget")
    lru, mtp, call, reserve = parts(cap)
    peak = fixed + lru + mtp + call + reserve
    avail_experts = room(cap)
    return RamPlan(budget_bytes=budget, resident_bytes=resident_bytes, kv_bytes=kv_bytes,
                   work_bytes=work_bytes, mtp_bytes=mtp, buffers_bytes=buffers,
                   page_cache_reserve_bytes=reserve, expert_bytes=expert_bytes,
                   n_moe_rows=n_moe_rows, capacity=cap, pin_bytes=pin_bytes,
                   projected_peak_bytes=peak, notes=notes, lru_bytes=lru, call_bytes=call,
                   mtp_expert_bytes=mtp_eb, mtp_tier=tier, n_experts=n_experts, streaming=streams(cap),
                   expert_avail_bytes=avail_experts, budget_source=source)
