"""Parity checker: the engine's outputs against reference outputs made with HF transformers.

A reference (``ref.json``, written by tools/make_oracle.py or any tool of the same format) holds,
for a prompt of P tokens and a sequence of T tokens (FORMAT below). The verdict has three parts:
teacher forcing (the engine's argmax at every position of full_ids equals tf_pred), greedy
generation from prompt_ids (equals the rest of full_ids), and the largest logit difference (within
the tolerance; by default LOGIT_RTOL of the reference's largest |logit|).

The reference is checked against itself first: its greedy continuation must be what its own
teacher forcing predicts (tf_pred[i] == full_ids[i + 1] for i >= P - 1). Where transformers'
forward over a prefix and over the whole sequence disagree (a DSA top-k tie, a near-tie of two
logits), the reference is ambiguous from that position: greedy is compared up to it, and at it the
engine may take either token.
"""
from __future__ import annotations

import json
import math
from typing import Optional

import numpy as np

#: Default logit tolerance: this fraction of the reference's largest |logit|. The engine's f32 path
#: is ~1e-6 of it from transformers; int8/int4 containers with the default integer dots ~1e-4.
LOGIT_RTOL = 1e-3

FORMAT = """reference file (JSON):
  prompt_ids  [P] token ids, P >= 1: the prompt
  full_ids    [T] token ids, T >= P: the prompt then its greedy continuation (transformers'
              generate, do_sample=False)
  tf_pred     [T] argmax of transformers' logits at every position of one forward over full_ids
              (teacher forcing): tf_pred[i] is the token predicted after full_ids[:i + 1]
  logits      optional [T, V] floats: those logits (V = the model's vocabulary)
  other fields are ignored. Checked: teacher forcing (T positions), greedy (T - P tokens), and
  max |logit - reference| <= --max-logit-diff (default %s x the reference's largest |logit|)."""


def load_ref(path) -> dict:
    """The reference at path, its fields checked (FORMAT): a ValueError names the file and field."""
    try:
        with open(path) as f:
            ref = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: reference file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(ref, dict):
        raise ValueError(f"{path}: expected a JSON object with prompt_ids, full_ids, tf_pred")
    for key in ("prompt_ids", "full_ids", "tf_pred"):
        v = ref.get(key)
        if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
            raise ValueError(f"{path}: '{key}' must be a list of token ids (integers >= 0)")
    P, T = len(ref["prompt_ids"]), len(ref["full_ids"])
    if P < 1:
        raise ValueError(f"{path}: 'prompt_ids' is empty")
    if ref["full_ids"][:P] != ref["prompt_ids"]:
        raise ValueError(f"{path}: 'full_ids' does not start with 'prompt_ids'")
    if len(ref["tf_pred"]) != T:
        raise ValueError(f"{path}: 'tf_pred' has {len(ref['tf_pred'])} entries, 'full_ids' {T}: one per position")
    lg = ref.get("logits")
    if lg is not None:
        try:
            arr = np.asarray(lg, dtype=np.float32)
        except (ValueError, TypeError):
            raise ValueError(f"{path}: 'logits' must be a [T, V] list of lists of numbers") from None
        if arr.ndim != 2 or arr.shape[0] != T:
            raise ValueError(f"{path}: 'logits' has shape {list(arr.shape)}, expected [{T}, V]")
        if not np.isfinite(arr).all():
            raise ValueError(f"{path}: 'logits' holds NaN or infinite values")
        ref["logits"] = arr
    return ref


def ambiguous_at(ref) -> Optional[int]:
    """The first position i >= P - 1 where the reference's teacher forcing does not predict its own
    greedy continuation (tf_pred[i] != full_ids[i + 1]), or None when it is consistent."""
    P, full, tf = len(ref["prompt_ids"]), ref["full_ids"], ref["tf_pred"]
    for i in range(P - 1, len(full) - 1):
        if tf[i] != full[i + 1]:
            return i
    return None


