"""The Python API: ``colibri.load(path=None, **options)`` returns an :class:`LLM`.

    import colibri
    llm = colibri.load()                                  # the embedded default model
    print(llm.generate("def fibonacci(n):", max_tokens=64, temperature=0))
    for piece in llm.stream("class Stack:", max_tokens=64):
        print(piece, end="", flush=True)
    llm.chat([{"role": "user", "content": "Write a function that adds two numbers."}])

One model per process, one generation at a time (a lock serialises callers). The KV cache of the
previous request is kept: a prompt that starts with the same tokens (the next turn of a
conversation, a fixed system prompt) prefills only what is new.
"""
from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass, field, fields
from typing import Iterator, List, Optional, Sequence, Union

__all__ = ["Options", "LLM", "Completion", "load"]


@dataclass
class Options:
    """Engine and generation settings of an :class:`LLM`; every field has the CLI's default.

    Engine: ``cache_experts`` experts per layer in the LRU (0 = as many as ``ram_gb`` allows);
    ``ram_gb`` RAM budget (None = 0.88 x available); ``threads`` OpenMP threads (0 = all cores);
    ``io_threads`` concurrent expert reads; ``prefetch`` router-lookahead prefetch; ``direct``
    O_DIRECT expert reads; ``autopin`` pin hot experts from the saved routing history; ``pin`` /
    ``pin_gb`` explicit pins from a stats file; ``warm_experts`` read every expert at load when all
    fit in the budget; ``idot`` matmul numerics (see the README);
    ``context`` KV positions (0 = the model's context, at most 4096); ``batch`` prompt tokens per
    prefill forward (0 = the whole prompt, in pieces only where the budget is small; the same result).
    Generation defaults: ``max_tokens``, ``temperature`` (0 = greedy), ``top_p``, ``draft``
    ('auto' or a depth 0..16)."""
    cache_experts: int = 0
    ram_gb: Optional[float] = None
    threads: int = 0
    io_threads: int = 4
    prefetch: bool = True
    direct: bool = False
    autopin: bool = True
    pin: Optional[str] = None
    pin_gb: Optional[float] = None
    warm_experts: bool = True
    idot: int = 2
    context: int = 0
    batch: int = 0
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.9
    draft: Union[str, int] = "auto"

    @classmethod
    def from_env(cls, env=None, **overrides) -> "Options":
        """Options from ``COLI_<FIELD>`` environment variables (e.g. ``COLI_CACHE_EXPERTS=8``,
        ``COLI_RAM_GB=16``, ``COLI_PREFETCH=0``), then ``overrides``."""
        env = os.environ if env is None else env
        kw = {}
        for f in fields(cls):
            raw = env.get("COLI_" + f.name.upper())
            if raw is None:
                continue
            kw[f.name] = _parse_env(f, raw)
        kw.update(overrides)
        return cls(**kw)

    def __post_init__(self):
        from .draft import parse_draft
        if self.cache_experts < 0:
            raise ValueError(f"cache_experts must be >= 0, got {self.cache_experts}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads}")
        if self.context < 0:
            raise ValueError(f"context must be >= 0, got {self.context}")
        if self.batch < 0:
            raise ValueError(f"batch must be >= 0 (0 = the default), got {self.batch}")
        _check_sampling(self.max_tokens, self.temperature, self.top_p)
        self.draft = parse_draft(self.draft)


def _parse_env(f, raw: str):
    name = "COLI_" + f.name.upper()
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if "bool" in kind:
            if raw.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if raw.strip().lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if "Optional[float]" in kind or kind == "float":
            return float(raw)
        if kind == "int":
            return int(raw)
        if "Union" in kind:            # draft
            return raw.strip()
        return raw
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind}") from None


def _check_sampling(max_tokens, temperature, top_p):
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


