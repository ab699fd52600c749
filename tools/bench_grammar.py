"""Grammar-constrained decoding: does it hold, and what do the grammar's forced tokens buy?

1. Validity: 20 prompts (chat-formatted, sampled at T 0.7, seeds 0..19) with a JSON schema as the
   response format, and the same prompts without it: how many outputs parse and validate.
2. Speed: schema-constrained output and a forced tool call, greedy, with the forced tokens put into
   verify forwards as drafts (COLIBRI_FORCED_DRAFTS=1, the default) and without (=0), at --draft 0
   and auto: tokens per forward, forced tokens and decode tok/s, fresh ``run`` processes interleaved,
   medians over the rounds.

    python tools/bench_grammar.py [--model DIR] [--rounds 5] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "email": {"type": "string", "maxLength": 24},
                         "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3}}}
WEATHER = {"type": "object", "required": ["city", "days", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
ASKS = ["Describe a user of this system as JSON.", "Give me the record of the admin account.",
        "Return the profile of a new guest.", "Who is the oldest user?", "Make up a user for the tests."]


def validity(model, n=20) -> dict:
    import jsonschema
    import colibri
    llm = colibri.load(model, temperature=0.7, max_tokens=120)
    out = {}
    try:
        for mode in ("constrained", "free"):
            ok = 0
            for i in range(n):
                ids = llm.chat_ids([{"role": "user", "content": ASKS[i % len(ASKS)]}])
                c = llm.complete(ids, seed=i, json_schema=PERSON if mode == "constrained" else None)
                try:
                    jsonschema.validate(json.loads(c.text), PERSON)
                    ok += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
            out[mode] = {"valid": ok, "of": n}
    finally:
        llm.close()
    return out


def one_run(model, prompt, flag, value, draft, forced, tmp) -> dict:
    stats = os.path.join(tmp, "stats.json")
    env = dict(os.environ, COLIBRI_FORCED_DRAFTS="1" if forced else "0")
    cmd = [sys.executable, "-m", "colibri", "run", prompt, flag, value, "-t", "0", "-n", "160",
           "--draft", str(draft), "--quiet", "--stats-json", stats] + (["--model", model] if model else [])
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(stats) as f:
        s = json.load(f)
    return {k: s[k] for k in ("decode_tokens", "decode_tok_s", "tokens_per_forward", "forced_tokens")}


def speed(model, rounds) -> list:
    from colibri.tools import Tool, call_grammar
    tool = call_grammar([Tool("get_weather", "", WEATHER)])
    cases = [("schema", "--json-schema", json.dumps(PERSON), "<|user|>\nA user record, as JSON.\n<|assistant|>\n"),
             ("tool call", "--grammar", tool, "<|user|>\nThe weather in Paris?\n<|assistant|>\n")]
    configs = [(d, f) for d in (0, "auto") for f in (True, False)]
    rows = {(c[0], d, f): [] for c in cases for d, f in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, flag, value, prompt in cases:
                for d, f in (configs if r % 2 == 0 else configs[::-1]):
                    rows[(name, d, f)].append(one_run(model, prompt, flag, value, d, f, tmp))
    out = []
    for (name, d, f), runs in rows.items():
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        out.append({"case": name, "draft": d, "forced_drafts": f, **med})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    res = {"validity": validity(args.model), "speed": speed(args.model, args.rounds)}
    v = res["validity"]
    print(f"JSON schema outputs valid: constrained {v['constrained']['valid']}/{v['constrained']['of']}, "
          f"unconstrained {v['free']['valid']}/{v['free']['of']}")
    print("| output | --draft | forced tokens as drafts | tokens/forward | forced tokens | decode tok/s |")
    print("|---|---|---|---|---|---|")
    for r in res["speed"]:
        print(f"| {r['case']} | {r['draft']} | {'yes' if r['forced_drafts'] else 'no'} | "
              f"{r['tokens_per_forward']:.2f} | {r['forced_tokens']:.0f} | {r['decode_tok_s']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
