"""Command line: ``python -m colibri {run,convert,parity} ...``."""
from __future__ import annotations

import argparse
import sys

from .config import ConfigError


def _engine_options(p: argparse.ArgumentParser):
    g = p.add_argument_group("engine")
    g.add_argument("--cache-experts", type=int, default=0, metavar="N",
                   help="routed experts cached per layer (LRU); 0 = as many as the RAM budget allows, "
                        "up to all (default)")
    g.add_argument("--dense-bits", type=int, default=32, choices=(4, 8, 32),
                   help="precision of resident weights stored as floats in the model files "
                        "(container files keep their own format; default 32 = f32)")
    g.add_argument("--expert-bits", type=int, default=32, choices=(4, 8, 32),
                   help="precision of routed experts stored as floats (default 32 = f32)")
    g.add_argument("--idot", type=int, default=2, choices=(0, 1, 2),
                   help="matmul path for int8/int4 weights: 2 = integer dots on Q8 activations + Q8 "
                        "residual (default, near-float accuracy); 1 = Q8 activations only (fastest); "
                        "0 = float dequant-on-use")
    g.add_argument("--act-block", type=int, default=0, metavar="N",
                   help="activation quantization block for integer dots: 0 = one scale per row "
                        "(default), or a multiple of 64")
    g.add_argument("--absorb", choices=("auto", "always", "never"), default="auto",
                   help="absorbed MLA attention (latent space): auto = decode and speculative verify (<= 17 rows), "
                        "and prefill once the expanded path's kv_b rows pass 16 MB or the DSA selection runs "
                        "(default)")
    g.add_argument("--dsa-force", action="store_true",
                   help="run the DSA top-k selection even when the context fits in index_topk")
    g.add_argument("--threads", type=int, default=0, help="OpenMP threads (default: all cores)")


def _tier_options(p: argparse.ArgumentParser):
    g = p.add_argument_group("expert tiers and I/O")
    g.add_argument("--ram", type=float, default=None, metavar="GB",
                   help="RAM budget in GB for the expert cache sizing (default: 0.88 x available memory)")
    g.add_argument("--pin", default=None, metavar="STATS",
                   help="pin the most used experts of a stats file ('layer eid count' lines) in RAM")
    g.add_argument("--pin-gb", type=float, default=None, metavar="GB",
                   help="hot-store size for --pin (default 10 GB, capped by the budget)")
    g.add_argument("--no-autopin", action="store_true",
                   help="do not pin experts from the routing history saved next to the model")
    g.add_argument("--no-prefetch", action="store_true",
                   help="turn off the router-lookahead prefetch of the next layer's experts")
    g.add_argument("--lazy-experts", action="store_true",
                   help="when every expert fits in the budget, read each on its first use instead of all "
                        "at start-up (a faster start for a short job; slower first tokens)")
    g.add_argument("--direct", action="store_true",
                   help="read expert payloads with O_DIRECT, bypassing the OS page cache")
    g.add_argument("--io-threads", type=int, default=4, metavar="N",
                   help="concurrent expert reads per MoE layer (default 4)")