@dataclass
class Completion:
    """One generation: the text, its token ids, usage and why it ended ('stop' or 'length')."""
    text: str
    token_ids: List[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    prefill_tokens: int = 0             # prompt tokens actually forwarded (the rest came from the KV cache)
    stats: dict = field(default_factory=dict)


class _Stop(Exception):
    """Raised inside the engine's emit callback to end a generation early."""


class _TextTail:
    """Incremental detokenisation with stop strings: ``push(token)`` returns the new text that is
    safe to show (never half a UTF-8 character, never the start of a possible stop string) and
    raises _Stop once a stop string is complete; ``text`` is the final text (stop string cut)."""

    def __init__(self, tok, stops: Sequence[str]):
        self.tok, self.stops, self.ids = tok, [s for s in stops if s], []
        self.text, self.shown = "", 0

    def push(self, t: int) -> str:
        self.ids.append(t)
        if self.tok is None:
            self.text += f"{t} "
        else:
            text = self.tok.decode(self.ids)
            if text.endswith("\ufffd"):
                return ""                   # an incomplete UTF-8 sequence: wait for the next token
            self.text = text
        for s in self.stops:
            i = self.text.find(s, max(self.shown - len(s), 0))
            if i >= 0:
                self.text = self.text[:i]
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


class LLM:
    """A loaded model with its tokenizer, KV cache and expert tiers. Build it with :func:`load`."""

    def __init__(self, path: Optional[str] = None, options: Optional[Options] = None):
        from . import tiers as _tiers
        from ._core import model_init
        from .tokenizer import load_chat_template, load_tokenizer
        if path is None:
            from .models import default_model_dir
            path = default_model_dir()
        self.path = os.fspath(path)
        self.options = options or Options()
        o = self.options
        # the text files first: a damaged tokenizer or template fails before the weights are mapped
        self.tokenizer = load_tokenizer(self.path)
        self.chat_template = load_chat_template(self.path)
        self.model = model_init(self.path, cache_experts=o.cache_experts, idot=o.idot, threads=o.threads,
                                io_threads=o.io_threads, prefetch=o.prefetch, direct=o.direct)
        self.cfg = self.model.cfg
        limit = self.cfg.max_positions or 4096
        self.context = min(o.context or min(limit, 4096), limit)
        self.tiers = _tiers.configure(self.model, self.context, requested=o.cache_experts, ram_gb=o.ram_gb,
                                      pin=o.pin, pin_gb=o.pin_gb, autopin=o.autopin, prefetch=o.prefetch,
                                      warm=o.warm_experts, mtp_tier=o.draft != 0, batch=o.batch)
        self.model.kv_alloc(self.context)
        self.eos = set(self.cfg.eos_ids)
        self.history: List[int] = []       # tokens whose KV rows are valid, from position 0
        self._draft_prior = None           # the last generation's draft policy (--draft auto)
        self.lock = threading.Lock()

    # -- text -------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """Token ids of ``text``. ``add_special_tokens=False`` for text in a chat format, which
        holds every special token itself (as transformers' apply_chat_template tokenizes)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.path} has no tokenizer.json: pass token ids instead of text")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(list(ids))

    def _ids(self, prompt) -> List[int]:
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.cfg.vocab]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab})")
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        return ids

    # -- generation -------------------------------------------------------------------------------

    def complete(self, prompt, max_tokens=None, temperature=None, top_p=None, seed=None, stop=None,
                 draft=None, on_text=None, cancel: Optional[threading.Event] = None) -> Completion:
        """Generate a continuation of ``prompt`` (text or token ids). ``stop``: strings that end the
        generation (not included in the text); ``on_text(piece)`` receives the text as it comes;
        ``cancel`` (an Event) ends it early. Returns a :class:`Completion`."""
        import time

        from ._core import Sampler
        from .draft import MAX_AUTO_DEPTH, DraftPolicy, parse_draft
        o = self.options
        max_tokens = o.max_tokens if max_tokens is None else max_tokens
        temperature = o.temperature if temperature is None else temperature
        top_p = o.top_p if top_p is None else top_p
        _check_sampling(max_tokens, temperature, top_p)
        draft = parse_draft(o.draft if draft is None else draft)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        ids = self._ids(prompt)
        depth = draft if isinstance(draft, int) else MAX_AUTO_DEPTH
        if len(ids) + max_tokens + depth + 2 > self.context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                             f"{self.context} positions")
        tail = _TextTail(self.tokenizer, stops)

        first = []                               # when the first text reached on_text

        def emit(t):
            if cancel is not None and cancel.is_set():
                raise _Stop
            piece = tail.push(t)
            if piece and on_text is not None:
                on_text(piece)
            if piece and not first:
                first.append(time.perf_counter())

        with self.lock:
            m = self.model
            t0 = time.perf_counter()
            common = _common_prefix(self.history, ids, len(ids) - 1)
            self.history = []                    # invalid until this request's KV is consistent
            m.reset_stats()
            m.mtp_absorb_prefill = m.has_mtp and isinstance(draft, int) and draft > 0
            logits = m.prefill(ids[common:], common, batch=self.tiers.batch)
            t_prefill = time.perf_counter() - t0
            history = list(ids)
            finish = "length"
            policy = DraftPolicy(draft, prior=self._draft_prior)     # a session's requests learn on
            try:
                out, kv = m.spec_decode(history, len(ids), max_tokens, logits,
                                        Sampler(self.cfg.vocab, temperature, top_p, seed), policy,
                                        stops=self.eos, emit=emit)
                self.history = history[:kv]
                self._draft_prior = policy
                if len(out) < max_tokens:
                    finish = "stop"
            except _Stop:
                out = tail.ids
                self.history = list(ids)         # the prompt's KV rows are intact; later ones may not be
                finish = "stop"
            m.cache.wait_prefetch()
            last = tail.rest()
            if last and on_text is not None:
                on_text(last)
            t_total = time.perf_counter() - t0
            stats = {"prefill_s": t_prefill, "ttft_s": (first[0] - t0) if first else t_total,
                     "decode_s": t_total - t_prefill,
                     "decode_tok_s": len(out) / max(t_total - t_prefill, 1e-9),
                     "tokens_per_forward": len(out) / max(m.decode_forwards, 1),
                     "hit_rate": m.cache.stats["hit_rate"], "bytes_read": m.bytes_read,
                     "mtp_hit_rate": m.cache.row_hit_rate(self.cfg.n_layers) if m.has_mtp else None,
                     "decode_forwards": m.decode_forwards, **policy.stats()}
        return Completion(text=tail.text, token_ids=list(out), prompt_tokens=len(ids),
                          completion_tokens=len(out), finish_reason=finish, prefill_tokens=len(ids) - common,
                          stats=stats)

    def generate(self, prompt, **kw) -> str:
        """The generated text (see :meth:`complete` for the arguments)."""
        return self.complete(prompt, **kw).text

    def stream(self, prompt, **kw) -> Iterator[str]:
        """Yield the text as it is generated: whole UTF-8 characters, stop strings held back.
        Closing the iterator early stops the generation."""
        pieces: "queue.Queue" = queue.Queue()
        cancel = threading.Event()
        done = object()

        def work():
            try:
                pieces.put(self.complete(prompt, on_text=pieces.put, cancel=cancel, **kw))
            except BaseException as e:          # re-raised in the consumer
                pieces.put(e)
            pieces.put(done)

        th = threading.Thread(target=work, name="colibri-generate", daemon=True)
        th.start()
        try:
            while True:
                item = pieces.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Completion):
                    self.last = item
                    continue
                yield item
        finally:
            cancel.set()
            th.join()

    # Chat format. The model's own template (colibri.tokenizer: chat_template.jinja, or chat_template
    # in tokenizer_config.json) when it has one. Without one: GLM tokenizers (special tokens [gMASK],
    # <sop>, <|user|>, <|assistant|>) get GLM-5's format, as colibrì's gateway renders it:
    # [gMASK]<sop>, then <|system|>text, <|user|>text, <|assistant|><think></think>text, and
    # <|assistant|><think></think> to start the answer (no thinking); other tokenizers get a plain
    # "<|role|>\ntext\n" format. chat_format_note() says which, for front ends to show.

    @property
    def chat_template_source(self) -> Optional[str]:
        """The file of the model's chat template (chat_template.jinja or tokenizer_config.json), or
        None when the model has none and render_chat uses a fallback format."""
        return None if self.chat_template is None else self.chat_template.source

    def chat_format_note(self) -> Optional[str]:
        """None when the model has its own chat template; else one line saying which fallback
        format render_chat uses (chat and serve print it at start-up)."""
        if self.chat_template is not None:
            return None
        from .tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE
        return (f"{self.path} has no chat template ({CHAT_TEMPLATE_FILE}, or chat_template in "
                f"{TOKENIZER_CONFIG_FILE}); using {self.fallback_chat_format()}")

    def model_notes(self) -> List[str]:
        """What front ends tell the user at start-up: the fallback chat format of a model without
        a template, and dense attention past index_topk for a container without the DSA indexer."""
        return [n for n in (self.chat_format_note(), self.model.dsa_note()) if n]

    def fallback_chat_format(self) -> str:
        """The format used without a template, in words."""
        return ("GLM-5's chat format ([gMASK]<sop><|role|>text...)" if self.is_glm_chat()
                else "a plain chat format (<|role|>\\ntext\\n)")

    def is_glm_chat(self) -> bool:
        tok = self.tokenizer
        return tok is not None and all(tok.token_to_id(t) is not None
                                       for t in ("[gMASK]", "<sop>", "<|user|>", "<|assistant|>"))

    def chat_prefix(self) -> str:
        return "[gMASK]<sop>" if self.is_glm_chat() else ""

    def chat_message(self, role: str, content: str) -> str:
        if self.is_glm_chat():
            return ("<|assistant|><think></think>" + content.strip()) if role == "assistant" else f"<|{role}|>{content}"
        return f"<|{role}|>\n{content}\n"

    def chat_reply_start(self) -> str:
        return "<|assistant|><think></think>" if self.is_glm_chat() else "<|assistant|>\n"

    def render_chat(self, messages) -> str:
        """The prompt text of a conversation ([{role, content}, ...]) in the model's chat format,
        the assistant's turn opened."""
        msgs = _check_messages(messages)
        if self.chat_template is not None:
            return self.chat_template.render(msgs, add_generation_prompt=True)
        return (self.chat_prefix() + "".join(self.chat_message(m["role"], m["content"]) for m in msgs)
                + self.chat_reply_start())

    def chat_ids(self, messages) -> List[int]:
        """The prompt token ids of a conversation: render_chat, tokenized without the tokenizer's
        own special tokens (the chat format holds them)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def chat(self, messages, **kw) -> str:
        """The assistant's answer to a conversation; the turn ends at the next role tag."""
        kw.setdefault("stop", ["<|user|>", "<|system|>"])
        return self.complete(self.chat_ids(messages), **kw).text

    def close(self):
        self.model.close()


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), max(limit, 0))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _check_messages(messages) -> list:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"messages[{i}].role must be system, user or assistant, got {m['role']!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def load(path: Optional[str] = None, options: Optional[Options] = None, **kw) -> LLM:
    """Load a model folder (default: the embedded model, or ``COLI_MODEL``) with ``Options``
    (from ``COLI_*`` environment variables, then ``options``/keyword overrides)."""
    if path is None:
        path = os.environ.get("COLI_MODEL") or None
    if options is None:
        options = Options.from_env(**kw)
    elif kw:
        options = Options(**{**{f.name: getattr(options, f.name) for f in fields(Options)}, **kw})
    return LLM(path, options)
