#!/usr/bin/env python3
"""Project MTP speculative decoding to GLM-5.2: seconds per token at draft depth 0..4, for a RAM
budget and a disk's GB/s, from parts each measured or taken from a stated source.

A draft + verify iteration at depth d costs the draft chain of d tokens, one verify forward of
k = d + 1 rows and the MTP absorb of the accepted rows, and emits E(d) tokens:

    s/token(d) = [chain(d) + verify(k) + absorb(E)] / E(d),      E(d) = 1 + A_1 + ... + A_d

where A_i is the acceptance of draft position i (the fraction of verifies whose first i drafts were
all accepted: ``acceptance_by_position`` of ``--stats-json``). Depth 0 is one 1-row forward.

1. **Compute at GLM-5's widths** (`--slice`, from ``tools/make_glm5_slice.py DIR --mtp``), in one
   process, every expert the calls need resident (so compute and RAM traffic only): per layer kind
   (dense, MoE) and for the embedding + final norm + lm_head, a k-row verify forward, k = 1..5,
   sampled interleaved. A MoE layer's time is split into a per-forward part f(k) (attention,
   router, shared expert) and a per-routed-expert part e (one expert's three matrices applied to
   its rows): every k runs twice, with k distinct tokens and with one token k times (the trace
   gives each batch's expert union U), and e is the least-squares slope of time over U. The draft
   chain of d = 1..4 tokens and the absorb of k rows are timed as they are (the MTP layer is one
   layer in GLM-5 as in the slice). Full model: 3 dense + 75 MoE layers (``--layers``).
2. **Reads** from ``colibri plan`` of GLM-5.2's tensor table (a header-only copy, made here) at the
   RAM budget: the experts it caches per layer, the uniform-routing reads of a token's 8 × 75
   experts, the MTP layer's reads per draft token. A verify forward of k rows reads U(k)/8 times a
   token's reads; the drafts' MTP reads are added per draft token.
3. **The expert union U(k)** of k consecutive tokens. From a routing trace (``--trace``, written by
   ``python -m colibri run --trace FILE --draft 0``: windows of k consecutive decode calls per
   layer), or for GLM-5.2, where no trace is at hand, from the published fraction p of a token's
   top-8 experts that the previous token also chose (41.3% on GLM-5.2, field notes): U(k) =
   8 (1 + (k - 1)(1 - p)), an upper bound (overlap with older tokens only shrinks it). With a trace
   the report gives both, measured and the formula at the trace's own p, so the bound can be judged.
4. **Acceptance** A_i: named curves (``--accept NAME=A1,A2,A3,A4``), the acceptance of a
   ``tools/bench_spec.py --json`` run (``--bench-spec``: every configuration's deepest depth), and
   by default the published range of GLM-5.2's int8 MTP head (39–59% per draft, field notes) and
   DeepSeek-V3's own MTP (85%, its second-token acceptance) as geometric curves A_i = c^i.

Usage::

    python tools/make_glm5_slice.py /work/glm5-slice --mtp
    python -m colibri run --trace /tmp/trace.jsonl --draft 0 "def f(x):" --max-tokens 256
    python tools/project_spec.py --slice /work/glm5-slice --trace /tmp/trace.jsonl \\
        --bench-spec /tmp/spec.json --json /tmp/projection.json

The report (markdown) goes to stdout; ``--json`` keeps every number. ``--costs FILE`` reuses the
slice measurements of an earlier ``--json`` (the projection is quick to redo with other inputs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import emit_worker_result, log, machine_info, markdown_table, worker_result  # noqa: E402
from bench_glm5 import FULL_DENSE, FULL_MOE, prompt_ids  # noqa: E402

MAX_ROWS = 5                  # verify forwards of 1..5 rows (depths 0..4)
MAX_DRAFTS = MAX_ROWS - 1
GLM52_PREV_OVERLAP = 0.413    # GLM-5.2: share of a token's top-8 the previous token chose (field notes)
PUBLISHED_ACCEPT = (            # acceptance per draft, published (field notes)
    ("GLM-5.2 int8 head", 0.39), ("GLM-5.2 int8 head", 0.59), ("DeepSeek-V3's own MTP", 0.85))


# -------------------------------------------------------------------------------------------------
# 1. costs at full width, in one process


def cost_worker(model: str, ram: float, samples: int) -> dict:
    """Time k-row verify forwards (per layer and head), draft chains and absorbs on a slice; every
    expert the calls need is loaded by a warm-up call first, and the timed calls must read none."""
    import numpy as np
    from colibri import _core, tiers
    m = _core.model_init(model)
    c = m.cfg
    if not m.has_mtp:
        raise SystemExit(f"{model}: the slice has no MTP layer (make it with tools/make_glm5_slice.py --mtp)")
    prompt = prompt_ids(16, c.vocab)
    need = len(prompt) + MAX_ROWS + MAX_DRAFTS + 4
    tiers.configure(m, need, ram_gb=ram, autopin=False, learn=False, prefetch=False, mtp_tier=False)
    m.kv_alloc(need)
    m.step(prompt, 0)
    kv = len(prompt)
    distinct = prompt_ids(MAX_ROWS, c.vocab, seed=1)
    batches = {(k, kind): (distinct[:k] if kind == "distinct" else [distinct[0]] * k)
               for k in range(1, MAX_ROWS + 1) for kind in ("distinct", "same")}
    m.record_routing()

    def verify(rows) -> dict:
        """One k-row forward at kv, layer by layer: seconds per layer, the head's, unions."""
        k = len(rows)
        x = np.empty((k, c.hidden), np.float32)
        t0 = time.perf_counter()
        for i, tok in enumerate(rows):
            m.embed_row(tok, x[i])
        head = time.perf_counter() - t0
        per_layer, unions = [], []
        for L in m.layers:
            m.record_routing()
            t0 = time.perf_counter()
            m.layer_forward(L, x, k, kv)
            per_layer.append(time.perf_counter() - t0)
            unions.append(sum(len(e) for _, _, _, e in m.routing))
        t0 = time.perf_counter()
        m.logits_rows(x)
        head += time.perf_counter() - t0
        return {"layer_s": per_layer, "head_s": head, "union": unions, "x": x}

    def chain(d: int) -> float:
        m.step([distinct[0]], kv)                     # hlast for the chain (not timed)
        t0 = time.perf_counter()
        m.mtp_draft(distinct[1], kv + 1, d)
        return time.perf_counter() - t0

    def absorb(k: int, x) -> float:
        t0 = time.perf_counter()
        m.mtp_absorb((distinct * 2)[1:k + 1], x[:k], kv)
        return time.perf_counter() - t0

    hidden = {}
    for key, rows in batches.items():                 # warm-up: every expert these calls need
        hidden[key] = verify(rows)["x"]
    for d in range(1, MAX_DRAFTS + 1):
        chain(d)
    misses0 = m.expert_misses
    t_verify = {key: [] for key in batches}
    t_chain = {d: [] for d in range(1, MAX_DRAFTS + 1)}
    t_absorb = {k: [] for k in range(1, MAX_ROWS + 1)}
    for r in range(samples):
        keys = list(batches) if r % 2 == 0 else list(reversed(list(batches)))
        for key in keys:
            t_verify[key].append(verify(batches[key]))
        for d in (range(1, MAX_DRAFTS + 1) if r % 2 == 0 else range(MAX_DRAFTS, 0, -1)):
            t_chain[d].append(chain(d))
        for k in range(1, MAX_ROWS + 1):
            t_absorb[k].append(absorb(k, hidden[(k, "distinct")]))
    reads = m.expert_misses - misses0
    out = {"model": os.path.abspath(model), "samples": samples, "sparse": list(c.sparse),
           "topk": c.topk, "n_experts": c.n_experts, "hidden": c.hidden, "vocab": c.vocab,
           "cache_experts": m.cache_experts, "expert_reads_while_timed": reads, "verify": {},
           "chain_s": {str(d): statistics.median(v) for d, v in t_chain.items()},
           "absorb_s": {str(k): statistics.median(v) for k, v in t_absorb.items()}}
    for (k, kind), runs in t_verify.items():
        out["verify"][f"{k} {kind}"] = {
            "rows": k, "kind": kind,
            "layer_s": [statistics.median(r["layer_s"][i] for r in runs) for i in range(c.n_layers)],
            "head_s": statistics.median(r["head_s"] for r in runs),
            "union": runs[0]["union"]}
    m.close()
    return out