def engine_kwargs(args) -> dict:
    kw = dict(cache_experts=args.cache_experts, dense_bits=args.dense_bits, expert_bits=args.expert_bits,
              idot=args.idot, act_block=args.act_block,
              absorb={"auto": -1, "never": 0, "always": 1}[args.absorb],
              dsa_force=args.dsa_force, threads=args.threads)
    if hasattr(args, "io_threads"):
        if args.io_threads < 1:
            raise ValueError(f"--io-threads must be >= 1, got {args.io_threads}")
        kw.update(io_threads=args.io_threads, prefetch=not args.no_prefetch, direct=args.direct)
    return kw


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    ap = argparse.ArgumentParser(prog="python -m colibri",
                                 description="colibri: glm_moe_dsa MoE inference with experts streamed from disk.")
    ap.add_argument("--version", action="version", version=f"colibri {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    r = sub.add_parser("run", help="generate a continuation of a prompt",
                       description="Generate from a prompt (text, or token ids with --prompt-ids).",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n"
                              "  python -m colibri run \"def fibonacci(n):\"                  # the embedded model\n"
                              "  python -m colibri run -m /data/glm52 \"Hello\" -n 128 --ram 24\n"
                              "  python -m colibri run -m DIR --prompt-ids 3,14,15 -t 0 --stats-json stats.json\n"
                              "  python -m colibri run -m DIR -p \"$(cat long_prompt.txt)\" --batch 512   "
                              "# prefill in pieces of 512 tokens")
    r.add_argument("prompt", nargs="?", default=None, help="prompt text (needs tokenizer.json in the model)")
    r.add_argument("--prompt", "-p", dest="prompt_text", default=None, metavar="TEXT",
                   help="the prompt text as an option (instead of the positional PROMPT)")
    r.add_argument("--model", "-m", required=False, default=None, help="model directory")
    r.add_argument("--prompt-ids", default=None, metavar="IDS", help="prompt as comma-separated token ids")
    r.add_argument("--max-tokens", "-n", type=int, default=64, help="tokens to generate (default 64)")
    r.add_argument("--temperature", "-t", type=float, default=0.7,
                   help="sampling temperature; 0 = greedy (default 0.7)")
    r.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    r.add_argument("--seed", type=int, default=None, help="RNG seed for sampling")
    r.add_argument("--draft", default="auto", metavar="N|auto",
                   help="speculative draft depth: auto (default) picks the depth, 0 included, that "
                        "minimises wall time per token; N forces a depth (0 = off). Drafts come from "
                        "the model's MTP head, else from n-gram prompt lookup")
    r.add_argument("--batch", "-b", type=int, default=0, metavar="N",
                   help="prompt tokens per prefill forward: longer prompts go in near-equal pieces of at "
                        "most N (bounded scratch; each streamed expert read once per piece and layer; the "
                        "same result). 0 = the default: the whole prompt, in pieces only where the RAM budget is small")
    r.add_argument("--stats-json", default=None, metavar="FILE", help="write run statistics as JSON")
    r.add_argument("--trace", default=None, metavar="FILE",
                   help="record the routing (experts requested per MoE layer call) as JSON Lines, for "
                        "tools/simulate_cache.py")
    r.add_argument("--quiet", "-q", action="store_true", help="print only the generated text")
    _engine_options(r)
    _tier_options(r)

    c = sub.add_parser("convert", help="convert HF safetensors into the quantized container",
                       description="Convert an HF glm_moe_dsa checkpoint (bf16/f16/f32/FP8) into colibri's "
                                   "quantized container (byte-compatible with colibrì's).")
    from . import convert
    convert.add_arguments(c)

    p = sub.add_parser("parity", help="compare the engine against reference outputs",
                       description="Teacher-forcing and greedy agreement against a reference JSON "
                                   "(prompt_ids, full_ids, tf_pred, optional logits).")
    p.add_argument("model", help="model directory")
    p.add_argument("ref", help="reference JSON file")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--max-logit-diff", type=float, default=None,
                   help="also fail when the largest |Δlogit| exceeds this")
    _engine_options(p)

    h = sub.add_parser("chat", help="interactive conversation (streams answers, reopens after a restart)",
                       description="Chat with a model: answers stream as they are generated; :reset, :more, "
                                   ":stats. The conversation (KV cache + history) is saved after every turn "
                                   "and reopened by the next `chat` without prefilling old turns.")
    from . import chat
    chat.add_arguments(h)
    _serving_engine_options(h)

    pl = sub.add_parser("plan", help="what will live in RAM and on disk, from the file headers alone",
                        description="Resident and expert bytes, the projected RAM peak, the cache and pin "
                                    "capacity for a RAM budget, and the disk bytes per cold token, computed "
                                    "from safetensors headers (no weights are loaded).")
    from . import plan
    plan.add_arguments(pl)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                        description="OpenAI-compatible HTTP server over one model: /v1/models, "
                                    "/v1/chat/completions, /v1/completions (JSON and SSE), /health; a bounded "
                                    "FIFO queue answers 429 when full.")
    from . import server
    server.add_arguments(sv)
    return ap


def _serving_engine_options(p):
    """Engine options of the long-running commands (chat, serve)."""
    g = p.add_argument_group("engine")
    g.add_argument("--cache-experts", type=int, default=0, metavar="N",
                   help="routed experts cached per layer (0 = as many as the RAM budget allows)")
    g.add_argument("--threads", type=int, default=0, help="OpenMP threads (default: all cores)")
    _tier_options(p)


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 2
    if args.command == "run" and args.prompt_text is not None:
        if args.prompt is not None:
            ap.error("run: give the prompt text once (PROMPT or --prompt)")
        args.prompt = args.prompt_text
    try:
        if args.command == "run":
            from .runner import run
            return run(args)
        if args.command == "convert":
            from . import convert
            return convert.run(args) or 0
        if args.command == "parity":
            from .parity import run
            return run(args)
        if args.command == "chat":
            from .chat import run
            return run(args)
        if args.command == "plan":
            from .plan import run
            return run(args)
        if args.command == "serve":
            from .server import run
            return run(args)
    except (ConfigError, ValueError, OSError, RuntimeError) as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncolibri: interrupted", file=sys.stderr)
        return 130
    return 2
