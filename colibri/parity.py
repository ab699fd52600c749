"""Parity checker: the engine's outputs against reference outputs made with HF transformers."""
from __future__ import annotations

import json
import sys

import numpy as np


def load_ref(path):
    try:
        with open(path) as f:
            ref = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: reference file not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    for key in ("prompt_ids", "full_ids", "tf_pred"):
        if key not in ref or not isinstance(ref[key], list):
            raise ValueError(f"{path}: missing list field '{key}'")
    if ref["full_ids"][:len(ref["prompt_ids"])] != ref["prompt_ids"]:
        raise ValueError(f"{path}: full_ids does not start with prompt_ids")
    if len(ref["tf_pred"]) != len(ref["full_ids"]):
        raise ValueError(f"{path}: tf_pred and full_ids differ in length")
    return ref


def check(model, ref) -> dict:
    """Teacher forcing over full_ids and greedy generation from prompt_ids."""
    full = ref["full_ids"]
    prompt = ref["prompt_ids"]
    pred, logits = model.forward_all(full)
    res = {
        "tf_match": int(np.sum(pred == np.asarray(ref["tf_pred"]))),
        "tf_total": len(full),
    }
    want = full[len(prompt):]
    got = model.generate(prompt, len(want))
    res["greedy_match"] = sum(int(a == b) for a, b in zip(got, want))
    res["greedy_total"] = len(want)
    res["greedy_ids"] = got
    if ref.get("logits") is not None:
        ref_logits = np.asarray(ref["logits"], dtype=np.float32)
        if ref_logits.shape != logits.shape:
            raise ValueError(f"reference logits have shape {ref_logits.shape}, engine gives {logits.shape}")
        res["max_abs_logit_diff"] = float(np.max(np.abs(ref_logits - logits)))
    return res


def passed(res, max_logit_diff=None) -> bool:
    ok = res["tf_match"] == res["tf_total"] and res["greedy_match"] == res["greedy_total"]
    if max_logit_diff is not None and "max_abs_logit_diff" in res:
        ok = ok and res["max_abs_logit_diff"] <= max_logit_diff
    return ok


def run(args) -> int:
    from ._core import model_init
    from .options import from_args
    opts = from_args(args)
    ref = load_ref(args.ref)
    model = model_init(args.model, **opts.engine_kwargs())
    res = check(model, ref)
    ok = passed(res, args.max_logit_diff)
    if args.json:
        out = {k: v for k, v in res.items() if k != "greedy_ids"}
        out["pass"] = ok
        print(json.dumps(out))
    else:
        print(f"teacher forcing: {res['tf_match']}/{res['tf_total']} positions")
        print(f"greedy:          {res['greedy_match']}/{res['greedy_total']} tokens")
        if "max_abs_logit_diff" in res:
            print(f"max |Δlogit|:    {res['max_abs_logit_diff']:.3g}")
        print("PARITY OK" if ok else "PARITY FAILED")
    return 0 if ok else 1
