"""Replay recorded routing traces against expert-cache policies and project to GLM-5.2.

The engine keeps, for every MoE layer, a cache of N routed experts and loads the others from disk
on demand. ``python -m colibri run --trace FILE`` records which experts every MoE-layer call asked
for; this tool replays such a trace against several cache policies and any capacity N, without
running the model, and projects the disk traffic to GLM-5.2 dimensions.

    python tools/simulate_cache.py TRACE.jsonl [--cache 1,2,4,8|all] [--policies lru,lfu,...]
        [--pin-experts P] [--pin-from first-half|all] [--glm-cache 16] [--disk-gbs 2.0]
        [--json FILE]

Trace format (JSON Lines). Line 1 is a header object::

    {"format": "colibri-routing-trace", "version": 1, "model": PATH, "n_layers": L,
     "n_experts": E, "topk": K, "moe_layers": [...], "expert_bytes": {"<layer>": BYTES, ...}}

then one object per MoE-layer call, in execution order: ``{"f": forward, "l": layer,
"s": rows, "e": [unique expert ids, ascending]}``.

Policies (one cache per layer, capacity N experts, as in the engine):

* ``lru``        evict the least recently used expert. The experts of one call are requested in
                 ascending id order, so with N smaller than a call's expert count an expert loaded
                 by the call can be evicted by a later expert of the same call, as in the engine.
* ``lfu``        evict the lowest access count over the trace so far; ties: least recently used,
                 then lowest id.
* ``pinned+lru`` P pinned (layer, expert) pairs, always hits and outside the LRU slots, chosen as
                 the most requested pairs of a training part of the trace, plus an LRU of N.
* ``belady``     the offline optimum (evict the expert used farthest in the future, never-again
                 first, ties lowest id): the upper bound for any policy of capacity N.

Python API: :func:`load_trace`, :func:`simulate`, :func:`choose_pins`, :func:`closest_capacity`,
:func:`project_glm52`, :func:`main`. Sizes are decimal: 1 MB = 1e6 bytes, 1 GB = 1e9 bytes.
"""
from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Iterable, NamedTuple

FORMAT = "colibri-routing-trace"
VERSION = 1
POLICIES = ("lru", "lfu", "pinned+lru", "belady")
PROGRESS_MIN_CALLS = 100_000

# GLM-5.2: 75 MoE layers x 256 routed experts, top-8, int4 experts of three 2048x6144 matrices
# at 4 bits plus scales.
GLM52 = {"moe_layers": 75, "n_experts": 256, "topk": 8, "expert_mb": 18.9}
ASSUMPTION = ("assumes routing locality at equal cache fraction carries over; "
              "a tiny model is not GLM-5.2")


# -- trace ---------------------------------------------------------------------------------------

class Call(NamedTuple):
    """One MoE-layer call: forward index, layer, rows in the batch, expert ids (ascending)."""
    f: int
    l: int  # noqa: E741 (the trace's own key)
    s: int
    e: tuple


@dataclass
class Trace:
    """A loaded routing trace: the header, the calls, and the header fields the simulator uses."""
    header: dict
    calls: list
    n_experts: int
    moe_layers: tuple
    expert_bytes: dict  # layer -> bytes of one expert on disk
    path: str = ""


def _is_int(x) -> bool:
    return type(x) is int  # bool is not a count


