"""``python -m colibri run``: generate from a prompt and report what it cost."""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import numpy as np

from .tokenizer import load_tokenizer


def peak_rss_bytes() -> int:
    """Peak resident set size of this process. Linux: VmHWM of /proc/self/status (ru_maxrss would
    include the peak of the process that forked us, which it keeps across exec); elsewhere
    ru_maxrss (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
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
    tok = load_tokenizer(args.model)        # a damaged tokenizer.json fails before the weights are mapped
    t_load = time.perf_counter()
    model = model_init(args.model, **engine_kwargs(args))
    t_load = time.perf_counter() - t_load
    cfg = model.cfg
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
    try:
        return _generate(args, model, tok, ids, need, draft_mode, t_load)
    finally:
        model.close()


def _generate(args, model, tok, ids, need, draft_mode, t_load) -> int:
    from . import tiers as _tiers
    from ._core import Sampler
    from .draft import DraftPolicy
    cfg = model.cfg
    tiers = _tiers.configure(model, need, requested=args.cache_experts, ram_gb=args.ram, pin=args.pin,
                             pin_gb=args.pin_gb, autopin=not args.no_autopin, prefetch=not args.no_prefetch,
                             warm=not args.lazy_experts, mtp_tier=draft_mode != 0, batch=args.batch)
    if not args.quiet:
        print(tiers.summary(), file=sys.stderr)
    sampler = Sampler(cfg.vocab, args.temperature, args.top_p, args.seed)
    policy = DraftPolicy(draft_mode)
    stops = set(cfg.eos_ids)
    printer = _Printer(tok, args.quiet)
    if not args.quiet:
        print(f"[colibri] {args.model}: {cfg.n_layers} layers, {cfg.n_experts} experts (top-{cfg.topk}), "
              f"{'MTP head' if model.has_mtp else 'no MTP head'}, loaded in {t_load:.2f}s; "
              f"prompt {len(ids)} tokens", file=sys.stderr)
    note = model.dsa_note()
    if note and need > cfg.index_topk:
        print(f"[colibri] note: {note}", file=sys.stderr)
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
    bar = PrefillProgress(disable=args.quiet)
    try:
        logits = model.prefill(history, 0, batch=tiers.batch, progress=bar.update)
    finally:
        bar.close()
    t_prefill = time.perf_counter() - t0
    prefill_read, prefill_misses = int(model.bytes_read), int(model.expert_misses)
    t1 = time.perf_counter()
    out_ids, _ = model.spec_decode(history, len(ids), args.max_tokens, logits, sampler, policy,
                                   stops=stops, emit=printer.emit)
    t_decode = time.perf_counter() - t1
    printer.finish()
    ttft = printer.t_first - t0 if printer.t_first is not None else t_prefill
    model.cache.wait_prefetch()
    n_dec = len(out_ids)
    stats = {
        "tokens": out_ids,
        "prefill_tokens": len(ids),
        "prefill_s": t_prefill,
        "prefill_batch": int(tiers.batch),
        "prefill_bytes_read": prefill_read,         # expert bytes read from disk by the prefill
        "prefill_expert_misses": prefill_misses,
        "ttft_s": ttft,             # prefill start to the first generated token on stdout
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
        "kv_bytes": int(model.kv_bytes(need)),
        "decode_forwards": int(model.decode_forwards),
        "tokens_per_forward": (n_dec / model.decode_forwards) if model.decode_forwards else float(n_dec),
    }
    stats.update(policy.stats())
    stats.update(model.lookahead.stats())
    stats.update(dsa_indexer=not model.indexer_absent, dsa_dense_past_topk=bool(model.dense_past_topk),
                 notes=[note] if note and model.dense_past_topk else [])
    stats.update(tier_stats(model, tiers, t_prefill + t_decode))
    from . import WAIT_POLICY
    stats["omp_wait_policy"] = WAIT_POLICY
    if not args.quiet:
        print(f"---\nprefill {len(ids)} tok in {t_prefill:.3f}s ({len(ids) / max(t_prefill, 1e-9):.1f} tok/s) | "
              f"time to first token {ttft:.3f}s | "
              f"decode {n_dec} tok in {t_decode:.3f}s ({stats['decode_tok_s']:.1f} tok/s) | "
              f"peak RSS {stats['peak_rss_bytes'] / 2**30:.2f} GiB", file=sys.stderr)
        print(tier_line(stats), file=sys.stderr)
        print(spec_line(stats), file=sys.stderr)
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            json.dump(stats, f)
    if args.trace:
        write_trace(args.trace, model, args.model)
    try:
        tiers.save_usage(model)
    except OSError as e:
        print(f"[colibri] warning: routing history not saved ({e})", file=sys.stderr)
    return 0


def spec_line(s: dict) -> str:
    """The run summary's speculation line: tokens per forward, drafts, acceptance by position,
    the MTP experts' hit rate and where the drafting iterations' time went."""
    parts = [f"speculation: {s['tokens_per_forward']:.2f} tokens/forward",
             f"drafts proposed {s['drafts_proposed']}, accepted {s['drafts_accepted']} ({100 * s['acceptance']:.1f}%)"
             + (" | drafting turned off" if s["draft_off"] else "")]
    if s.get("acceptance_by_position"):
        parts.append("by position " + " ".join(f"{100 * a:.0f}%" for a in s["acceptance_by_position"]))
    if s.get("mtp_hit_rate") is not None and s["drafts_proposed"]:
        parts.append(f"MTP experts hit {100 * s['mtp_hit_rate']:.1f}%")
    if s["drafts_proposed"]:
        parts.append(f"time: draft {s['time_draft_s']:.3f}s, verify {s['time_verify_s']:.3f}s, "
                     f"absorb {s['time_absorb_s']:.3f}s, between {s['time_spec_python_s']:.3f}s")
    return " | ".join(parts)


def tier_stats(model, tiers, wall_s: float) -> dict:
    """Cache tiers, disk and time split of a run (the fields tools read from --stats-json)."""
    cs = model.cache.stats
    io = model.io_stats()
    t_disk, t_moe, t_attn = model.t_disk, model.t_moe, model.t_attn
    plan = tiers.plan
    return {
        "hit_rate": cs["hit_rate"], "lru_hit_rate": cs["lru_hit_rate"], "hits_pin": cs["hits_pin"],
        "mtp_hit_rate": model.cache.row_hit_rate(model.cfg.n_layers) if model.has_mtp else None,
        "mtp_tier_bytes": tiers.mtp_tier_bytes,
        "hits_lru": cs["hits_lru"], "hits_kept": cs["hits_kept"], "kept_bytes": cs["kept_bytes"],
        "experts_mapped": bool(getattr(model, "mapped", False)) or model.mapped_experts_used(),
        "prefetch_waits": cs["prefetch_waits"], "misses": cs["misses"], "loads": cs["loads"],
        "read_gb_s": io["read_gb_s"], "disk_busy_s": io["disk_busy_s"],
        "prefetch_issued": cs["prefetch_issued"], "prefetch_loaded": cs["prefetch_loaded"],
        "prefetch_used": cs["prefetch_used"], "prefetch_wasted": cs["prefetch_wasted"] + cs["prefetch_unused"],
        "prefetch_dropped": cs["prefetch_dropped"], "prefetch_recall": cs["prefetch_recall"],
        "pinned_experts": cs["pinned_experts"], "pinned_bytes": cs["pinned_bytes"],
        "cache_experts": model.cache_experts, "ram_budget_bytes": plan.budget_bytes,
        "warm_experts": tiers.warmed, "warm_bytes": tiers.warmed_bytes, "warm_s": tiers.warm_s,
        "projected_peak_bytes": plan.projected_peak_bytes,
        "time_disk_wait_s": t_disk, "time_expert_matmul_s": t_moe, "time_attention_s": t_attn,
        "moe_calls_overlapped": model.overlapped_calls,
        "time_other_s": max(wall_s - t_disk - t_moe - t_attn, 0.0),
    }


def tier_line(s: dict) -> str:
    looks = s["expert_hits"] + s["expert_misses"]
    warm = s.get("warm_experts")
    mapped = s.get("experts_mapped") and not warm          # warmed experts are copies of their own
    kept = f"kept {s['hits_kept']}, " if s.get("hits_kept") or s.get("kept_bytes") else ""
    parts = [f"experts: hit {100 * s['hit_rate']:.1f}% (pinned {s['hits_pin']}, LRU {s['hits_lru']}, {kept}"
             f"prefetched in flight {s['prefetch_waits']}, missed {s['misses']} of {looks})",
             (f"all {warm} read at start-up ({s['warm_bytes'] / 1e6:.1f} MB in {s['warm_s']:.2f}s), "
              f"{s['bytes_read'] / 1e6:.1f} MB since" if warm else
              f"{'mapped' if mapped else 'read'} {s['bytes_read'] / 1e6:.1f} MB at {s['read_gb_s']:.2f} GB/s")]
    if s["prefetch_issued"] or s["prefetch_recall"]:
        parts.append(f"prefetch recall {100 * s['prefetch_recall']:.1f}%, {s['prefetch_loaded']} loaded, "
                     f"{s['prefetch_used']} used, {s['prefetch_wasted']} wasted")
    parts.append(f"time: disk wait {s['time_disk_wait_s']:.3f}s, expert matmul {s['time_expert_matmul_s']:.3f}s, "
                 f"attention {s['time_attention_s']:.3f}s, other {s['time_other_s']:.3f}s")
    if s.get("moe_calls_overlapped"):
        parts.append(f"{s['moe_calls_overlapped']} MoE calls multiplied present experts during reads")
    return " | ".join(parts)


def write_trace(path: str, model, model_dir: str) -> None:
    """The routing of this run as JSON Lines (format in tools/simulate_cache.py): a header, then one
    object per MoE layer call {f: forward, l: layer, s: rows, e: unique experts ascending}."""
    from .tiers import expert_disk_bytes
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


class PrefillProgress:
    """A tqdm bar on stderr for a prompt's prefill (tokens, tok/s), shown once it has taken
    SHOW_AFTER_S seconds: short prompts print nothing. ``update(done, total)`` is
    Model.prefill's progress callback."""
    SHOW_AFTER_S = 1.0

    def __init__(self, disable=False):
        self.disable, self.bar, self.t0 = disable, None, time.perf_counter()

    def update(self, done, total):
        if self.disable:
            return
        if self.bar is None:
            if time.perf_counter() - self.t0 < self.SHOW_AFTER_S:
                return
            from tqdm import tqdm
            # the rate counts from here on (initial=done), not the first second's rows in one jump
            self.bar = tqdm(total=total, initial=done, unit="tok", desc="[colibri] prefill", file=sys.stderr,
                            leave=False, dynamic_ncols=True, mininterval=0.25)
        self.bar.update(done - self.bar.n)

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _Printer:
    """Streams tokens to stdout: text through the tokenizer (incremental decode), else ids.
    t_first: when the first token reached stdout (perf_counter)."""

    def __init__(self, tok, quiet):
        self.tok, self.ids, self.shown = tok, [], ""
        self.t_first = None

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
        if self.t_first is None:
            self.t_first = time.perf_counter()

    def finish(self):
        sys.stdout.write("\n")
        sys.stdout.flush()
