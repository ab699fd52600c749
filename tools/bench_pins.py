"""Pins learned on some prompts, measured on others: does the hot-store generalize?

    python tools/bench_pins.py [--model DIR] [--cache 2] [--pins 2] [--learn 24] [--held 12]
                               [--tokens 64] [--json FILE]

Routing statistics only mean something on a model whose routing is not random, so this runs on the
embedded default model (trained on the Python standard library) unless --model says otherwise.
The prompts are function-definition lines of standard-library files, split the way
tools/train_tiny.py splits its corpus (train / held-out by the hash of the file path):

1. learning: each learning prompt is run once (`colibri run`, --no-autopin); the runner adds every
   run's routing counts to the usage history, which becomes the pin statistics;
2. measuring: the held-out prompts, and the learning prompts again (in-sample), each with three
   expert caches of the same per-layer LRU size C: plain LRU C; LRU C + P pinned experts per MoE layer
   (the hottest of the history, --pin HISTORY --pin-gb); and plain LRU C + P (the same RAM as the
   pins, spent on a larger LRU), so the pins' gain is measured against what the memory would
   otherwise buy.

Reported per configuration and prompt set: expert hit rate (hits / lookups over all runs),
router-lookahead prefetch recall, decode tok/s (median). A gain that shows in-sample but not on
the held-out prompts is overfitting.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from train_tiny import is_heldout, load_corpus  # noqa: E402  (the corpus split, stdlib only)


def default_model() -> str:
    import colibri
    return os.path.join(os.path.dirname(colibri.__file__), "models", "default")


def def_lines(docs, n: int, skip=()) -> list:
    """The first top-level 'def NAME(...):' line of each document, distinct, up to n."""
    out, seen = [], set(skip)
    for _, text in docs:
        for line in text.split("\n"):
            if re.match(r"^def \w+\(.*\):$", line) and len(line) <= 72:
                if line not in seen:
                    seen.add(line)
                    out.append(line)
                break
        if len(out) == n:
            break
    return out


def run(model: str, prompt: str, tokens: int, env: dict, *extra) -> dict:
    """One `colibri run`; its --stats-json as a dict."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        stats = f.name
    try:
        cmd = [sys.executable, "-m", "colibri", "run", "--model", model, "--prompt", prompt,
               "--max-tokens", str(tokens), "--temperature", "0", "--stats-json", stats, "--quiet",
               "--no-autopin", "--draft", "0", *map(str, extra)]    # main-layer pins alone (no MTP tier)
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"colibri run failed ({p.returncode}): {p.stderr.strip()[-400:]}")
        with open(stats) as f:
            return json.load(f)
    finally:
        os.unlink(stats)


def summarize(samples) -> dict:
    hits = sum(s["expert_hits"] for s in samples)
    looks = hits + sum(s["expert_misses"] for s in samples)
    recalls = [s["prefetch_recall"] for s in samples if s.get("prefetch_recall") is not None]
    return {"runs": len(samples), "hit_rate": hits / looks if looks else None,
            "prefetch_recall": statistics.mean(recalls) if recalls else None,
            "decode_tok_s": statistics.median(s["decode_tok_s"] for s in samples),
            "pinned_experts": samples[-1].get("pinned_experts")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--cache", type=int, default=2, help="LRU experts per layer (C)")
    ap.add_argument("--pins", type=int, default=2, help="pinned experts per MoE layer (P)")
    ap.add_argument("--learn", type=int, default=24, help="learning prompts")
    ap.add_argument("--held", type=int, default=12, help="held-out prompts")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt (greedy)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    model = os.path.abspath(args.model or default_model())

    from colibri import _core, tiers
    m = _core.model_init(model, cache_experts=1)
    row_bytes = [b for b in tiers.expert_bytes_by_row(m)[:m.cfg.n_layers] if b]
    n_moe, expert_bytes = len(row_bytes), max(row_bytes)
    n_experts = m.cfg.n_experts
    del m
    if not args.cache + args.pins < n_experts:
        ap.error(f"--cache + --pins must stay below the {n_experts} experts of a layer")

    train, held = load_corpus()
    learn = def_lines(train, args.learn)
    heldout = def_lines(held, args.held, skip=learn)
    if len(learn) < args.learn or len(heldout) < args.held:
        print(f"note: found {len(learn)} learning and {len(heldout)} held-out prompts", file=sys.stderr)

    with tempfile.TemporaryDirectory() as state:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), COLIBRI_USAGE_DIR=state)
        print(f"learning the routing on {len(learn)} prompts ...", file=sys.stderr)
        for p in learn:
            run(model, p, args.tokens, env, "--cache-experts", args.cache, "--threads", args.threads)
        history = [os.path.join(state, f) for f in os.listdir(state) if f.endswith(".txt")]
        if len(history) != 1:
            raise RuntimeError(f"expected one usage history in {state}, found {history}")
        pinned = os.path.join(state, "pins.txt")
        os.replace(history[0], pinned)          # frozen: the measuring runs must not add to it
        pin_gb = args.pins * n_moe * expert_bytes / 1e9
        configs = {
            f"LRU {args.cache}": ["--cache-experts", args.cache],
            f"LRU {args.cache} + {args.pins} pins": ["--cache-experts", args.cache, "--pin", pinned,
                                                    "--pin-gb", f"{pin_gb:.9f}"],
            f"LRU {args.cache + args.pins}": ["--cache-experts", args.cache + args.pins],
        }
        results = {}
        for name, extra in configs.items():
            for label, prompts in (("held-out", heldout), ("in-sample", learn)):
                print(f"{name}, {label} ...", file=sys.stderr)
                samples = [run(model, p, args.tokens, env, *extra, "--threads", args.threads) for p in prompts]
                results[f"{name} | {label}"] = summarize(samples)

    print(f"\nModel {model}: {n_moe} MoE layers x {n_experts} experts, {expert_bytes} bytes per expert; "
          f"pins learned on {len(learn)} prompts x {args.tokens} tokens, measured on {len(heldout)} held-out "
          f"prompts and on the learning prompts again.\n")
    print("| cache per layer | prompts | expert hit rate | prefetch recall | decode tok/s (median) |")
    print("|:---|:---|---:|---:|---:|")
    for key, r in results.items():
        name, label = key.split(" | ")
        hr = f"{100 * r['hit_rate']:.1f}%" if r["hit_rate"] is not None else "–"
        rc = f"{100 * r['prefetch_recall']:.1f}%" if r["prefetch_recall"] is not None else "–"
        print(f"| {name} | {label} | {hr} | {rc} | {r['decode_tok_s']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "cache": args.cache, "pins": args.pins, "tokens": args.tokens,
                       "learn_prompts": learn, "heldout_prompts": heldout, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
