#!/usr/bin/env python3
"""Does speculation pay? MTP drafting at depths 0-4 and ``auto``, against plain decoding, in one run.

Models: the embedded model (colibri/models/default) and its disk-bound twin (tools/make_fat_twin.py,
every expert zero-padded to ``--twin-width``: the same tokens, many times the expert bytes, like
GLM-5's experts from an SSD). Configurations: a quarter and a half of each layer's experts cached,
with the rest read through the page cache or with O_DIRECT, and every expert cached (RAM); greedy
and sampled (T 0.7, top-p 0.9, a fixed seed per prompt). Each (configuration, mode, depth) is a
fresh process (the public API: ``colibri.load`` + ``LLM.complete``) that decodes ``--tokens``
tokens for each of four code prompts after a short warm-up; the processes run interleaved, the
order reversed every other round, ``--runs`` rounds; figures are medians over the rounds.

Per (configuration, mode, depth): decode tok/s and its ratio to depth 0, tokens per verify
forward, the acceptance of the i-th draft among the iterations that verified one, expert bytes
read per emitted token, where an iteration's time goes (draft chain, verify forward, MTP absorb,
the Python between them, in µs per iteration), and whether the tokens equal depth 0's (greedy:
they must; sampled: the same seed must give the same text). ``--costs`` adds the engine's
iteration costs measured in one process (embedded model, all experts cached): a k-row verify
forward and a k-token draft chain against a 1-row decode step, medians of interleaved samples.

    python tools/bench_spec.py [--work /tmp/colibri_spec] [--runs 5] [--tokens 96] [--json F]
                               [--models embedded,twin] [--fractions 0.25,0.5,1] [--io page,direct]
                               [--modes greedy,sampled] [--depths 0,1,2,3,4,auto] [--costs]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from bench import emit_worker_result, log, markdown_table, median, wait_quiet, worker_result  # noqa: E402

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "def read_lines(path):\n    with open(path) as f:\n",
]
SAMPLED = {"temperature": 0.7, "top_p": 0.9}
TARGETS = {   # issue 13's lines: (model, fraction, io, mode) -> minimum auto ÷ depth 0
    ("twin", 0.25, "direct", "greedy"): 1.5, ("twin", 0.25, "direct", "sampled"): 1.25,
    ("embedded", 1.0, "ram", "greedy"): 1.25,
}


# -------------------------------------------------------------------------------------------------
# workers (fresh processes)

def run_worker(spec: dict) -> dict:
    """One measured process: load, warm up, decode every prompt; the summed counters."""
    import colibri
    # no pins from a routing history: the configuration is exactly the cached fraction it names
    o = colibri.Options(cache_experts=spec["cache_experts"], direct=spec["io"] == "direct",
                        draft=spec["draft"], max_tokens=spec["tokens"], autopin=False)
    t = time.perf_counter()
    llm = colibri.load(spec["path"], o)
    load_s = time.perf_counter() - t
    kw = dict(SAMPLED) if spec["mode"] == "sampled" else {"temperature": 0.0}
    llm.complete(PROMPTS[-1], max_tokens=16, seed=99, **kw)          # warm-up: caches, page cache
    tot = {"tokens": 0, "decode_s": 0.0, "decode_forwards": 0, "bytes_read": 0, "iterations": 0,
           "time_draft_s": 0.0, "time_verify_s": 0.0, "time_absorb_s": 0.0, "time_spec_python_s": 0.0,
           "verified": [], "accepted": [], "ids": [], "hit_rate": []}
    for i, p in enumerate(PROMPTS):
        c = llm.complete(p, seed=1000 + i, **kw)
        s = c.stats
        tot["ids"].append(c.token_ids)
        tot["tokens"] += c.completion_tokens
        tot["decode_s"] += s["decode_s"]
        tot["hit_rate"].append(s["hit_rate"])
        for k in ("decode_forwards", "bytes_read", "time_draft_s", "time_verify_s", "time_absorb_s",
                  "time_spec_python_s"):
            tot[k] += s[k]
        tot["iterations"] += s["draft_iterations"]
        for j, (v, a) in enumerate(zip(s["drafts_verified_by_position"], s["acceptance_by_position"])):
            if j >= len(tot["verified"]):
                tot["verified"].append(0)
                tot["accepted"].append(0)
            tot["verified"][j] += v
            tot["accepted"][j] += round(a * v)
    tot["load_s"] = load_s
    llm.close()
    return tot


def run_costs(path: str, samples: int) -> dict:
    """In one process, all experts cached: a k-row verify forward (k = 1..5) and a k-token draft
    chain (k = 1..4), sampled interleaved; medians in seconds."""
    import numpy as np
    from colibri import _core
    m = _core.model_init(path, cache_experts=0)
    ids = [int(t) for t in np.random.default_rng(0).integers(10, m.cfg.vocab, 64)]
    m.kv_alloc(256)
    logits = m.step(ids, 0)
    kv, tok = len(ids), int(np.argmax(logits))
    more = [int(t) for t in np.random.default_rng(1).integers(10, m.cfg.vocab, 5)]
    for _ in range(3):                   # the MTP layer's experts read once, the pages warm
        m.mtp_draft(tok, kv + 1, 4)
    t = {}

    def timed(key, fn, halves=False):
        a0, m0 = m.t_attn, m.t_moe      # the engine's own timers of the layers' two halves
        s = time.perf_counter()
        fn()
        t.setdefault(key, []).append(time.perf_counter() - s)
        if halves:
            t.setdefault(key + "_attn", []).append(m.t_attn - a0)
            t.setdefault(key + "_moe", []).append(m.t_moe - m0)

    for _ in range(samples):
        for k in range(1, 6):
            timed(f"verify{k}", lambda: m.step_all([tok] + more[:k - 1], kv), halves=True)
        m.step([tok], kv)
        for k in range(1, 5):
            timed(f"chain{k}", lambda: m.mtp_draft(tok, kv + 1, k))
    return {k: statistics.median(v) for k, v in t.items()}


# -------------------------------------------------------------------------------------------------
# the run

def make_twin(work: str, width: int) -> str:
    from colibri.models import default_model_dir
    dst = os.path.join(work, f"twin{width}")
    if not os.path.exists(os.path.join(dst, "config.json")):
        r = subprocess.run([sys.executable, os.path.join(HERE, "make_fat_twin.py"), str(default_model_dir()), dst,
                            "--width", str(width)], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"make_fat_twin failed: {r.stderr.strip().splitlines()[-1:]}")
    return dst


def configurations(args, paths: Dict[str, str], n_experts: int) -> List[dict]:
    out = []
    for model in args.models:
        for f in args.fractions:
            for io in (["ram"] if f >= 1 else args.io):
                for mode in args.modes:
                    out.append({"model": model, "path": paths[model], "fraction": f, "io": io, "mode": mode,
                                "cache_experts": n_experts if f >= 1 else max(1, round(f * n_experts))})
    return out


def measure(spec: dict) -> dict:
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                       capture_output=True, text=True, timeout=1800)
    return worker_result(r)


def key_of(c: dict) -> str:
    return f"{c['model']} {c['fraction']:g} {c['io']} {c['mode']}"


def summarize(c: dict, depth, samples: List[dict], base_ids) -> dict:
    ok = [s for s in samples if "error" not in s]
    if not ok:
        return {"depth": depth, "error": samples[0].get("error") if samples else "no run"}
    tok_s = [s["tokens"] / s["decode_s"] for s in ok]
    s0 = ok[0]
    ver, acc = s0["verified"], s0["accepted"]
    it = max(s0["iterations"], 1)
    return {"depth": depth, "tok_s": median(tok_s), "runs": len(ok),
            "tok_per_fwd": median([s["tokens"] / max(s["decode_forwards"], 1) for s in ok]),
            "acceptance_by_position": [a / v for a, v in zip(acc, ver) if v],
            "bytes_per_token": median([s["bytes_read"] / max(s["tokens"], 1) for s in ok]),
            "iteration_us": {k: 1e6 * s0[f"time_{k}_s"] / it for k in ("draft", "verify", "absorb", "spec_python")},
            "hit_rate": median([statistics.mean(s["hit_rate"]) for s in ok]),
            "same_tokens": base_ids is None or all(s["ids"] == base_ids for s in ok)}


def summary_table(res: dict) -> str:
    """One row per configuration: depth 0's tok/s, every depth's ratio to it, the acceptance by
    position at the deepest depth, and auto's tokens per forward."""
    rows = []
    for key, rs in res["configs"].items():
        by = {r["depth"]: r for r in rs if "tok_s" in r}
        if 0 not in by:
            continue
        fixed = sorted(d for d in by if d != "auto")
        deepest = by[fixed[-1]]
        rows.append([key, f"{by[0]['tok_s']:.0f}"]
                    + [f"{by[d]['tok_s'] / by[0]['tok_s']:.2f}×" if d in by else "–" for d in fixed[1:] + ["auto"]]
                    + [" ".join(f"{100 * a:.0f}%" for a in deepest["acceptance_by_position"]) or "–",
                       f"{by['auto']['tok_per_fwd']:.2f}" if "auto" in by else "–"])
    if not rows:
        return ""
    depths = sorted(d for d in {r["depth"] for rs in res["configs"].values() for r in rs} if d != "auto")
    return markdown_table(["configuration (model, cached, reads, sampling)", "depth 0 tok/s"]
                          + [f"depth {d}" for d in depths[1:]] + ["auto", "acceptance by position (deepest)",
                                                                  "auto tok/fwd"], rows)


