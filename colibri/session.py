"""The generation driver: one :class:`Session` (a model, its expert tiers, its KV cache and the
token history those rows hold) and its :meth:`Session.generate`, which every front end uses —
``run``, :class:`colibri.LLM` (so ``chat`` and ``serve``), ``parity`` and the tests.

A generation is: the context-room rule; the prefill of what the prompt does not share with the
history (prefix reuse); speculative decoding (``spec_decode``: drafts, one batched verify, the
draft policy that learns across a session's generations); incremental detokenisation with stop
strings; why it ended (``finish_reason``); and what it cost (``stats``).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from .options import GENERATION_FIELDS, Options

#: KV positions a session keeps when neither the options nor the caller give a context.
DEFAULT_CONTEXT = 4096


def draft_room(draft) -> int:
    """Positions past the last emitted token that a generation may write: the deepest verify
    batch (its drafts) and the row of the token being verified, plus one."""
    from .draft import MAX_AUTO_DEPTH
    return (draft if isinstance(draft, int) else MAX_AUTO_DEPTH) + 2


def positions_needed(n_prompt: int, max_tokens: int, draft) -> int:
    """KV positions a generation of max_tokens after an n_prompt-token prompt needs."""
    return n_prompt + max_tokens + draft_room(draft)


def check_room(n_prompt: int, max_tokens: int, draft, context: int, tokens_name="max_tokens") -> None:
    """The context-room rule: a ValueError that shows every term when the generation cannot fit."""
    need = positions_needed(n_prompt, max_tokens, draft)
    if need > context:
        raise ValueError(f"prompt ({n_prompt} tokens) + {tokens_name} ({max_tokens}) + {draft_room(draft)} positions "
                         f"for drafts = {need} positions exceed the context of {context}: shorten the prompt or "
                         f"lower {tokens_name}")


def new_seed() -> int:
    """A seed for a generation that was given none (reported, so the text can be made again)."""
    return int.from_bytes(os.urandom(4), "little")


class _Stop(Exception):
    """Raised inside the engine's emit callback to end a generation early."""


class TextTail:
    """Incremental detokenisation with stop strings: ``push(token)`` returns the new text that is
    safe to show (never half a UTF-8 character, never the start of a possible stop string) and
    raises _Stop once a stop string is complete; ``text`` is the final text (stop string cut).
    Without a tokenizer the text is the ids, space-separated."""

    def __init__(self, tok, stops: Sequence[str]):
        self.tok, self.stops, self.ids = tok, [s for s in stops if s], []
        self.text, self.shown = "", 0
        self.matched: Optional[str] = None     # the stop string that ended the text

    def push(self, t: int) -> str:
        self.ids.append(t)
        if self.tok is None:
            self.text += f"{t} "
        else:
            # special tokens literally, as glm.c decodes added tokens: GLM writes <think> and its
            # tool-call tags as such tokens, and the reply parsers (colibri.tools) read them
            text = self.tok.decode(self.ids, skip_special_tokens=False)
            if text.endswith("\ufffd"):
                return ""                   # an incomplete UTF-8 sequence: wait for the next token
            self.text = text
        for s in self.stops:
            i = self.text.find(s, max(self.shown - len(s), 0))
            if i >= 0:
                self.text, self.matched = self.text[:i], s
                raise _Stop
        safe = len(self.text)
        for s in self.stops:                # hold back a suffix that may grow into a stop string
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        piece = self.text[self.shown:safe] if safe > self.shown else ""
        self.shown = max(self.shown, safe)
        return piece

    def rest(self) -> str:
        piece = self.text[self.shown:]
        self.shown = len(self.text)
        return piece


