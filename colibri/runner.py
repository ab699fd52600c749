"""``python -m colibri run``: generate from a prompt and report what it cost."""
from __future__ import annotations

import json
import os
import sys
import time

from .options import env_get, from_args
from .session import Session, positions_needed
from .sysinfo import peak_rss_bytes
from .tokenizer import load_tokenizer


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


def check_writable(path: str, flag: str) -> None:
    """An output file's folder exists and takes a file: checked before the work that fills it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a folder")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: the folder {folder} is not writable")


def run(args) -> int:
    """The run subcommand: options checked, the prompt read, the model loaded, one generation."""
    from ._core import model_init
    opts = from_args(args)
    if args.prompt is not None and args.prompt_ids is not None:
        raise ValueError("give the prompt as text or as --prompt-ids, not both")
    if args.prompt is None and args.prompt_ids is None:
        raise ValueError("give a PROMPT or --prompt-ids")
    for path, flag in ((args.stats_json, "--stats-json"), (args.trace, "--trace")):
        if path:
            check_writable(path, flag)
    model_dir = args.model or env_get(os.environ, "MODEL")
    if not model_dir:
        from .models import default_model_dir
        model_dir = default_model_dir()
        if not args.quiet:
            print(f"[colibri] no --model given: using the embedded default model ({model_dir})", file=sys.stderr)
    tok = load_tokenizer(model_dir)        # a damaged tokenizer.json fails before the weights are mapped
    if args.prompt is not None and tok is None:
        raise ValueError(f"{model_dir} has no tokenizer.json: give the prompt as --prompt-ids")
    t_load = time.perf_counter()
    model = model_init(model_dir, **opts.engine_kwargs())
    cluster = None
    try:
        if opts.cluster:
            from .cluster import attach
            cluster = attach(model, model_dir, opts)
        t_load = time.perf_counter() - t_load
        cfg = model.cfg
        ids = parse_ids(args.prompt_ids, cfg.vocab) if args.prompt_ids is not None else tok.encode(args.prompt).ids
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        need = positions_needed(len(ids), opts.max_tokens, opts.draft)
        if cfg.max_positions and need > cfg.max_positions:
            from .session import check_room
            check_room(len(ids), opts.max_tokens, opts.draft, cfg.max_positions, tokens_name="--max-tokens")
        return _generate(args, opts, model_dir, model, tok, ids, need, t_load, cluster)
    finally:
        if cluster is not None:
            from .cluster import detach
            detach(model, cluster)
        model.close()


def _generate(args, opts, model_dir, model, tok, ids, need, t_load, cluster=None) -> int:
    from . import omp
    cfg = model.cfg
    session = Session(model, opts, context=need, tokenizer=tok)
    tiers = session.tiers
    if not args.quiet:
        print(tiers.summary(), file=sys.stderr)
        print(f"[colibri] {model_dir}: {cfg.n_layers} layers, {cfg.n_experts} experts (top-{cfg.topk}), "
              f"{'MTP head' if model.has_mtp else 'no MTP head'}, loaded in {t_load:.2f}s; "
              f"prompt {len(ids)} tokens", file=sys.stderr)
    note = model.dsa_note()
    if note and need > cfg.index_topk:
        print(f"[colibri] note: {note}", file=sys.stderr)
    if args.trace:
        model.record_routing()
    out = _Stdout()
    bar = PrefillProgress(disable=args.quiet)

    def progress(done, total):
        bar.update(done, total)
    try:
        g = session.generate(ids, stop=args.stop or (), on_text=out.write, progress=progress)
    finally:
        bar.close()
    out.end()
    stats = dict(g.stats)
    t_prefill, t_decode = stats["prefill_s"], stats["decode_s"]
    stats.update({
        "tokens": g.token_ids,
        "peak_rss_bytes": peak_rss_bytes(),
        "load_s": t_load,
        "resident_bytes": int(model.resident_bytes()),
        "kv_bytes": int(model.kv_bytes(need)),
        "dsa_indexer": not model.indexer_absent, "dsa_dense_past_topk": bool(model.dense_past_topk),
        "notes": [note] if note and model.dense_past_topk else [],
        "omp_wait_policy": omp.choose(),
    })
    stats.update(tier_stats(model, tiers, t_prefill + t_decode))
    if cluster is not None:
        stats["cluster"] = cluster.stats()
    if not args.quiet:
        n_dec = len(g.token_ids)
        print(f"---\nprefill {len(ids)} tok in {t_prefill:.3f}s ({len(ids) / max(t_prefill, 1e-9):.1f} tok/s) | "
              f"time to first token {stats['ttft_s']:.3f}s | "
              f"decode {n_dec} tok in {t_decode:.3f}s ({stats['decode_tok_s']:.1f} tok/s) | "
              f"peak RSS {stats['peak_rss_bytes'] / 2**30:.2f} GiB", file=sys.stderr)
        print(tier_line(stats), file=sys.stderr)
        print(spec_line(stats), file=sys.stderr)
        if cluster is not None:
            from .cluster import summary_line
            print(summary_line(stats["cluster"]), file=sys.stderr)
        print(f"stopped: {STOPPED[g.stopped_by]} | seed {g.seed}", file=sys.stderr)
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            json.dump(stats, f)
    if args.trace:
        write_trace(args.trace, model, model_dir)
    try:
        tiers.save_usage(model)
    except OSError as e:
        print(f"[colibri] warning: routing history not saved ({e})", file=sys.stderr)
    return 0


#: The summary's words for Generation.stopped_by.
STOPPED = {"eos": "end-of-sequence token", "stop": "stop string", "length": "--max-tokens reached",
           "cancel": "cancelled"}


class _Stdout:
    """The generated text on stdout as it comes (a closed pipe, ``| head``, raises BrokenPipeError
    for the CLI to end quietly)."""

    def write(self, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    def end(self) -> None:
        sys.stdout.write("\n")
        sys.stdout.flush()


def spec_line(s: dict) -> str:
    """The run summary's speculation line: tokens per forward, drafts, acceptance by position,
    the MTP experts' hit rate and where the drafting iterations' time went."""
    parts = [f"speculation: {s['tokens_per_forward']:.2f} tokens/forward",
             f"drafts proposed {s['drafts_proposed']}, accepted {s['drafts_accepted']} ({100 * s['acceptance']:.1f}%)"
             + (" | drafting turned off" if s["draft_off"] else "")]
    if s.get("constrained"):
        parts.append(f"grammar forced {s['forced_tokens']} tokens (free drafts)")
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
        for fwd, layer, rows, experts in model.routing:
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