def run_cost_worker(model: str, ram: float, samples: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--cost-worker", model, "--ram", str(ram),
           "--samples", str(samples)]
    return worker_result(subprocess.run(cmd, capture_output=True, text=True))


def fit_costs(costs: dict) -> dict:
    """Per-kind costs by rows k: dense(k), head(k), the MoE layer's per-forward part f(k) and the
    per-routed-expert cost e (least squares of t - f_k over U, f_k one intercept per k)."""
    sparse = costs["sparse"]
    by_k: Dict[int, list] = {}
    for v in costs["verify"].values():
        by_k.setdefault(v["rows"], []).append(v)
    moe_idx = [i for i, s in enumerate(sparse) if s]
    dense_idx = [i for i, s in enumerate(sparse) if not s]
    # e: pooled slope of the MoE layers' time over their unions, within each k (two batches per k)
    num = den = 0.0
    for runs in by_k.values():
        pts = [(r["layer_s"][i], r["union"][i]) for r in runs for i in moe_idx]
        tm = statistics.mean(t for t, _ in pts)
        um = statistics.mean(u for _, u in pts)
        num += sum((t - tm) * (u - um) for t, u in pts)
        den += sum((u - um) ** 2 for _, u in pts)
    e = max(num / den, 0.0) if den > 0 else 0.0
    fit = {"expert_s": e, "rows": {}}
    for k, runs in sorted(by_k.items()):
        moe_f = statistics.mean(r["layer_s"][i] - e * r["union"][i] for r in runs for i in moe_idx)
        dense = statistics.mean(r["layer_s"][i] for r in runs for i in dense_idx) if dense_idx else 0.0
        fit["rows"][k] = {"dense_s": dense, "moe_fixed_s": max(moe_f, 0.0),
                          "head_s": statistics.mean(r["head_s"] for r in runs),
                          "union_distinct": statistics.mean(r["union"][i] for r in runs if r["kind"] == "distinct"
                                                            for i in moe_idx)}
    return fit