def _check_header(h, where: str) -> Trace:
    """Validate the header object and return an empty Trace built from it."""
    if not isinstance(h, dict):
        raise ValueError(f"{where}: the header must be a JSON object")
    if h.get("format") != FORMAT:
        raise ValueError(f"{where}: not a routing trace (format {h.get('format')!r}, "
                         f"expected {FORMAT!r})")
    if h.get("version") != VERSION:
        raise ValueError(f"{where}: unsupported trace version {h.get('version')!r} "
                         f"(this tool reads version {VERSION})")
    for key in ("model", "n_layers", "n_experts", "topk", "moe_layers", "expert_bytes"):
        if key not in h:
            raise ValueError(f"{where}: header is missing key {key!r}")
    for key in ("n_layers", "n_experts", "topk"):
        if not _is_int(h[key]) or h[key] < 1:
            raise ValueError(f"{where}: header {key!r} must be a positive integer, got {h[key]!r}")
    moe = h["moe_layers"]
    if (not isinstance(moe, list) or not all(_is_int(x) and 0 <= x <= h["n_layers"] for x in moe)
            or len(set(moe)) != len(moe)):
        raise ValueError(f"{where}: header 'moe_layers' must be a list of distinct layer indices "
                         f"in [0, {h['n_layers']}], got {moe!r}")
    eb = h["expert_bytes"]
    if not isinstance(eb, dict):
        raise ValueError(f"{where}: header 'expert_bytes' must be an object {{layer: bytes}}")
    sizes = {}
    for layer in moe:
        b = eb.get(str(layer))
        if not _is_int(b) or b < 0:
            raise ValueError(f"{where}: header 'expert_bytes' needs a byte count for MoE layer "
                             f"{layer}, got {b!r}")
        sizes[layer] = b
    return Trace(header=h, calls=[], n_experts=h["n_experts"], moe_layers=tuple(moe),
                 expert_bytes=sizes)


def _check_call(obj, where: str, moe: frozenset, n_experts: int) -> Call:
    """Validate one call object and return it as a Call."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("f", "l", "s", "e"):
        if key not in obj:
            raise ValueError(f"{where}: call is missing key {key!r}")
    f, layer, s, e = obj["f"], obj["l"], obj["s"], obj["e"]
    if not _is_int(f) or f < 0:
        raise ValueError(f"{where}: forward index 'f' must be an integer >= 0, got {f!r}")
    if not _is_int(s) or s < 1:
        raise ValueError(f"{where}: row count 's' must be an integer >= 1, got {s!r}")
    if not _is_int(layer) or layer not in moe:
        raise ValueError(f"{where}: layer {layer!r} is not in the header's moe_layers")
    if not isinstance(e, list) or not all(_is_int(x) for x in e):
        raise ValueError(f"{where}: 'e' must be a list of integer expert ids, got {e!r}")
    if e and (min(e) < 0 or max(e) >= n_experts):
        bad = next(x for x in e if not 0 <= x < n_experts)
        raise ValueError(f"{where}: expert id {bad} outside [0, {n_experts})")
    if any(a >= b for a, b in zip(e, e[1:])):
        raise ValueError(f"{where}: expert ids must be unique and ascending, got {e!r}")
    return Call(f, layer, s, tuple(e))


def load_trace(path) -> Trace:
    """Read and strictly validate a routing trace (JSON Lines) -> :class:`Trace`.

    Raises ValueError naming the file and the 1-based line number on any malformed line. Blank
    lines are skipped; a trace with only the header is valid (no calls).
    """
    path = str(path)
    trace = None
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
            if trace is None:
                trace = _check_header(obj, where)
                moe = frozenset(trace.moe_layers)
                continue
            trace.calls.append(_check_call(obj, where, moe, trace.n_experts))
    if trace is None:
        raise ValueError(f"{path}:1: empty file, expected a {FORMAT!r} header line")
    trace.path = path
    return trace


# -- policies ------------------------------------------------------------------------------------
# Each cache serves one layer. access(experts) requests the experts of one call in order and
# returns how many were hits.

class _LRU:
    """Least recently used, with optional pinned experts that are always hits."""

    def __init__(self, capacity: int, pinned: Iterable[int] = ()):
        self.capacity = capacity
        self.pinned = frozenset(pinned)
        self.slots = OrderedDict()  # expert -> None, least recent first

    def access(self, experts) -> int:
        hits = 0
        slots, pinned = self.slots, self.pinned
        for x in experts:
            if x in pinned:
                hits += 1
            elif x in slots:
                slots.move_to_end(x)
                hits += 1
            else:
                if len(slots) >= self.capacity:
                    slots.popitem(last=False)
                slots[x] = None
        return hits


class _LFU:
    """Least frequently used (counts over the whole trace so far); ties LRU, then lowest id.

    Victims come from a heap of (count, last use, id) entries; entries made stale by a later
    access are skipped when popped and the heap is rebuilt when it grows too large.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.count = {}
        self.last = {}
        self.cached = set()
        self.heap = []
        self.clock = 0

    def access(self, experts) -> int:
        hits = 0
        count, last, cached, heap = self.count, self.last, self.cached, self.heap
        for x in experts:
            self.clock += 1
            c = count[x] = count.get(x, 0) + 1
            last[x] = self.clock
            if x in cached:
                hits += 1
            else:
                if len(cached) >= self.capacity:
                    self._evict()
                cached.add(x)
            heapq.heappush(heap, (c, self.clock, x))
        if len(heap) > 4 * self.capacity + 64:
            self.heap = [(count[x], last[x], x) for x in cached]
            heapq.heapify(self.heap)
        return hits

    def _evict(self):
        while True:
            c, t, x = heapq.heappop(self.heap)
            if x in self.cached and self.last[x] == t:
                self.cached.remove(x)
                return


