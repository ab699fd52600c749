"""``python -m colibri run``: generate from a prompt and report what it cost."""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import numpy as np


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024


def parse_ids(text: str, vocab: int) -> list:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise ValueError(f"--prompt-ids: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids: no token ids given")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"--prompt-ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return ids


def load_tokenizer(model_dir: str):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path)


class Sampler:
    """Greedy when temperature <= 0, else temperature + nucleus (top-p) sampling."""

    def __init__(self, temperature: float, top_p: float, seed):
        if not temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
        self.temperature, self.top_p = temperature, top_p
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits) -> int:
        if self.temperature <= 0:
            return int(np.argmax(logits))
        z = (logits.astype(np.float64) - float(np.max(logits))) / max(self.temperature, 1e-4)
        p = np.exp(z)
        p /= p.sum()
        if self.top_p < 1:
            order = np.argsort(-p, kind="stable")
            keep = int(np.searchsorted(np.cumsum(p[order]), self.top_p)) + 1
            mask = np.zeros_like(p)
            mask[order[:keep]] = 1
            p = p * mask
            p /= p.sum()
        return int(self.rng.choice(len(p), p=p))


def run(args) -> int:
    from .cli import engine_kwargs
    from ._core import model_init
    if args.model is None:
        raise ValueError("no --model given (the embedded default model is not available in this build)")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    sampler = Sampler(args.temperature, args.top_p, args.seed)
    t_load = time.perf_counter()
    model = model_init(args.model, **engine_kwargs(args))
    t_load = time.perf_counter() - t_load
    cfg = model.cfg
    tok = load_tokenizer(args.model)
    if args.prompt_ids is not None:
        ids = parse_ids(args.prompt_ids, cfg.vocab)
    elif args.prompt is not None:
        if tok is None:
            raise ValueError(f"{args.model} has no tokenizer.json: give the prompt as --prompt-ids")
        ids = tok.encode(args.prompt).ids
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
    else:
        raise ValueError("give a PROMPT or --prompt-ids")
    if cfg.max_positions and len(ids) + args.max_tokens > cfg.max_positions:
        raise ValueError(f"prompt ({len(ids)} tokens) + --max-tokens ({args.max_tokens}) exceeds the model's "
                         f"context of {cfg.max_positions} positions")
    stops = set(cfg.eos_ids)
    out_ids = []
    printer = _Printer(tok, args.quiet)
    if not args.quiet:
        print(f"[colibri] {args.model}: {cfg.n_layers} layers, {cfg.n_experts} experts (top-{cfg.topk}), "
              f"loaded in {t_load:.2f}s; prompt {len(ids)} tokens", file=sys.stderr)
    model.kv_alloc(len(ids) + args.max_tokens + 2)
    model.reset_stats()
    t0 = time.perf_counter()
    logits = model.step(ids, 0)
    t_prefill = time.perf_counter() - t0
    kv = len(ids)
    t1 = time.perf_counter()
    while len(out_ids) < args.max_tokens:
        nxt = sampler(logits)
        if nxt in stops:
            break
        out_ids.append(nxt)
        printer.emit(nxt)
        if len(out_ids) >= args.max_tokens:
            break
        logits = model.step([nxt], kv)
        kv += 1
    t_decode = time.perf_counter() - t1
    printer.finish()
    n_dec = len(out_ids)
    stats = {
        "tokens": out_ids,
        "prefill_tokens": len(ids),
        "prefill_s": t_prefill,
        "decode_tokens": n_dec,
        "decode_s": t_decode,
        "decode_tok_s": (n_dec / t_decode) if t_decode > 0 else 0.0,
        "forwards": int(model.forwards),
        "expert_hits": int(model.expert_hits),
        "expert_misses": int(model.expert_misses),
        "bytes_read": int(model.bytes_read),
        "peak_rss_bytes": peak_rss_bytes(),
        "load_s": t_load,
        "resident_bytes": int(model.resident_bytes()),
    }
    if not args.quiet:
        looks = stats["expert_hits"] + stats["expert_misses"]
        hit = 100.0 * stats["expert_hits"] / looks if looks else 0.0
        print(f"---\nprefill {len(ids)} tok in {t_prefill:.3f}s ({len(ids) / max(t_prefill, 1e-9):.1f} tok/s) | "
              f"decode {n_dec} tok in {t_decode:.3f}s ({stats['decode_tok_s']:.1f} tok/s) | "
              f"expert hit {hit:.1f}% ({stats['expert_misses']} loads, {stats['bytes_read'] / 1e6:.1f} MB read) | "
              f"peak RSS {stats['peak_rss_bytes'] / 2**30:.2f} GiB", file=sys.stderr)
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            json.dump(stats, f)
    return 0


class _Printer:
    """Streams tokens to stdout: text through the tokenizer (incremental decode), else ids."""

    def __init__(self, tok, quiet):
        self.tok, self.ids, self.shown = tok, [], ""

    def emit(self, t):
        self.ids.append(t)
        if self.tok is None:
            sys.stdout.write(f"{t} ")
        else:
            text = self.tok.decode(self.ids)
            if text.endswith("\ufffd"):
                return                      # an incomplete UTF-8 sequence: wait for the next token
            sys.stdout.write(text[len(self.shown):])
            self.shown = text
        sys.stdout.flush()

    def finish(self):
        sys.stdout.write("\n")
        sys.stdout.flush()