# -------------------------------------------------------------------------------------------------
# 2. reads, from plan on GLM-5.2's tensor table


def glm52_plan(ram_gb: float, work: str) -> dict:
    """``colibri plan --json`` of a header-only GLM-5.2 container (3 dense + 75 MoE layers + MTP)."""
    full = os.path.join(work, "glm52-headers")
    if not os.path.exists(os.path.join(full, "config.json")):
        r = subprocess.run([sys.executable, os.path.join(HERE, "make_glm5_slice.py"), full, "--dense-layers",
                            str(FULL_DENSE), "--moe-layers", str(FULL_MOE), "--mtp", "--headers-only"],
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"make_glm5_slice.py --headers-only failed: {r.stderr.strip()[-400:]}")
    r = subprocess.run([sys.executable, "-m", "colibri", "plan", full, "--ram", str(ram_gb), "--json"],
                       capture_output=True, text=True)
    if r.returncode not in (0, 1) or not r.stdout.strip():
        raise SystemExit(f"colibri plan --ram {ram_gb} failed: {r.stderr.strip()[-400:]}")
    p = json.loads(r.stdout)
    pt = p["per_token"]
    return {"ram_gb": ram_gb, "cache_experts": p["ram"]["capacity"], "streaming": p["ram"]["streaming"],
            "token_read_bytes": pt["disk_bytes_uniform"] if p["ram"]["streaming"] else 0,
            "draft_read_bytes": pt["mtp_draft_disk_bytes"] if p["ram"]["streaming"] else 0,
            "error": p["ram"].get("error")}


# -------------------------------------------------------------------------------------------------
# 3. expert unions


def union_formula(k: int, topk: int, overlap: float) -> float:
    """Experts of k consecutive tokens when each shares `overlap` of its top-k with the previous."""
    return topk * (1 + (k - 1) * (1 - overlap))


