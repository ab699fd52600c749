"""Grammar-constrained decoding: which tokens a generation may emit, decided by llguidance.

A constraint comes as a JSON schema (the ``json_schema`` option, ``--json-schema``, OpenAI's
``response_format``, a tool's parameters) or as a grammar (``grammar``, ``--grammar``: Lark, the
syntax of llguidance, or llama.cpp's GBNF). llguidance (a Rust core without torch, the matcher
llama.cpp and vLLM use) compiles it into a matcher over the model's own tokenizer, which gives,
after every emitted token, the set of tokens that keep the output a prefix of something the
grammar accepts.

The engine (``Model.spec_decode``) asks a :class:`Constraint` three things:

- ``allowed()``: the bitmask of the tokens the grammar allows next; the engine sets the others'
  logits to -inf (``_core.mask_logits``). Sampling and draft verification both see the masked logits, so the output follows the constrained distribution
  (softmax over the allowed tokens, with the usual temperature / top-k / top-p), exactly as plain
  constrained sampling would draw it, whatever the drafts;
- ``valid_prefix(drafts)``: how many of the MTP head's drafts the grammar allows, so a verify
  forward never spends a row on a draft the mask would refuse;
- ``forced(n)``: the tokens the grammar allows alone at each next position (JSON punctuation,
  a property name of the schema, a closing tag): those go into the verify forward as drafts
  without drafting, and are accepted by construction (a masked distribution with one token left).

A matcher only ever consumes emitted tokens (drafts are checked with ``validate_tokens``, which
does not advance it, and ``forced`` rolls back what it tried), so a rejected draft needs no undo.
Grammars are checked once, where the option is set (:func:`check_json_schema`, :func:`check_grammar`),
before a model is loaded.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence, Union

__all__ = ["GrammarError", "grammar_text", "check_json_schema", "check_grammar", "Constraint",
           "constraint_tokenizer"]


class GrammarError(ValueError):
    """A JSON schema or grammar that cannot be compiled (the message says where)."""


def _llg():
    try:
        import llguidance
    except ImportError as e:          # a dependency of the package; an install without it is broken
        raise GrammarError(f"grammar-constrained decoding needs the llguidance package ({e}): "
                           "pip install llguidance") from None
    return llguidance


def _read(value: str, what: str) -> str:
    """value itself, or the text of the file it names (an existing path)."""
    if len(value) < 4096 and "\n" not in value and os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise GrammarError(f"{what}: cannot read {value}: {e}") from None
    return value


def schema_of(value: Union[str, dict, bool]) -> Union[dict, bool]:
    """A JSON schema from a dict, a JSON text or the path of a JSON file."""
    if isinstance(value, (dict, bool)):
        return value
    if not isinstance(value, str):
        raise GrammarError(f"a JSON schema must be an object, a JSON text or a file, got {type(value).__name__}")
    text = _read(value, "json_schema")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        src = value if text is not value else "the schema"
        raise GrammarError(f"{src} is not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
    return schema


def grammar_text(json_schema=None, grammar: Optional[str] = None) -> Optional[str]:
    """The llguidance grammar of a JSON schema (dict, JSON text or file) or of a Lark / GBNF grammar
    (text or file); None when neither is given. Raises GrammarError when it does not compile."""
    if json_schema is not None and grammar is not None:
        raise GrammarError("give a JSON schema or a grammar, not both")
    if json_schema is not None:
        key = ("json_schema", json.dumps(schema_of(json_schema), sort_keys=True))
    elif grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError("a grammar must be a non-empty text (Lark or GBNF) or a file")
        key = ("grammar", _read(grammar, "grammar"))
    else:
        return None
    if key not in _compiled:
        if len(_compiled) >= 64:
            _compiled.clear()
        _compiled[key] = _compile(*key)
    return _compiled[key]


_compiled: dict = {}          # (kind, text) -> llguidance grammar: options are checked at every replace()


def _compile(kind: str, text: str) -> str:
    llg = _llg()
    if kind == "json_schema":
        what = "the JSON schema"
        try:
            # compact JSON (no optional whitespace): more of it is forced, fewer tokens to generate
            g = llg.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{what} does not compile: {e}") from None
    else:
        what = "the grammar"
        try:
            g = llg.grammar_from("grammar", text)
        except ValueError as e:
            raise GrammarError(str(e)) from None
    problem = llg.LLMatcher.validate_grammar(g)
    if problem:
        raise GrammarError(f"{what} does not compile: {problem.strip()}")
    return g


def check_json_schema(value) -> Optional[str]:
    """Options' check of ``json_schema``: None (fine) or what is wrong."""
    if value is None:
        return None
    try:
        grammar_text(json_schema=value)
    except GrammarError as e:
        return f"is not a usable JSON schema: {e}"
    return None


