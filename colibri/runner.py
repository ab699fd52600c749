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


def run(args) -> int:
    from .cli import engine_kwargs
    from ._core import Sampler, model_init
    from .draft import MAX_AUTO_DEPTH, DraftPolicy, parse_draft
    if args.model is None:
        from .models import default_model_dir
        args.model = default_model_dir()
        if not args.quiet:
            print(f"[colibri] no --model given: using the embedded default model ({args.model})", file=sys.stderr)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    draft_mode = parse_draft(args.draft)
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
    max_depth = draft_mode if isinstance(draft_mode, int) else MAX_AUTO_DEPTH
    need = len(ids) + args.max_tokens + max_depth + 2
    if cfg.max_positions and need > cfg.max_positions:
        raise ValueError(f"prompt ({len(ids)} tokens) + --max-tokens ({args.max_tokens}) exceeds the model's "
                         f"context of {cfg.max_positions} positions")
    sampler = Sampler(cfg.vocab, args.temperature, args.top_p, args.seed)
    policy = DraftPolicy(draft_mode)
    stops = set(cfg.eos_ids)
    printer = _Printer(tok, args.quiet)
    if not args.quiet:
        print(f"[colibri] {args.model}: {cfg.n_layers} layers, {cfg.n_experts} experts (top-{cfg.topk}), "
              f"{'MTP head' if model.has_mtp else 'no MTP head'}, loaded in {t_load:.2f}s; "
              f"prompt {len(ids)} tokens", file=sys.stderr)
    model.kv_alloc(need)
    model.reset_stats()
    if args.trace:
        model.trace = []
    # With a forced depth the MTP head learns the prompt's (token, hidden) pairs during prefill, as
    # colibrì does. Under --draft auto they are absorbed lazily, in one batch before the first draft,
    # so a head the policy finds useless costs the prefill nothing.
    model.mtp_absorb_prefill = model.has_mtp and isinstance(draft_mode, int) and draft_mode > 0
    t0 = time.perf_counter()
    history = list(ids)
    logits = model.step(history, 0)
    t_prefill = time.perf_counter() - t0
    t1 = time.perf_counter()
    out_ids, _ = model.spec_decode(history, len(ids), args.max_tokens, logits, sampler, policy,
                                   stops=stops, emit=printer.emit)
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
        "decode_forwards": int(model.decode_forwards),
        "tokens_per_forward": (n_dec / model.decode_forwards) if model.decode_forwards else float(n_dec),
    }
    stats.update(policy.stats())
    if not args.quiet:
        looks = stats["expert_hits"] + stats["expert_misses"]
        hit = 100.0 * stats["expert_hits"] / looks if looks else 0.0
        print(f"---\nprefill {len(ids)} tok in {t_prefill:.3f}s ({len(ids) / max(t_prefill, 1e-9):.1f} tok/s) | "
              f"decode {n_dec} tok in {t_decode:.3f}s ({stats['decode_tok_s']:.1f} tok/s) | "
              f"expert hit {hit:.1f}% ({stats['expert_misses']} loads, {stats['bytes_read'] / 1e6:.1f} MB read) | "
              f"peak RSS {stats['peak_rss_bytes'] / 2**30:.2f} GiB", file=sys.stderr)
        print(f"speculation: {stats['tokens_per_forward']:.2f} tokens/forward | drafts proposed "
              f"{stats['drafts_proposed']}, accepted {stats['drafts_accepted']} "
              f"({100 * stats['acceptance']:.1f}%){' | drafting turned off' if stats['draft_off'] else ''}",
              file=sys.stderr)
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            json.dump(stats, f)
    if args.trace:
        write_trace(args.trace, model, args.model)
    return 0


def expert_disk_bytes(model, layer: int, eid: int = 0) -> int:
    """Bytes one expert of this layer occupies on disk (payloads and their row scales)."""
    st, n = model.st, 0
    for m in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.{layer}.mlp.experts.{eid}.{m}.weight"
        n += st.info(name).nbytes
        if name + ".qs" in st:
            n += st.info(name + ".qs").nbytes
    return n


def write_trace(path: str, model, model_dir: str) -> None:
    """The routing of this run as JSON Lines (format in tools/simulate_cache.py): a header, then one
    object per MoE layer call {f: forward, l: layer, s: rows, e: unique experts ascending}."""
    cfg = model.cfg
    moe_layers = [i for i in range(cfg.n_layers) if cfg.sparse[i]] + ([cfg.n_layers] if model.has_mtp else [])
    header = {"format": "colibri-routing-trace", "version": 1, "model": os.path.abspath(model_dir),
              "n_layers": cfg.n_layers, "n_experts": cfg.n_experts, "topk": cfg.topk, "moe_layers": moe_layers,
              "expert_bytes": {str(i): expert_disk_bytes(model, i) for i in moe_layers}}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(header) + "\n")
        for fwd, layer, rows, experts in model.trace:
            f.write(json.dumps({"f": fwd, "l": layer, "s": rows, "e": experts}) + "\n")
    os.replace(tmp, path)


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