def trace_unions(path: str, max_k: int = MAX_ROWS) -> dict:
    """From a routing trace: the mean overlap with the previous token and the mean union of k
    consecutive decode calls (1-row calls of one layer in a row; a prefill call breaks the run)."""
    from simulate_cache import load_trace
    tr = load_trace(path)
    topk = tr.header["topk"]
    runs: Dict[int, List[tuple]] = {}
    last: Dict[int, list] = {}
    for call in tr.calls:
        if call.s != 1:
            last.pop(call.l, None)
            continue
        seq = last.setdefault(call.l, [])
        seq.append(frozenset(call.e))
        runs.setdefault(call.l, [])
        if len(seq) >= max_k:
            runs[call.l].append(tuple(seq[-max_k:]))
    windows = [w for ws in runs.values() for w in ws]
    if not windows:
        raise SystemExit(f"{path}: no {max_k} consecutive decode calls of one layer (record it with --draft 0)")
    overlap = statistics.mean(len(w[-1] & w[-2]) / topk for w in windows)
    unions = {k: statistics.mean(len(frozenset().union(*w[-k:])) for w in windows) for k in range(1, max_k + 1)}
    return {"path": os.path.abspath(path), "topk": topk, "n_experts": tr.n_experts, "windows": len(windows),
            "overlap": overlap, "union": unions,
            "union_formula": {k: union_formula(k, topk, overlap) for k in unions}}


# -------------------------------------------------------------------------------------------------
# 4. acceptance, and the projection


def parse_accept(text: str) -> tuple:
    name, sep, vals = text.partition("=")
    try:
        a = [float(v) for v in vals.split(",") if v.strip()]
    except ValueError:
        a = []
    if not sep or not name.strip() or not a or any(not 0 <= x <= 1 for x in a) or \
            any(y > x for x, y in zip(a, a[1:])):
        raise argparse.ArgumentTypeError(f"--accept {text!r}: expected NAME=A1,A2,... with 1 >= A1 >= A2 >= ... >= 0")
    return name.strip(), a


def bench_spec_curves(path: str) -> List[tuple]:
    with open(path) as f:
        res = json.load(f)
    out = []
    for key, rs in res.get("configs", {}).items():
        fixed = [r for r in rs if isinstance(r.get("depth"), int) and r.get("acceptance_by_position")]
        if fixed:
            deepest = max(fixed, key=lambda r: r["depth"])
            out.append((f"{key} (bench_spec)", deepest["acceptance_by_position"]))
    if not out:
        raise SystemExit(f"{path}: no acceptance_by_position in any configuration (a tools/bench_spec.py --json file?)")
    return out


def tokens_per_iteration(accept: Sequence[float], d: int) -> float:
    return 1.0 + sum(accept[:d]) if d <= len(accept) else float("nan")


def project(fit: dict, costs: dict, plan: dict, disk_gbs, accept: Sequence[float], unions: Dict[int, float],
            n_dense: int = FULL_DENSE, n_moe: int = FULL_MOE) -> List[dict]:
    """Seconds per token at depth 0..MAX_DRAFTS (see the module docstring); disk_gbs None = every
    expert in RAM (no reads)."""
    topk = costs["topk"]
    bps = disk_gbs * 1e9 if disk_gbs else None
    rows = []
    for d in range(0, MAX_DRAFTS + 1):
        k = d + 1
        E = tokens_per_iteration(accept, d)
        if E != E:
            break
        r = fit["rows"][k]
        u = unions[k]
        compute = r["head_s"] + n_dense * r["dense_s"] + n_moe * (r["moe_fixed_s"] + fit["expert_s"] * u)
        reads = plan["token_read_bytes"] * u / topk + d * plan["draft_read_bytes"] if bps else 0.0
        chain = costs["chain_s"][str(d)] if d else 0.0
        absorb = costs["absorb_s"][str(min(MAX_ROWS, max(1, round(E))))] if d else 0.0
        it = compute + chain + absorb + (reads / bps if bps else 0.0)
        rows.append({"depth": d, "tokens_per_iteration": E, "union": u, "compute_s": compute,
                     "chain_s": chain, "absorb_s": absorb, "read_bytes": reads, "iteration_s": it,
                     "s_per_token": it / E})
    return rows