def check(model, ref, max_logit_diff: Optional[float] = None) -> dict:
    """Teacher forcing over full_ids, greedy generation from prompt_ids (through the one driver,
    colibri.session: no drafts, end-of-sequence tokens ignored), the logit difference and the
    verdict (``pass``)."""
    from .options import Options
    from .session import Session, positions_needed
    full, prompt = ref["full_ids"], ref["prompt_ids"]
    V = model.cfg.vocab
    bad = [t for t in full + ref["tf_pred"] if t >= V]
    if bad:
        raise ValueError(f"the reference holds token id {bad[0]}, outside this model's vocabulary [0, {V})")
    amb = ambiguous_at(ref)
    P, T = len(prompt), len(full)
    pred, logits = model.forward_all(full)
    tf_ok = np.asarray(pred) == np.asarray(ref["tf_pred"])
    if amb is not None and pred[amb] == full[amb + 1]:
        tf_ok[amb] = True                        # the reference's other reading of the ambiguous position
    want = full[P:]
    got = []
    if want:
        s = Session(model, Options(draft=0, temperature=0, ignore_eos=True),
                    context=positions_needed(P, len(want), 0), configure=False)
        got = s.generate(prompt, max_tokens=len(want)).token_ids
    # greedy tokens compared: all, or up to the ambiguous position's, which may be either reading
    n_greedy = len(want) if amb is None else amb + 2 - P
    greedy_ok = [a == b for a, b in zip(got[:n_greedy], want[:n_greedy])]
    if amb is not None and len(got) >= n_greedy:
        greedy_ok[-1] = got[n_greedy - 1] in (want[n_greedy - 1], ref["tf_pred"][amb])
    res = {
        "tf_match": int(tf_ok.sum()), "tf_total": T,
        "greedy_match": int(sum(greedy_ok)),
        "greedy_total": n_greedy, "greedy_ids": got,
        "ambiguous_at": amb,
    }
    logit_ok = True
    if ref.get("logits") is not None:
        ref_logits = np.asarray(ref["logits"], dtype=np.float32)
        if ref_logits.shape != logits.shape:
            raise ValueError(f"reference logits have shape {list(ref_logits.shape)}, the engine gives "
                             f"{list(logits.shape)}")
        tol = (LOGIT_RTOL * max(1.0, float(np.max(np.abs(ref_logits)))) if max_logit_diff is None
               else float(max_logit_diff))
        res["max_abs_logit_diff"] = float(np.max(np.abs(ref_logits - logits)))
        res["logit_tolerance"] = tol
        logit_ok = res["max_abs_logit_diff"] <= tol
    res["pass"] = bool(res["tf_match"] == T and res["greedy_match"] == n_greedy and logit_ok)
    return res


def report(res) -> str:
    """The verdict in words."""
    lines = [f"teacher forcing: {res['tf_match']}/{res['tf_total']} positions"]
    greedy = f"greedy:          {res['greedy_match']}/{res['greedy_total']} tokens"
    if res["ambiguous_at"] is not None:
        greedy += (f" (the reference is ambiguous at position {res['ambiguous_at']}: its teacher forcing and its "
                   "greedy continuation disagree there, so greedy is compared up to it)")
    lines.append(greedy)
    if "max_abs_logit_diff" in res:
        lines.append(f"max |Δlogit|:    {res['max_abs_logit_diff']:.3g} (tolerance {res['logit_tolerance']:.3g})")
    lines.append("PARITY OK" if res["pass"] else "PARITY FAILED")
    return "\n".join(lines)


def run(args) -> int:
    from ._core import model_init
    from .options import from_args
    opts = from_args(args)
    if args.max_logit_diff is not None and not (math.isfinite(args.max_logit_diff) and args.max_logit_diff >= 0):
        raise ValueError(f"--max-logit-diff must be a number >= 0, got {args.max_logit_diff}")
    ref = load_ref(args.ref)
    model = model_init(args.model, **opts.engine_kwargs())
    try:
        res = check(model, ref, args.max_logit_diff)
    finally:
        model.close()
    if args.json:
        print(json.dumps({k: v for k, v in res.items() if k != "greedy_ids"}))
    else:
        print(report(res))
    return 0 if res["pass"] else 1