def render(res: dict) -> str:
    lines = ["## Speculation: tok/s by draft depth (medians of fresh processes, interleaved)", ""]
    m = res["machine"]
    lines.append(f"Machine: {m['cpu']}, {m['threads']} threads; {res['runs']} rounds; {res['tokens']} tokens × "
                 f"{len(PROMPTS)} prompts per process; twin: experts padded to {res['twin_width']}.")
    lines.append("")
    lines.append(summary_table(res))
    lines.append("")
    for key, rows in res["configs"].items():
        base = next((r for r in rows if r["depth"] == 0 and "tok_s" in r), None)
        table = []
        for r in rows:
            if "error" in r:
                table.append([r["depth"], r["error"]] + [""] * 7)
                continue
            x = r["tok_s"] / base["tok_s"] if base else None
            it = r["iteration_us"]
            table.append([r["depth"], f"{r['tok_s']:.1f}", "–" if x is None else f"{x:.2f}×",
                          f"{r['tok_per_fwd']:.2f}",
                          " ".join(f"{100 * a:.0f}%" for a in r["acceptance_by_position"]) or "–",
                          f"{r['bytes_per_token'] / 1e6:.2f} MB",
                          f"{it['draft']:.0f} / {it['verify']:.0f} / {it['absorb']:.0f} / {it['spec_python']:.0f}",
                          f"{100 * r['hit_rate']:.0f}%", "yes" if r["same_tokens"] else "**no**"])
        lines.append(f"**{key}**")
        lines.append("")
        lines.append(markdown_table(["depth", "tok/s", "× depth 0", "tok/fwd", "acceptance by position",
                                     "read / token", "µs per iteration: draft / verify / absorb / Python",
                                     "expert hits", "tokens = depth 0"], table))
        lines.append("")
    if res.get("verdict"):
        lines.append("### Verdict")
        lines.append("")
        lines.append(markdown_table(["configuration", "auto ÷ depth 0", "auto ÷ best fixed (depth)", "target",
                                     "holds"], res["verdict"]))
        lines.append("")
    if res.get("costs"):
        c = res["costs"]
        b = c["verify1"]
        lines.append("### Iteration costs in one process (embedded model, all experts cached)")
        lines.append("")
        rows = [[f"verify forward, {k} row{'s' if k > 1 else ''}", f"{1e6 * c[f'verify{k}']:.0f}", f"{c[f'verify{k}'] / b:.2f}×",
                 *split_of(c, k)] for k in range(1, 6)]
        rows += [[f"draft chain, {k} token{'s' if k > 1 else ''}", f"{1e6 * c[f'chain{k}']:.0f}", f"{c[f'chain{k}'] / b:.2f}×",
                  "", "", ""] for k in range(1, 5)]
        lines.append(markdown_table(["", "µs", "× 1-row step", "attention half µs (× 1 row)",
                                     "MoE half µs (× 1 row)", "head and rest µs"], rows))
        lines.append("")
    return "\n".join(lines)


