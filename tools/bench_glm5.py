#!/usr/bin/env python3
"""Benchmark a full-width GLM-5 slice (tools/make_glm5_slice.py) and project to the full model.

Everything is measured in one invocation, each colibri figure in a fresh ``python -m colibri run``
process with ``--stats-json``:

1. ``plan`` of the slice for the RAM budget (``--ram``): resident bytes, KV, projected peak.
2. fio's best random read rate on the largest expert shard (O_DIRECT, libaio; 1 MiB and 16 MiB
   blocks at several queue depths), before and after the colibri runs.
3. decode of ``--tokens`` tokens with experts streaming under the budget: from a cold disk
   (``--direct``, O_DIRECT), from a cold page cache (every shard's pages dropped with
   posix_fadvise DONTNEED first) and warm (the same run again, the page cache filled by it);
   load time and resident bytes against the plan, read GB/s against fio, peak RSS against the budget.
4. prefill of a ``--prefill``-token prompt (default 2048) with experts streaming under the budget,
   its routing traced (``--trace``): time to first token, the prompt's pieces (``--batch``), the
   expert bytes it read against the bound of reading every routed expert it needs once per piece
   and layer; and in one process each layer's prefill time (Model.prefill's per-layer progress),
   projected to the full model's time to first token (3 dense + 75 MoE layers).
5. a context of ``--ctx`` tokens (past index_topk, so the DSA selection runs): decode tok/s there
   and the KV bytes.
6. per-layer costs in one process (attention + MLP of the dense layer, the MoE layers, the head),
   and from them the seconds per token of the full model (3 dense + 75 MoE layers by default),
   at the slice's hit rate and with every expert read from disk at fio's rate.

Usage::

    python tools/make_glm5_slice.py /work/glm5-slice            # ~15 GB of int4 experts
    python tools/bench_glm5.py --model /work/glm5-slice --ram 8 --json /tmp/glm5.json

The report (markdown) goes to stdout; ``--json`` keeps every number.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import _run, emit_worker_result, fmt_bytes, last_error_line, log, machine_info, worker_result  # noqa: E402

#: GLM-5.x layer counts (spec: 78 layers, first_k_dense_replace 3).
FULL_DENSE, FULL_MOE = 3, 75


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list:
    """A fixed pseudo-random prompt of n ids (the slice's weights are random: any ids do)."""
    return [(i * 7919 + 13 + seed * 104729) % vocab for i in range(n)]


def shards(model: str) -> list:
    return sorted(os.path.join(model, n) for n in os.listdir(model) if n.endswith(".safetensors"))


def drop_page_cache(model: str) -> None:
    """Ask the kernel to drop the cached pages of every shard (clean pages go; no root needed)."""
    for p in shards(model):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fio_best(path: str, seconds: int = 5) -> dict:
    """fio random reads of the file with O_DIRECT: GB/s for each (block, queue depth), and the best."""
    out = {"file": path, "gbs": {}}
    for bs, qd in (("1M", 4), ("1M", 16), ("16M", 2), ("16M", 4)):
        r = _run(["fio", "--name=read", f"--filename={path}", "--readonly", "--rw=randread", f"--bs={bs}",
                  "--direct=1", "--ioengine=libaio", f"--iodepth={qd}", f"--runtime={seconds}", "--time_based",
                  "--output-format=json"], what=f"fio bs {bs} qd {qd}")
        try:
            out["gbs"][f"{bs} qd{qd}"] = json.loads(r.stdout)["jobs"][0]["read"]["bw_bytes"] / 1e9
        except (ValueError, KeyError, IndexError):
            out.setdefault("errors", []).append(last_error_line(r.stderr + r.stdout))
    out["best_gbs"] = max(out["gbs"].values()) if out["gbs"] else None
    return out


def colibri_run(model: str, ids: list, tokens: int, ram: float, threads: int, work: str, tag: str,
                extra=()) -> dict:
    stats = os.path.join(work, f"glm5_{tag}.json")
    if os.path.exists(stats):
        os.remove(stats)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    r = _run([sys.executable, "-m", "colibri", "run", "--model", model, "--prompt-ids", ",".join(map(str, ids)),
              "--max-tokens", str(tokens), "--temperature", "0", "--draft", "0", "--ram", str(ram),
              "--threads", str(threads), "--no-autopin", "--stats-json", stats, "--quiet", *extra],
             env=env, what=f"colibri {tag}")
    if r.returncode != 0 or not os.path.exists(stats):
        return {"error": last_error_line(r.stderr + r.stdout)}
    with open(stats) as f:
        s = json.load(f)
    dec = max(s["forwards"] - 1, 0)
    s["decode_forward_tok_s"] = dec / s["decode_s"] if s["decode_s"] > 0 else None
    s["prefill_tok_s"] = s["prefill_tokens"] / s["prefill_s"] if s["prefill_s"] > 0 else None
    s.pop("tokens", None)
    return s


def prefill_reads(trace: str, stats: dict) -> dict:
    """The prefill's expert reads against reading each routed expert it needs once per piece:
    the bound sums, over the prompt's forwards (pieces of prefill_batch rows) and their MoE
    calls, the distinct experts times their bytes (from the --trace file)."""
    pieces = -(-stats["prefill_tokens"] // max(stats["prefill_batch"], 1))
    with open(trace) as f:
        header = json.loads(f.readline())
        calls = [json.loads(line) for line in f if line.strip()]
    first = min((c["f"] for c in calls), default=0)
    bound = sum(len(c["e"]) * header["expert_bytes"][str(c["l"])] for c in calls if c["f"] < first + pieces)
    return {"pieces": pieces, "read_bytes": stats["prefill_bytes_read"], "once_per_piece_bytes": bound,
            "at_most_once": stats["prefill_bytes_read"] <= bound}


def prefill_layer_worker(model: str, ram: float, n: int) -> None:
    """Prefill an n-token prompt once, timing every layer of every piece (Model.prefill's progress
    comes after each layer) and the head."""
    from colibri import _core, tiers
    m = _core.model_init(model)
    c = m.cfg
    ids = prompt_ids(n, c.vocab, 1)
    t = tiers.configure(m, n + 8, ram_gb=ram, autopin=False, learn=False)
    m.kv_alloc(n + 8)
    stamps = []
    t0 = time.perf_counter()
    m.prefill(ids, 0, batch=t.batch, progress=lambda done, total: stamps.append(time.perf_counter()))
    t_end = time.perf_counter()
    layer_s = [0.0] * c.n_layers
    prev = t0
    for k, ts in enumerate(stamps):          # piece p's layer j is stamp p * n_layers + j
        layer_s[k % c.n_layers] += ts - prev
        prev = ts
    emit_worker_result({"tokens": n, "batch": t.batch, "layer_s": layer_s, "head_s": t_end - prev,
                        "total_s": t_end - t0, "sparse": list(c.sparse), "bytes_read": m.bytes_read})
    m.close()


def project_ttft(pl: dict, n_dense: int = FULL_DENSE, n_moe: int = FULL_MOE) -> dict:
    """Time to first token of the full model's prefill from the slice's per-layer prefill times."""
    t_dense, t_moe = layer_means(pl["layer_s"], pl["sparse"])
    return {"dense_layer_s": t_dense, "moe_layer_s": t_moe, "head_s": pl["head_s"],
            "ttft_s": n_dense * t_dense + n_moe * t_moe + pl["head_s"]}


def plan_json(model: str, ram: float, ctx: int) -> dict:
    r = _run([sys.executable, "-m", "colibri", "plan", model, "--ram", str(ram), "--ctx", str(ctx), "--json"],
             what="plan")
    if r.returncode not in (0, 1):
        return {"error": last_error_line(r.stderr + r.stdout)}
    return json.loads(r.stdout)


# ---------------------------------------------------------------------------------------------
# per-layer costs, in one process


def layer_worker(model: str, ram: float, tokens: int, direct: bool) -> None:
    """Decode `tokens` tokens one at a time, timing the embedding, every layer and the head."""
    import numpy as np
    from colibri import _core, tiers
    m = _core.model_init(model, direct=direct)
    c = m.cfg
    ids = prompt_ids(8, c.vocab)
    need = len(ids) + tokens + 2
    tiers.configure(m, need, ram_gb=ram, autopin=False, learn=False)
    m.kv_alloc(need)
    m.step(ids, 0)                                   # the prompt (not timed)
    m.reset_stats()
    t_layer = [0.0] * c.n_layers
    t_head = 0.0
    tok = int(np.argmax(m.step([ids[-1]], len(ids))))
    pos = len(ids) + 1
    for _ in range(tokens):
        t0 = time.perf_counter()
        x = np.empty((1, c.hidden), np.float32)
        m.embed_row(tok, x[0])
        t_head += time.perf_counter() - t0
        for L in m.layers:
            t0 = time.perf_counter()
            m.layer_forward(L, x, 1, pos)
            t_layer[L.index] += time.perf_counter() - t0
        t0 = time.perf_counter()
        tok = int(np.argmax(m.logits_rows(x)[0]))
        t_head += time.perf_counter() - t0
        pos += 1
    m.cache.wait_prefetch()
    looks = m.expert_hits + m.expert_misses
    emit_worker_result({
        "tokens": tokens, "head_s": t_head / tokens, "layer_s": [t / tokens for t in t_layer],
        "sparse": list(c.sparse), "hit_rate": m.expert_hits / looks if looks else None,
        "bytes_read_per_token": m.bytes_read / tokens, "cache_experts": m.cache_experts,
        "expert_bytes": tiers.expert_disk_bytes(m, next(i for i in range(c.n_layers) if c.sparse[i])),
        "topk": c.topk, "n_experts": c.n_experts, "time_disk_wait_s": m.t_disk / tokens})
    m.close()


def run_layer_worker(model, ram, tokens, threads, direct) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--ram", str(ram),
           "--tokens", str(tokens)] + (["--direct"] if direct else [])
    return worker_result(_run(cmd, env=env, what=f"per-layer costs ({'O_DIRECT' if direct else 'page cache'})"))


def layer_means(layer_s: list, sparse: list) -> tuple:
    """(mean seconds of the dense layers (0 without one), of the MoE layers)."""
    dense = [t for t, sp in zip(layer_s, sparse) if not sp]
    return (statistics.mean(dense) if dense else 0.0), statistics.mean(t for t, sp in zip(layer_s, sparse) if sp)


def project(layers: dict, fio_gbs, n_dense: int = FULL_DENSE, n_moe: int = FULL_MOE) -> dict:
    """Seconds per token of a model with n_dense + n_moe layers from the slice's per-layer costs:
    as measured (the slice's hit rate), and with every routed expert read from disk at fio's best
    rate (a cold token: topk experts per MoE layer) on top of the measured compute."""
    t_dense, t_moe = layer_means(layers["layer_s"], layers["sparse"])
    per_moe_disk = layers["time_disk_wait_s"] / max(sum(layers["sparse"]), 1)
    measured = layers["head_s"] + n_dense * t_dense + n_moe * t_moe
    out = {"dense_layer_s": t_dense, "moe_layer_s": t_moe, "head_s": layers["head_s"],
           "s_per_token_at_slice_hit_rate": measured}
    if fio_gbs:
        cold_bytes = n_moe * layers["topk"] * layers["expert_bytes"]
        compute = layers["head_s"] + n_dense * t_dense + n_moe * max(t_moe - per_moe_disk, 0.0)
        out.update(cold_bytes_per_token=cold_bytes, s_per_token_cold=compute + cold_bytes / (fio_gbs * 1e9))
    return out


# ---------------------------------------------------------------------------------------------
# report


def fmt(x, nd=2):
    return "–" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def render(res: dict) -> str:
    L = [f"# GLM-5 slice benchmark ({res['model']})", "",
         f"{res['machine'].get('cpu', '?')}, {res['threads']} threads, RAM budget {res['ram']} GB; "
         f"slice: {res['layers']} layers, {res['disk_bytes'] / 1e9:.1f} GB on disk", ""]
    p = res["plan"]
    if "error" not in p:
        L.append(f"plan: resident {fmt_bytes(p['resident']['engine_bytes'])}, KV at {p['ctx']} tokens "
                 f"{fmt_bytes(p['kv_bytes'])}, projected peak {fmt_bytes(p['ram']['projected_peak_bytes'])}, "
                 f"LRU {p['ram']['capacity']} experts/layer")
    fio = res["fio_before"].get("best_gbs"), res["fio_after"].get("best_gbs")
    best = max([f for f in fio if f] or [0]) or None
    L.append(f"fio best random read (O_DIRECT): {fmt(fio[0])} GB/s before, {fmt(fio[1])} GB/s after the runs")
    L += ["", "| run | load s | resident vs plan | prefill tok/s | decode tok/s | hit rate | read GB/s | "
              "÷ fio best | peak RSS | ≤ budget |", "|---|---|---|---|---|---|---|---|---|---|"]
    for tag, s in res["runs"].items():
        if "error" in s:
            L.append(f"| {tag} | error: {s['error']} |||||||||")
            continue
        ratio = s["resident_bytes"] / p["resident"]["engine_bytes"] if "error" not in p else None
        L.append(f"| {tag} | {fmt(s['load_s'])} | {fmt(ratio, 4)} | {fmt(s['prefill_tok_s'], 1)} | "
                 f"{fmt(s['decode_forward_tok_s'])} | {fmt(100 * s['hit_rate'], 1)}% | {fmt(s['read_gb_s'])} | "
                 f"{fmt(s['read_gb_s'] / best if best and s['read_gb_s'] else None)} | "
                 f"{s['peak_rss_bytes'] / 2**30:.2f} GiB | {s['peak_rss_bytes'] <= s['ram_budget_bytes']} |")
    pf = res.get("prefill")
    if pf:
        r, ttft = pf.get("reads") or {}, pf.get("projection") or {}
        s = res["runs"].get(f"prefill {pf['tokens']}") or {}
        if "error" in s or "error" in r:
            L.append(f"\nprefill {pf['tokens']}: error {s.get('error') or r.get('error')}")
        else:
            L.append(f"\nprefill {pf['tokens']} tokens in {r['pieces']} piece(s) of <= {s['prefill_batch']} "
                     f"(experts streaming under --ram {res['ram']}): time to first token {s['ttft_s']:.2f} s "
                     f"({fmt(s['prefill_tok_s'], 1)} tok/s); experts read {r['read_bytes'] / 1e9:.2f} GB, "
                     f"each needed expert once per piece and layer: {r['once_per_piece_bytes'] / 1e9:.2f} GB "
                     f"-> at most once per piece: {'yes' if r['at_most_once'] else 'NO'}")
        if ttft and "error" not in ttft:
            L.append(f"projection of the time to first token to {FULL_DENSE} dense + {FULL_MOE} MoE layers: dense "
                     f"layer {ttft['dense_layer_s']:.2f} s, MoE layer {ttft['moe_layer_s']:.2f} s, head "
                     f"{ttft['head_s']:.2f} s -> {ttft['ttft_s']:.0f} s for {pf['tokens']} tokens "
                     f"({pf['tokens'] / ttft['ttft_s']:.1f} tok/s)")
        elif ttft:
            L.append(f"projection of the time to first token: error {ttft['error']}")
    lng = res["runs"].get("context")
    if lng and "error" not in lng:
        L.append(f"\ncontext {lng['prefill_tokens']} tokens: prefill {lng['prefill_s']:.1f} s, decode "
                 f"{fmt(lng['decode_forward_tok_s'])} tok/s, KV {fmt_bytes(lng['kv_bytes'])}")
    for key, pr in res["projection"].items():
        if "error" in pr:
            L.append(f"\nprojection ({key}): error {pr['error']}")
            continue
        L.append(f"\nprojection to {FULL_DENSE} dense + {FULL_MOE} MoE layers ({key}): dense layer "
                 f"{1e3 * pr['dense_layer_s']:.1f} ms, MoE layer {1e3 * pr['moe_layer_s']:.1f} ms, head "
                 f"{1e3 * pr['head_s']:.1f} ms -> {pr['s_per_token_at_slice_hit_rate']:.2f} s/token at the "
                 f"slice's hit rate" + (f"; cold (every expert from disk, {pr['cold_bytes_per_token'] / 1e9:.1f} "
                                        f"GB/token at fio's best): {pr['s_per_token_cold']:.1f} s/token"
                                        if "s_per_token_cold" in pr else ""))
    return "\n".join(L)


def run_prefill(a, vocab: int, res: dict) -> None:
    """Step 4: the traced prefill run, its reads, and the per-layer projection of its TTFT."""
    trace = os.path.join(a.work, "glm5_prefill_trace.jsonl")
    s = colibri_run(a.model, prompt_ids(a.prefill, vocab, 1), 4, a.ram, a.threads, a.work, "prefill",
                    ["--trace", trace])
    res["runs"][f"prefill {a.prefill}"] = s
    res["prefill"] = pf = {"tokens": a.prefill}
    pf["reads"] = s if "error" in s else prefill_reads(trace, s)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    pl = worker_result(_run([sys.executable, os.path.abspath(__file__), "--worker-prefill", "--model", a.model,
                             "--ram", str(a.ram), "--prefill", str(a.prefill)], env=env,
                            what="per-layer prefill costs"))
    pf["layers"] = pl
    pf["projection"] = pl if "error" in pl else project_ttft(pl)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example: python tools/bench_glm5.py --model /work/glm5-slice --ram 8")
    ap.add_argument("--model", required=True, help="slice folder (tools/make_glm5_slice.py)")
    ap.add_argument("--ram", type=float, default=8.0, help="RAM budget in GB (default 8)")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per run (default 64)")
    ap.add_argument("--prefill", type=int, default=2048, help="prompt tokens of the prefill run (default 2048)")
    ap.add_argument("--only-prefill", action="store_true",
                    help="only the prefill run, its reads and its time-to-first-token projection")
    ap.add_argument("--ctx", type=int, default=6000, help="context of the long run (default 6000; 0 = skip)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--fio-seconds", type=int, default=5, help="seconds per fio measurement (default 5)")
    ap.add_argument("--work", default="/tmp/colibri_glm5_bench", help="scratch folder for stats files")
    ap.add_argument("--json", default=None, help="write every number here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-prefill", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        layer_worker(a.model, a.ram, a.tokens, a.direct)
        return 0
    if a.worker_prefill:
        prefill_layer_worker(a.model, a.ram, a.prefill)
        return 0
    os.makedirs(a.work, exist_ok=True)
    with open(os.path.join(a.model, "config.json")) as f:
        cfg = json.load(f)
    vocab, nl = cfg["vocab_size"], cfg["num_hidden_layers"]
    expert_shard = max(shards(a.model), key=os.path.getsize)
    res = {"model": os.path.abspath(a.model), "machine": machine_info(), "threads": a.threads, "ram": a.ram,
           "layers": nl, "disk_bytes": sum(os.path.getsize(p) for p in shards(a.model)), "runs": {},
           "projection": {}}
    res["plan"] = plan_json(a.model, a.ram, 16 + a.tokens + 2)
    if a.only_prefill:
        run_prefill(a, vocab, res)
        res["fio_before"] = res["fio_after"] = {}
        print(render(res))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    res["fio_before"] = fio_best(expert_shard, a.fio_seconds)
    short = prompt_ids(16, vocab)
    res["runs"]["cold O_DIRECT"] = colibri_run(a.model, short, a.tokens, a.ram, a.threads, a.work, "direct",
                                               ["--direct"])
    drop_page_cache(a.model)
    res["runs"]["cold page cache"] = colibri_run(a.model, short, a.tokens, a.ram, a.threads, a.work, "cold")
    res["runs"]["warm page cache"] = colibri_run(a.model, short, a.tokens, a.ram, a.threads, a.work, "warm")
    run_prefill(a, vocab, res)
    if a.ctx:
        res["runs"]["context"] = colibri_run(a.model, prompt_ids(a.ctx, vocab, 2), 16, a.ram, a.threads, a.work,
                                             "context")
    res["fio_after"] = fio_best(expert_shard, a.fio_seconds)
    best = max([f for f in (res["fio_before"].get("best_gbs"), res["fio_after"].get("best_gbs")) if f] or [0]) or None
    for key, direct in (("O_DIRECT", True), ("page cache", False)):
        layers = run_layer_worker(a.model, a.ram, min(a.tokens, 32), a.threads, direct)
        res["projection"][key] = layers if "error" in layers else dict(project(layers, best), layers=layers)
    text = render(res)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