def check_grammar(value) -> Optional[str]:
    """Options' check of ``grammar``: None (fine) or what is wrong."""
    if value is None:
        return None
    try:
        grammar_text(grammar=value)
    except GrammarError as e:
        return f"is not a usable grammar: {e}"
    return None


def constraint_tokenizer(tokenizer, vocab: int, eos_ids: Sequence[int]):
    """llguidance's view of a ``tokenizers.Tokenizer`` over ``vocab`` logits (a model's vocabulary
    may be padded past the tokenizer's), its end-of-sequence tokens ``eos_ids`` (what the grammar
    allows once its output is complete). Build it once per model: it indexes every token."""
    if tokenizer is None:
        raise GrammarError("grammar-constrained decoding needs the model's tokenizer.json")
    eos = [int(t) for t in eos_ids] or None
    return _llg().LLTokenizer(tokenizer.to_str(), n_vocab=int(vocab), eos_token=eos)


class Constraint:
    """One generation's matcher: what the grammar allows after the tokens emitted so far.

    ``forced_tokens``: how many emitted tokens came from :meth:`forced` (the engine counts them)."""

    def __init__(self, lltok, grammar: str, vocab: int, forcing: bool = True):
        import numpy as np
        llg = _llg()
        self.m = llg.LLMatcher(lltok, grammar, log_level=0)
        if self.m.is_error():
            raise GrammarError(f"the grammar does not compile for this tokenizer: {self.m.get_error()}")
        self.vocab = int(vocab)
        self.bits = np.zeros((self.vocab + 31) // 32, np.int32)    # [ceil(V/32)] allowed-token bitmask
        self.out = np.zeros(self.vocab, np.float32)                 # [V] masked logits (the engine's)
        self.eos = set(lltok.eos_tokens)
        self.forced_tokens = 0
        self.forcing = forcing                                      # False: forced() offers nothing

    def _fill(self):
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        if self.m.is_error():
            raise GrammarError(f"grammar matcher: {self.m.get_error()}")

    def allowed(self):
        """[ceil(V/32)] int32: bit i set when the grammar allows token i next (a buffer of this
        constraint, valid until the next call)."""
        self._fill()
        return self.bits

    def consume(self, token: int) -> None:
        if not self.m.consume_token(int(token)):
            raise GrammarError(f"token {token} is not allowed by the grammar here: {self.m.get_error()}")

    @property
    def stopped(self) -> bool:
        """The output is complete: the grammar allows nothing more (not even end-of-sequence text)."""
        return self.m.is_stopped()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order from the current state, the grammar allows."""
        return int(self.m.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def forced(self, limit: int) -> List[int]:
        """Up to ``limit`` tokens that the grammar allows alone, one position after the other from
        the current state (stops before an end-of-sequence token); the matcher is left as it was."""
        import numpy as np
        out: List[int] = []
        if not self.forcing:
            return out
        try:
            while len(out) < limit and not self.m.is_stopped():
                self._fill()
                words = np.flatnonzero(self.bits)
                if len(words) != 1:
                    break
                w = int(self.bits[words[0]]) & 0xFFFFFFFF
                if w & (w - 1):                      # more than one bit in the word
                    break
                t = int(words[0]) * 32 + w.bit_length() - 1
                if t in self.eos or t >= self.vocab or not self.m.consume_token(t):
                    break
                out.append(t)
        finally:
            if out:
                self.m.rollback(len(out))
        return out