# -------------------------------------------------------------------------------------------------
# report


def render(res: dict) -> str:
    fit, costs = res["fit"], res["costs"]
    L = ["## Speculation projected to GLM-5.2", ""]
    L.append(f"Slice costs: {costs['model']} ({costs['samples']} interleaved samples, "
             f"{res['machine']['cpu']}, {res['machine']['usable_cpus']} CPUs); expert reads while timed: "
             f"{costs['expert_reads_while_timed']}. Full model: {res['layers'][0]} dense + {res['layers'][1]} MoE layers.")
    L.append("")
    rows = []
    for k, r in sorted(fit["rows"].items(), key=lambda kv: int(kv[0])):
        rows.append([k, f"{1e3 * r['dense_s']:.1f}", f"{1e3 * r['moe_fixed_s']:.1f}", f"{r['union_distinct']:.1f}",
                     f"{1e3 * r['head_s']:.1f}",
                     f"{1e3 * costs['chain_s'][str(int(k) - 1)]:.1f}" if int(k) > 1 else "–",
                     f"{1e3 * costs['absorb_s'][str(k)]:.1f}"])
    L.append(f"Per forward of k rows at GLM-5's widths (ms; a routed expert applied to its rows: "
             f"{1e3 * fit['expert_s']:.2f} ms, fitted over the unions):")
    L.append("")
    L.append(markdown_table(["k rows", "dense layer", "MoE layer without routed experts", "union (slice)",
                             "embedding + head", "draft chain of k-1", "absorb of k"], rows))
    L.append("")
    u = res["unions"]
    L.append(f"Expert union of k consecutive tokens (GLM-5.2: {u['source']}): "
             + ", ".join(f"U({k}) = {v:.1f}" for k, v in sorted(u["glm52"].items(), key=lambda kv: int(kv[0]))))
    for t in u.get("traces", []):
        L.append(f"- trace {os.path.basename(t['path'])} ({t['n_experts']} experts, top-{t['topk']}, {t['windows']} windows): "
                 f"previous-token overlap {100 * t['overlap']:.1f}%; measured / formula: "
                 + ", ".join(f"U({k}) {t['union'][k]:.2f} / {t['union_formula'][k]:.2f}" for k in sorted(t["union"], key=int)))
    L.append("")
    for p in res["projections"]:
        cols = p["disks"]
        L.append(f"Seconds per token, RAM {p['ram_gb']:g} GB: reads {p['token_read_bytes'] / 1e9:.2f} GB per token "
                 f"(+ {p['draft_read_bytes'] / 1e6:.0f} MB per draft); best depth in bold")
        L.append("")
        rows = []
        for curve in p["curves"]:
            for disk, table in zip(cols, curve["by_disk"]):
                best = min(table, key=lambda r: r["s_per_token"])
                cells = [f"**{r['s_per_token']:.2f}**" if r is best else f"{r['s_per_token']:.2f}" for r in table]
                cells += ["–"] * (MAX_DRAFTS + 1 - len(cells))
                rows.append([curve["name"], disk_label(disk), " ".join(f"{100 * a:.0f}%" for a in curve["accept"])]
                            + cells + [f"{table[0]['s_per_token'] / best['s_per_token']:.2f}×"])
        L.append(markdown_table(["acceptance", "disk", "A_1..A_4"] + [f"depth {d}" for d in range(MAX_DRAFTS + 1)]
                                + ["best ÷ depth 0"], rows))
        L.append("")
    return "\n".join(L)