def split_of(c: dict, k: int) -> List[str]:
    """The cells of the k-row verify forward's split by the engine's timers: its attention and MoE
    halves (µs, and their ratio to the 1-row forward's) and the rest (head, embedding, Python);
    blank for a saved run from before the split was recorded."""
    if f"verify{k}_attn" not in c:
        return ["", "", ""]
    att, moe = c[f"verify{k}_attn"], c[f"verify{k}_moe"]
    return [f"{1e6 * att:.0f} ({att / c['verify1_attn']:.2f}×)", f"{1e6 * moe:.0f} ({moe / c['verify1_moe']:.2f}×)",
            f"{1e6 * (c[f'verify{k}'] - att - moe):.0f}"]


def verdict(res: dict) -> List[list]:
    out = []
    for key, rows in res["configs"].items():
        by = {r["depth"]: r for r in rows if "tok_s" in r}
        if 0 not in by or "auto" not in by:
            continue
        fixed = {d: r for d, r in by.items() if d != "auto"}
        best = max(fixed, key=lambda d: fixed[d]["tok_s"])
        a0 = by["auto"]["tok_s"] / by[0]["tok_s"]
        ab = by["auto"]["tok_s"] / fixed[best]["tok_s"]
        model, frac, io, mode = key.split()
        target = TARGETS.get((model, float(frac), io, mode), 1.0)
        out.append([key, f"{a0:.2f}×", f"{ab:.2f}× ({best})", f"≥ {target:.2f}× and ≥ 0.97×",
                    "yes" if a0 >= target and ab >= 0.97 else "**no**"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/colibri_spec", help="folder for the twin (default %(default)s)")
    ap.add_argument("--runs", type=int, default=5, help="rounds of fresh processes (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=96, help="tokens per prompt (default %(default)s)")
    ap.add_argument("--twin-width", type=int, default=4096, help="the twin's expert width (default %(default)s)")
    ap.add_argument("--models", default="embedded,twin")
    ap.add_argument("--fractions", default="0.25,0.5,1", help="experts cached per layer, as fractions")
    ap.add_argument("--io", default="page,direct", help="reads of uncached experts: page, direct")
    ap.add_argument("--modes", default="greedy,sampled")
    ap.add_argument("--depths", default="0,1,2,3,4,auto")
    ap.add_argument("--costs", action="store_true", help="add the in-process iteration costs")
    ap.add_argument("--cost-samples", type=int, default=300)
    ap.add_argument("--quiet-wait", type=float, default=30.0,
                    help="seconds to wait for a quiet machine before each round (default %(default)s)")
    ap.add_argument("--json", help="write the results as JSON here")
    ap.add_argument("--report", metavar="JSON", help="print the report of a saved run (--json) and exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--costs-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        emit_worker_result(run_worker(json.loads(args.worker)))
        return 0
    if args.costs_worker:
        emit_worker_result(run_costs(args.costs_worker, args.cost_samples))
        return 0
    if args.report:
        with open(args.report) as f:
            print(render(json.load(f)))
        return 0
    from colibri import _core
    from colibri.config import load_config
    from colibri.draft import parse_draft
    from colibri.models import default_model_dir
    args.models = [x for x in args.models.split(",") if x]
    args.fractions = [float(x) for x in args.fractions.split(",") if x]
    args.io = [x for x in args.io.split(",") if x]
    args.modes = [x for x in args.modes.split(",") if x]
    depths = [parse_draft(x) for x in args.depths.split(",") if x]
    for bad in set(args.models) - {"embedded", "twin"}:
        ap.error(f"--models: unknown model {bad!r} (embedded, twin)")
    for bad in set(args.io) - {"page", "direct"}:
        ap.error(f"--io: unknown mode {bad!r} (page, direct)")
    for bad in set(args.modes) - {"greedy", "sampled"}:
        ap.error(f"--modes: unknown mode {bad!r} (greedy, sampled)")
    os.makedirs(args.work, exist_ok=True)
    paths = {"embedded": str(default_model_dir())}
    if "twin" in args.models:
        paths["twin"] = make_twin(args.work, args.twin_width)
    cfg = load_config(paths["embedded"])
    configs = configurations(args, paths, cfg.n_experts)
    jobs = [(c, d) for c in configs for d in depths]
    log(f"{len(jobs)} (configuration, depth) pairs × {args.runs} rounds")
    samples: Dict[int, List[dict]] = {i: [] for i in range(len(jobs))}
    for r in range(args.runs):
        wait_quiet(args.quiet_wait)
        order = list(range(len(jobs)))
        if r % 2:
            order.reverse()
        t = time.perf_counter()
        for i in order:
            c, d = jobs[i]
            samples[i].append(measure(dict(c, draft=d, tokens=args.tokens)))
        log(f"round {r + 1}/{args.runs} in {time.perf_counter() - t:.0f} s")
    res = {"machine": {"cpu": _cpu_name(), "threads": _core.max_threads()}, "runs": args.runs,
           "tokens": args.tokens, "twin_width": args.twin_width, "configs": {}}
    for c in configs:
        idx = [i for i, (cc, _) in enumerate(jobs) if cc is c]
        base = next((samples[i] for i in idx if jobs[i][1] == 0), None)
        base_ids = next((s["ids"] for s in base or [] if "error" not in s), None)
        res["configs"][key_of(c)] = [summarize(c, jobs[i][1], samples[i], base_ids) for i in idx]
    res["verdict"] = verdict(res)
    if args.costs:
        res["costs"] = worker_result(subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--costs-worker", paths["embedded"],
             "--cost-samples", str(args.cost_samples)], capture_output=True, text=True))
        if "error" in res["costs"]:
            log("costs: " + res["costs"]["error"])
            res.pop("costs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(render(res))
    return 0


def _cpu_name() -> str:
    try:
        for ln in open("/proc/cpuinfo"):
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