class _Belady:
    """Offline optimum: evict the expert whose next use is farthest (never again first, then
    lowest id). ``next_use[i]`` is the position of the next request of the i-th request's expert
    in this layer's request sequence (``never`` when there is none)."""

    def __init__(self, capacity: int, next_use: list, never: int):
        self.capacity = capacity
        self.next_use = next_use
        self.never = never
        self.pos = 0
        self.cached = {}  # expert -> position of its next use
        self.heap = []  # (-next use, expert)

    def access(self, experts) -> int:
        hits = 0
        cached, heap, next_use = self.cached, self.heap, self.next_use
        for x in experts:
            nu = next_use[self.pos]
            self.pos += 1
            if x in cached:
                hits += 1
            elif len(cached) >= self.capacity:
                self._evict()
            cached[x] = nu
            heapq.heappush(heap, (-nu, x))
        if len(heap) > 4 * self.capacity + 64:
            self.heap = [(-nu, x) for x, nu in cached.items()]
            heapq.heapify(self.heap)
        return hits

    def _evict(self):
        while True:
            neg, x = heapq.heappop(self.heap)
            if self.cached.get(x) == -neg:
                del self.cached[x]
                return


def _next_uses(calls, layers) -> dict:
    """Per layer: (next-use positions of its request sequence, the 'never' marker)."""
    seqs = {layer: [] for layer in layers}
    for c in calls:
        seqs[c.l].extend(c.e)
    out = {}
    for layer, seq in seqs.items():
        never = len(seq)
        nxt = [never] * len(seq)
        seen = {}
        for i in range(len(seq) - 1, -1, -1):
            nxt[i] = seen.get(seq[i], never)
            seen[seq[i]] = i
        out[layer] = (nxt, never)
    return out


def _make_caches(trace: Trace, policy: str, capacity: int, pins, calls) -> dict:
    layers = trace.moe_layers
    if policy == "lru":
        return {layer: _LRU(capacity) for layer in layers}
    if policy == "lfu":
        return {layer: _LFU(capacity) for layer in layers}
    if policy == "pinned+lru":
        per_layer = {layer: set() for layer in layers}
        for layer, expert in pins or ():
            per_layer[layer].add(expert)
        return {layer: _LRU(capacity, per_layer[layer]) for layer in layers}
    nxt = _next_uses(calls, layers)
    return {layer: _Belady(capacity, *nxt[layer]) for layer in layers}


# -- simulation ----------------------------------------------------------------------------------