def disk_label(disk) -> str:
    return f"{disk:g} GB/s" if disk else "all in RAM"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Project MTP speculation to GLM-5.2: seconds per token by draft depth, per RAM budget and disk.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  python tools/make_glm5_slice.py /work/glm5-slice --mtp\n"
               "  python tools/project_spec.py --slice /work/glm5-slice --json /tmp/projection.json")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--slice", help="full-width slice with its MTP layer (tools/make_glm5_slice.py DIR --mtp)")
    src.add_argument("--costs", help="reuse the slice measurements of an earlier --json")
    src.add_argument("--cost-worker", help=argparse.SUPPRESS)
    ap.add_argument("--ram", type=float, default=12.0, help="RAM budget of the slice measurement in GB (default 12)")
    ap.add_argument("--samples", type=int, default=5, help="interleaved samples per cost (default 5)")
    ap.add_argument("--glm-ram", default="24,128", help="GLM-5.2 RAM budgets in GB (default 24,128)")
    ap.add_argument("--disk", default="1.5,6,ram",
                    help="disk read rates in GB/s; 'ram': every expert in RAM, no reads (default 1.5,6,ram)")
    ap.add_argument("--layers", default=f"{FULL_DENSE},{FULL_MOE}", help="dense,MoE layers of the full model")
    ap.add_argument("--trace", action="append", default=[], help="routing trace (run --trace FILE --draft 0); repeatable")
    ap.add_argument("--overlap", type=float, default=GLM52_PREV_OVERLAP,
                    help=f"GLM-5.2's previous-token expert overlap for U(k) (default {GLM52_PREV_OVERLAP}, published)")
    ap.add_argument("--accept", action="append", type=parse_accept, default=[], metavar="NAME=A1,A2,..",
                    help="an acceptance curve by draft position; repeatable")
    ap.add_argument("--bench-spec", help="tools/bench_spec.py --json output: its measured acceptance curves")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "colibri_project_spec"),
                    help="scratch folder (the header-only GLM-5.2 copy)")
    ap.add_argument("--json", help="write every number here")
    args = ap.parse_args(argv)
    if args.cost_worker:
        emit_worker_result(cost_worker(args.cost_worker, args.ram, args.samples))
        return 0
    if not 0 <= args.overlap < 1:
        ap.error("--overlap must be in [0, 1)")
    try:
        n_dense, n_moe = (int(v) for v in args.layers.split(","))
        rams = [float(v) for v in args.glm_ram.split(",")]
        disks = [None if v.strip() == "ram" else float(v) for v in args.disk.split(",")]
    except ValueError:
        ap.error("--layers, --glm-ram and --disk take comma-separated numbers")
    if any(d is not None and d <= 0 for d in disks) or any(r <= 0 for r in rams):
        ap.error("--glm-ram and --disk must be > 0")
    if args.slice:
        log(f"measuring costs on {args.slice} ...")
        costs = run_cost_worker(args.slice, args.ram, args.samples)
        if "error" in costs:
            log("cost worker: " + costs["error"])
            return 1
    else:
        with open(args.costs) as f:
            costs = json.load(f)["costs"]
    if costs["expert_reads_while_timed"]:
        log(f"warning: {costs['expert_reads_while_timed']} expert reads while timed (raise --ram)")
    fit = fit_costs(costs)
    curves = list(args.accept)
    if args.bench_spec:
        curves += bench_spec_curves(args.bench_spec)
    if not args.accept:
        curves += [(f"{who}, {100 * c:.0f}% per draft (published)", [c ** i for i in range(1, MAX_DRAFTS + 1)])
                   for who, c in PUBLISHED_ACCEPT]
    traces = [trace_unions(t) for t in args.trace]
    glm_u = {k: union_formula(k, 8, args.overlap) for k in range(1, MAX_ROWS + 1)}
    os.makedirs(args.work, exist_ok=True)
    res = {"machine": machine_info(), "costs": costs, "fit": fit, "layers": [n_dense, n_moe],
           "unions": {"source": f"8 (1 + (k-1)(1-p)), p = {args.overlap:.3f}", "glm52": glm_u, "traces": traces},
           "projections": []}
    for ram in rams:
        plan = glm52_plan(ram, args.work)
        if plan["error"]:
            log(f"RAM {ram:g} GB: {plan['error']}")
            continue
        entry = dict(plan, disks=disks, curves=[])
        for name, acc in curves:
            entry["curves"].append({"name": name, "accept": acc, "by_disk": [
                project(fit, costs, plan, d, acc, glm_u, n_dense, n_moe) for d in disks]})
        res["projections"].append(entry)
    print(render(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
