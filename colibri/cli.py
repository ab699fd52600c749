"""Command line: ``python -m colibri {run,convert,parity,chat,plan,serve} ...``.

Every subcommand takes its settings from :mod:`colibri.options` (``add_arguments`` / ``from_args``:
flags, then ``COLIBRI_*`` environment variables, then defaults); this module only builds the parser
and dispatches. Nothing imports it.
"""
from __future__ import annotations

import argparse
import os
import sys

from .config import ConfigError
from .options import add_arguments


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
                              "# prefill in pieces of 512 tokens\n"
                              "  python -m colibri run \"# a user record\" --json-schema person.json   "
                              "# output valid for a JSON schema\n"
                              "  python -m colibri run \"Proceed?\" --grammar 'root ::= \"yes\" | \"no\"'")
    r.add_argument("prompt", nargs="?", default=None, help="prompt text (needs tokenizer.json in the model)")
    r.add_argument("--prompt", "-p", dest="prompt_text", default=None, metavar="TEXT",
                   help="the prompt text as an option (instead of the positional PROMPT)")
    r.add_argument("--model", "-m", required=False, default=None,
                   help="model directory (default: COLIBRI_MODEL, else the embedded model)")
    r.add_argument("--prompt-ids", default=None, metavar="IDS", help="prompt as comma-separated token ids")
    r.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the generation where the text contains TEXT (not printed); repeatable")
    r.add_argument("--stats-json", default=None, metavar="FILE", help="write run statistics as JSON")
    r.add_argument("--trace", default=None, metavar="FILE",
                   help="record the routing (experts requested per MoE layer call) as JSON Lines, for "
                        "tools/simulate_cache.py")
    r.add_argument("--quiet", "-q", action="store_true", help="print only the generated text")
    add_arguments(r, max_tokens=64)

    c = sub.add_parser("convert", help="convert HF safetensors into the quantized container",
                       description="Convert an HF glm_moe_dsa checkpoint (bf16/f16/f32/FP8) into colibri's "
                                   "quantized container (byte-compatible with colibrì's).")
    from . import convert
    convert.add_arguments(c)

    from . import parity
    p = sub.add_parser("parity", help="compare the engine against reference outputs",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Teacher-forcing, greedy and logit agreement against a reference JSON made "
                                   "with HF transformers (tools/make_oracle.py writes them). Exit 0 when all hold.",
                       epilog=parity.FORMAT % parity.LOGIT_RTOL
                       + "\n\nexamples:\n  python -m colibri parity /data/glm52-int4 ref.json\n"
                         "  python -m colibri parity DIR ref.json --idot 0 --max-logit-diff 1e-4 --json")
    p.add_argument("model", help="model directory")
    p.add_argument("ref", help="reference JSON file (format below)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--max-logit-diff", type=float, default=None, metavar="X",
                   help="largest |Δlogit| that passes (default: %g of the reference's largest |logit|)"
                        % parity.LOGIT_RTOL)
    add_arguments(p, groups=("engine",))

    h = sub.add_parser("chat", help="interactive conversation (streams answers, reopens after a restart)",
                       description="Chat with a model: answers stream as they are generated; :reset, :more, "
                                   ":stats. The conversation (KV cache + history) is saved after every turn "
                                   "and reopened by the next `chat` without prefilling old turns.")
    from . import chat
    chat.add_arguments(h)

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

    cl = sub.add_parser("cluster", help="start the Ray processes of a cluster of expert workers (--cluster)",
                        description="Machines whose RAM holds the routed experts: the head runs on the "
                                    "coordinator (the machine that runs serve/run/chat --cluster), `worker` "
                                    "on each expert machine.")
    from . import cluster_cmd
    cluster_cmd.add_arguments(cl)
    return ap


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
        if args.command == "cluster":
            from .cluster_cmd import run
            return run(args)
    except BrokenPipeError:
        # the reader went away (`| head`): not an error; stdout is pointed at /dev/null so that
        # Python's own flush at exit does not complain
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return 0
    except (ConfigError, ValueError, OSError, RuntimeError) as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncolibri: interrupted", file=sys.stderr)
        return 130
    return 2