def _check_pins(trace: Trace, pins) -> set:
    pins = set(pins or ())
    moe = set(trace.moe_layers)
    for layer, expert in pins:
        if layer not in moe or not 0 <= expert < trace.n_experts:
            raise ValueError(f"pin ({layer}, {expert}) is not a (MoE layer, expert) of the trace")
    return pins


def _rate(num, den):
    return num / den if den else None


def _summary(requests, hits, nbytes, forwards) -> dict:
    misses = requests - hits
    return {"requests": requests, "hits": hits, "misses": misses, "bytes": nbytes,
            "hit_rate": _rate(hits, requests), "forwards": forwards,
            "misses_per_forward": _rate(misses, forwards),
            "mb_per_forward": _rate(nbytes / 1e6, forwards)}


def _progress(calls, desc):
    try:
        from tqdm import tqdm
    except ImportError:
        return calls
    return tqdm(calls, desc=desc, unit="call", leave=False, file=sys.stderr)


def simulate(trace: Trace, policy: str, capacity: int, pins=None, calls=None,
             progress: bool = False) -> dict:
    """Replay ``calls`` (default: all calls of ``trace``) through one cache per MoE layer.

    policy: one of POLICIES; capacity: experts cached per layer (>= 1); pins: (layer, expert)
    pairs for ``pinned+lru`` (ignored otherwise). Caches start empty.

    Returns a dict with ``total``, ``decode`` (calls with s == 1) and ``prefill`` (s > 1:
    prefill and speculative verifies) summaries -- requests, hits, misses, bytes, hit_rate,
    forwards, misses_per_forward, mb_per_forward -- and ``layers`` {layer: {requests, hits,
    misses, bytes}}, plus ``pinned_experts`` and ``pinned_bytes``.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if not _is_int(capacity) or capacity < 1:
        raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
    calls = trace.calls if calls is None else calls
    pins = _check_pins(trace, pins) if policy == "pinned+lru" else set()
    caches = _make_caches(trace, policy, capacity, pins, calls)
    ebytes = trace.expert_bytes
    layer_req = dict.fromkeys(trace.moe_layers, 0)
    layer_hit = dict.fromkeys(trace.moe_layers, 0)
    kind = {True: [0, 0, 0, set()], False: [0, 0, 0, set()]}  # decode?: req, hits, bytes, fwds
    it = _progress(calls, f"{policy} N={capacity}") if progress else calls
    for f, layer, s, e in it:
        hits = caches[layer].access(e)
        n = len(e)
        layer_req[layer] += n
        layer_hit[layer] += hits
        k = kind[s == 1]
        k[0] += n
        k[1] += hits
        k[2] += (n - hits) * ebytes[layer]
        k[3].add(f)
    layers = {layer: {"requests": layer_req[layer], "hits": layer_hit[layer],
                      "misses": layer_req[layer] - layer_hit[layer],
                      "bytes": (layer_req[layer] - layer_hit[layer]) * ebytes[layer]}
              for layer in trace.moe_layers}
    dec, pre = kind[True], kind[False]
    total = _summary(dec[0] + pre[0], dec[1] + pre[1], dec[2] + pre[2], len(dec[3] | pre[3]))
    total["calls"] = len(calls)
    return {"policy": policy, "capacity": capacity, "total": total,
            "decode": _summary(dec[0], dec[1], dec[2], len(dec[3])),
            "prefill": _summary(pre[0], pre[1], pre[2], len(pre[3])),
            "layers": layers, "pinned_experts": len(pins),
            "pinned_bytes": sum(ebytes[layer] for layer, _ in pins)}


def choose_pins(trace: Trace, budget: int, calls=None) -> set:
    """The ``budget`` most requested (layer, expert) pairs of ``calls`` (default: all calls).

    Every (MoE layer, expert) pair of the trace is ranked by request count, ties broken by lower
    layer, then lower expert id (so unrequested pairs fill a budget larger than the requested
    ones, and a budget of layers x experts pins everything).
    """
    if not _is_int(budget) or budget < 0:
        raise ValueError(f"pin budget must be an integer >= 0, got {budget!r}")
    calls = trace.calls if calls is None else calls
    counts = Counter()
    for c in calls:
        for x in c.e:
            counts[c.l, x] += 1
    pairs = [(layer, x) for layer in sorted(trace.moe_layers) for x in range(trace.n_experts)]
    pairs.sort(key=lambda p: (-counts[p], p[0], p[1]))
    return set(pairs[:budget])


# -- GLM-5.2 projection --------------------------------------------------------------------------

def closest_capacity(capacities, n_experts: int, glm_cache: int = 16) -> tuple:
    """The capacity N whose fraction N/n_experts is closest to glm_cache/256 (ties: the smaller
    N) -> (N, N / n_experts)."""
    target = glm_cache / GLM52["n_experts"]
    best = min(sorted(set(capacities)), key=lambda n: abs(min(n, n_experts) / n_experts - target))
    return best, min(best, n_experts) / n_experts


def project_glm52(hit_rate, disk_gbs: float = 2.0) -> dict:
    """Disk traffic per decoded token on GLM-5.2 at a given expert hit rate.

    GB/token = (1 - hit_rate) x 8 x 75 x 18.9 MB; the decode speed bound from disk alone is
    disk_gbs / GB per token (None when nothing is read). hit_rate None -> values None.
    """
    full_gb = GLM52["topk"] * GLM52["moe_layers"] * GLM52["expert_mb"] / 1000
    out = {"hit_rate": hit_rate, "disk_gbs": disk_gbs, "gb_per_token_uncached": full_gb,
           "gb_per_token": None, "tok_s_bound": None}
    if hit_rate is not None:
        gb = (1.0 - hit_rate) * full_gb
        out["gb_per_token"] = gb
        out["tok_s_bound"] = disk_gbs / gb if gb > 0 else None
    return out


# -- command line --------------------------------------------------------------------------------

def _parse_caches(text: str, n_experts: int) -> list:
    caps = set()
    for part in text.split(","):
        part = part.strip()
        if part == "all":
            caps.add(n_experts)
            continue
        try:
            n = int(part)
        except ValueError:
            raise ValueError(f"--cache: {part!r} is not a number or 'all'") from None
        if n < 1:
            raise ValueError(f"--cache: capacity must be >= 1 (use 'all' for every expert), "
                             f"got {n}")
        caps.add(n)
    return sorted(caps)


def _parse_policies(text: str) -> list:
    pols = [p.strip() for p in text.split(",") if p.strip()]
    for p in pols:
        if p not in POLICIES:
            raise ValueError(f"--policies: unknown policy {p!r}; choose from {', '.join(POLICIES)}")
    return [p for p in POLICIES if p in pols]


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="simulate_cache.py",
        description="Replay a routing trace (python -m colibri run --trace FILE) against "
                    "expert-cache policies (lru, lfu, pinned+lru, belady) for several per-layer "
                    "capacities, and project the disk traffic to GLM-5.2.",
        epilog=f"GLM-5.2 projection: {ASSUMPTION}. Only decode calls (s == 1) count for it.")
    p.add_argument("trace", help="routing trace, JSON Lines")
    p.add_argument("--cache", default="1,2,4,8", metavar="LIST",
                   help="comma list of per-layer capacities; 'all' = every expert "
                        "(default 1,2,4,8)")
    p.add_argument("--policies", default=",".join(POLICIES), metavar="LIST",
                   help=f"comma list of policies (default {','.join(POLICIES)})")
    p.add_argument("--pin-experts", type=int, default=None, metavar="P",
                   help="pinned+lru: total pinned experts over all layers "
                        "(default: one per MoE layer)")
    p.add_argument("--pin-from", choices=("first-half", "all"), default="first-half",
                   help="pinned+lru: choose pins on the first half of the calls and report the "
                        "second half (default, honest), or choose them on all calls "
                        "(optimistic upper bound)")
    p.add_argument("--glm-cache", type=int, default=16, metavar="N52",
                   help="GLM-5.2 experts cached per layer, out of 256 (default 16)")
    p.add_argument("--disk-gbs", type=float, default=2.0, metavar="GBS",
                   help="disk read speed in GB/s for the decode speed bound (default 2.0)")
    p.add_argument("--json", metavar="FILE", help="write all results as JSON")
    return p


def _runs(trace: Trace, policies, caps, pin_budget, pin_from) -> list:
    """(label, part, calls, pins) for every simulation the command line asks for."""
    calls = trace.calls
    half = len(calls) // 2
    runs = [(p, "all", calls, None) for p in policies if p != "pinned+lru"]
    if "pinned+lru" in policies:
        if pin_from == "all":
            pins = choose_pins(trace, pin_budget, calls)
            runs.append(("pinned+lru", "all (pins from all: optimistic)", calls, pins))
        else:
            pins = choose_pins(trace, pin_budget, calls[:half])
            runs.append(("lru", "second half", calls[half:], None))
            runs.append(("pinned+lru", "second half (pins from first half)", calls[half:], pins))
    return runs


def _fmt(x, spec: str, none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def _md_table(headers, rows) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def _results_table(trace: Trace, results: list) -> str:
    """Markdown table: one row per (policy, evaluated part, capacity)."""
    headers = ["policy", "N", "N/E", "evaluated on", "hit rate", "decode hit", "s>1 hit",
               "misses/fwd", "MB/fwd", "pinned MB"]
    rows = []
    for r in results:
        t = r["total"]
        frac = min(r["capacity"], trace.n_experts) / trace.n_experts
        pinned = f"{r['pinned_bytes'] / 1e6:.1f}" if r["policy"] == "pinned+lru" else ""
        rows.append([r["policy"], r["capacity"], f"{frac:.3f}", r["part"],
                     _fmt(t["hit_rate"], ".1%"), _fmt(r["decode"]["hit_rate"], ".1%"),
                     _fmt(r["prefill"]["hit_rate"], ".1%"), _fmt(t["misses_per_forward"], ".2f"),
                     _fmt(t["mb_per_forward"], ".2f"), pinned])
    return _md_table(headers, rows)


def _projection_text(trace: Trace, results: list, pj: dict) -> str:
    """The GLM-5.2 projection: assumptions, matched capacity, a table, the s>1 calls."""
    out = [f"GLM-5.2 projection ({GLM52['moe_layers']} MoE layers x {GLM52['n_experts']} "
           f"experts, top-{GLM52['topk']}, {GLM52['expert_mb']} MB per int4 expert; "
           f"{pj['gb_per_token_uncached']:.2f} GB per token uncached)",
           f"GLM-5.2 cache {pj['glm_cache']}/{GLM52['n_experts']} = {pj['glm_fraction']:.4f} of "
           f"a layer's experts; matched N = {pj['capacity']} of {trace.n_experts} "
           f"(fraction {pj['matched_fraction']:.4f}); decode calls (s == 1) only",
           f"Note: {ASSUMPTION}.", ""]
    rows = []
    for p in pj["policies"]:
        bound = p["tok_s_bound"]
        if bound is None and p["gb_per_token"] == 0:
            bound = "unbounded"
        else:
            bound = _fmt(bound, ".2f")
        rows.append([p["policy"], p["part"], _fmt(p["hit_rate"], ".1%"),
                     _fmt(p["gb_per_token"], ".3f"), bound])
    out.append(_md_table(["policy", "evaluated on", "decode hit", "GB/token",
                          f"tok/s bound @ {pj['disk_gbs']:g} GB/s"], rows))
    for p in pj["policies"]:
        if "effective_fraction" in p:
            out.append(f"{p['policy']} also holds its pinned experts: effective cache fraction "
                       f"{p['effective_fraction']:.4f} (N plus pins per layer, over E)")
    for r in results:
        pr = r["prefill"]
        if r["capacity"] == pj["capacity"] and pr["requests"]:
            out.append(f"prefill/verify calls (s>1), {r['policy']} on {r['part']}: "
                       f"{pr['requests']} requests, hit {_fmt(pr['hit_rate'], '.1%')}, "
                       f"{_fmt(pr['mb_per_forward'], '.2f')} MB per forward")
    return "\n".join(out)


def _report(trace: Trace, results: list, pj: dict) -> str:
    """The whole text report printed by main."""
    calls = trace.calls
    n_dec = sum(1 for c in calls if c.s == 1)
    h = trace.header
    head = [f"trace {trace.path}: model {h.get('model')}, {len(trace.moe_layers)} MoE layers x "
            f"{trace.n_experts} experts, top-{h.get('topk')}",
            f"calls: {len(calls)} ({n_dec} decode s=1, {len(calls) - n_dec} prefill/verify s>1)"]
    return "\n\n".join(["\n".join(head), _results_table(trace, results),
                        _projection_text(trace, results, pj)])


def _projection(trace: Trace, results: list, caps, glm_cache: int, disk_gbs: float) -> dict:
    cap, frac = closest_capacity(caps, trace.n_experts, glm_cache)
    pj = project_glm52(None, disk_gbs)
    pj.update(glm_cache=glm_cache, glm_fraction=glm_cache / GLM52["n_experts"], capacity=cap,
              matched_fraction=frac, assumption=ASSUMPTION, policies=[])
    for r in results:
        if r["capacity"] == cap:
            row = project_glm52(r["decode"]["hit_rate"], disk_gbs)
            row.update(policy=r["policy"], part=r["part"])
            if r["policy"] == "pinned+lru":
                per_layer = r["pinned_experts"] / len(trace.moe_layers)
                row["effective_fraction"] = min(1.0, (cap + per_layer) / trace.n_experts)
            pj["policies"].append(row)
    return pj


def main(argv=None) -> int:
    """Command line entry point; returns the exit status (0 ok, 2 bad input)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.glm_cache < 1 or args.glm_cache > GLM52["n_experts"]:
            raise ValueError(f"--glm-cache must be in [1, {GLM52['n_experts']}]")
        if not args.disk_gbs > 0:
            raise ValueError("--disk-gbs must be > 0")
        trace = load_trace(args.trace)
        caps = _parse_caches(args.cache, trace.n_experts)
        policies = _parse_policies(args.policies)
        if not policies:
            raise ValueError("--policies: no policy given")
        budget = len(trace.moe_layers) if args.pin_experts is None else args.pin_experts
        runs = _runs(trace, policies, caps, budget, args.pin_from)
    except (OSError, ValueError) as exc:
        print(f"simulate_cache: error: {exc}", file=sys.stderr)
        return 2
    progress = len(trace.calls) > PROGRESS_MIN_CALLS
    results = []
    for label, part, calls, pins in runs:
        for cap in caps:
            r = simulate(trace, label, cap, pins=pins, calls=calls, progress=progress)
            r["part"] = part
            results.append(r)
    pj = _projection(trace, results, caps, args.glm_cache, args.disk_gbs)
    print(_report(trace, results, pj))
    if args.json:
        doc = {"trace": {"path": trace.path, "header": trace.header, "calls": len(trace.calls)},
               "settings": {"cache": caps, "policies": policies, "pin_experts": budget,
                            "pin_from": args.pin_from, "glm_cache": args.glm_cache,
                            "disk_gbs": args.disk_gbs},
               "results": results, "glm52_projection": pj}
        try:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=1)
        except OSError as exc:
            print(f"simulate_cache: error: cannot write {args.json}: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