@dataclass
class Generation:
    """One generation: its tokens and text, why it ended, and what it cost.

    finish_reason: 'stop' (an end-of-sequence token, a stop string, or cancelled) or 'length'
    (max_tokens reached), as OpenAI's API says it; stopped_by: 'eos', 'stop', 'cancel' or 'length'."""
    token_ids: List[int]
    text: str
    prompt_tokens: int
    prefill_tokens: int                # prompt tokens forwarded (the rest came from the KV cache)
    finish_reason: str
    stopped_by: str
    seed: int
    stats: dict = field(default_factory=dict)
    stop_string: Optional[str] = None  # the stop string that ended it (stopped_by 'stop')

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class Session:
    """A model with its tiers, KV cache and token history; one generation at a time (a lock).

    context: KV positions (default: options.context, else the model's, at most DEFAULT_CONTEXT).
    configure: size the expert tiers for the options (``tiers.configure``); False keeps the model's
    cache as model_init left it (tests that set it up themselves)."""

    def __init__(self, model, options: Optional[Options] = None, context: Optional[int] = None,
                 tokenizer=None, configure: bool = True):
        from . import tiers as _tiers
        self.model, self.cfg = model, model.cfg
        self.options = options if options is not None else Options()
        self.tokenizer = tokenizer
        limit = self.cfg.max_positions or DEFAULT_CONTEXT
        self.context = min(context or self.options.context or min(limit, DEFAULT_CONTEXT), limit)
        self.tiers = (_tiers.configure(model, self.context, **self.options.tier_kwargs()) if configure else None)
        self.batch = self.tiers.batch if self.tiers is not None else self.options.batch
        model.kv_alloc(self.context)
        self.eos = set(self.cfg.eos_ids)
        self.history: List[int] = []       # tokens whose KV rows are valid, from position 0
        self.policy = None                 # the last generation's draft policy (learns on: --draft auto)
        self._lltok = None                 # llguidance's index of the tokenizer (built on first use)
        self.lock = threading.Lock()

    # -- state ------------------------------------------------------------------------------------

    def forget(self) -> None:
        """The KV rows no longer count (a new conversation): the next prompt prefills whole."""
        self.history = []

    def adopt(self, history: Sequence[int]) -> None:
        """The KV rows hold ``history`` (restored from a file by colibri.kvstore)."""
        self.history = [int(t) for t in history]

    def constraint(self, o: Options):
        """The grammar constraint (colibri.grammar.Constraint) of a generation's options, None
        without json_schema / grammar."""
        from .grammar import Constraint, constraint_tokenizer, grammar_text
        g = grammar_text(o.json_schema, o.grammar)
        if g is None:
            return None
        if self._lltok is None:
            self._lltok = constraint_tokenizer(self.tokenizer, self.cfg.vocab, sorted(self.eos))
        from .options import switch
        return Constraint(self._lltok, g, self.cfg.vocab, forcing=switch("FORCED_DRAFTS") != "0")

    def check_ids(self, ids) -> List[int]:
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab})")
        return ids

    # -- the driver -------------------------------------------------------------------------------

    def generate(self, prompt_ids, *, stop: Sequence[str] = (), on_text: Optional[Callable[[str], None]] = None,
                 cancel: Optional[threading.Event] = None, progress=None, **settings) -> Generation:
        """Generate a continuation of ``prompt_ids``. ``settings``: generation options for this call
        (max_tokens, temperature, top_p, top_k, repeat_penalty, repeat_last_n, frequency_penalty,
        presence_penalty, seed, draft, ignore_eos, json_schema, grammar; None or absent: the session's). ``stop``: strings
        that end the generation (not in the text); ``on_text(piece)`` receives the text as it comes;
        ``cancel`` (an Event) ends it early; ``progress(done, total)`` is the prefill's progress
        callback."""
        from ._core import Sampler
        from .draft import DraftPolicy
        other = sorted(set(settings) - set(GENERATION_FIELDS))
        if other:
            raise TypeError(f"generate() got an unexpected setting {other[0]!r}")
        o = self.options.replace(**{k: v for k, v in settings.items() if v is not None})
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        ids = self.check_ids(prompt_ids)
        check_room(len(ids), o.max_tokens, o.draft, self.context)
        seed = o.seed if o.seed is not None else new_seed()
        con = self.constraint(o)
        tail = TextTail(self.tokenizer, stops)
        first = []                               # when the first text reached on_text

        def emit(t):
            if cancel is not None and cancel.is_set():
                raise _Stop
            piece = tail.push(t)
            if piece and on_text is not None:
                on_text(piece)
            if (piece or self.tokenizer is None) and not first:
                first.append(time.perf_counter())

        with self.lock:
            m = self.model
            t0 = time.perf_counter()
            common = _common_prefix(self.history, ids, len(ids) - 1)
            self.history = []                    # invalid until this generation's KV is consistent
            m.reset_stats()
            # With a forced depth the MTP head learns the prompt's (token, hidden) pairs during the
            # prefill, as colibrì does; under --draft auto they are absorbed lazily, in one batch
            # before the first draft, so a head the policy finds useless costs the prefill nothing.
            absorb = m.has_mtp and isinstance(o.draft, int) and o.draft > 0
            logits = m.prefill(ids[common:], common, batch=self.batch, progress=progress, absorb_mtp=absorb)
            t_prefill = time.perf_counter() - t0
            prefill_read, prefill_misses = int(m.bytes_read), int(m.expert_misses)
            history = list(ids)
            policy = DraftPolicy(o.draft, prior=self.policy)
            stopped_by = "length"
            t1 = time.perf_counter()
            try:
                out, kv = m.spec_decode(history, len(ids), o.max_tokens, logits,
                                        Sampler(self.cfg.vocab, seed=seed, **o.sampler_kwargs()), policy,
                                        stops=() if o.ignore_eos else self.eos, emit=emit, constraint=con)
                self.history = history[:kv]
                if len(out) < o.max_tokens:
                    stopped_by = "eos"
            except _Stop:
                out = list(tail.ids)
                self.history = list(ids)         # the prompt's KV rows are intact; later ones may not be
                stopped_by = "cancel" if cancel is not None and cancel.is_set() else "stop"
            t_decode = time.perf_counter() - t1
            self.policy = policy
            m.cache.wait_prefetch()
            last = tail.rest()
            if last and on_text is not None:
                on_text(last)
            n = len(out)
            stats = {
                "prefill_tokens": len(ids) - common, "prefill_s": t_prefill, "prefill_batch": int(self.batch),
                "prefill_bytes_read": prefill_read,          # expert bytes read from disk by the prefill
                "prefill_expert_misses": prefill_misses,
                "ttft_s": (first[0] - t0) if first else time.perf_counter() - t0,
                "decode_tokens": n, "decode_s": t_decode, "decode_tok_s": n / t_decode if t_decode > 0 else 0.0,
                "forwards": int(m.forwards), "decode_forwards": int(m.decode_forwards),
                "tokens_per_forward": n / m.decode_forwards if m.decode_forwards else float(n),
                "expert_hits": int(m.expert_hits), "expert_misses": int(m.expert_misses),
                "bytes_read": int(m.bytes_read), "hit_rate": m.cache.stats["hit_rate"],
                "mtp_hit_rate": m.cache.row_hit_rate(self.cfg.n_layers) if m.has_mtp else None,
                "seed": seed, "finish_reason": "length" if stopped_by == "length" else "stop",
                "stopped_by": stopped_by,
                "constrained": con is not None, "forced_tokens": con.forced_tokens if con is not None else 0,
                **policy.stats(), **m.lookahead.stats(),
            }
        return Generation(token_ids=list(out), text=tail.text, prompt_tokens=len(ids), prefill_tokens=len(ids) - common,
                          finish_reason=stats["finish_reason"], stopped_by=stopped_by, seed=seed, stats=stats,
                          stop_string=tail.matched if stopped_by == "stop" else None)


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), max(limit, 0))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
