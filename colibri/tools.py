"""GLM's tool calls: the request's tools checked, the calls written into a prompt, parsed out of the
model's text (whole or as it streams), and the grammar that forces a call.

GLM writes a tool call as text in its own format (its chat template renders past calls the same
way), optionally after a reasoning block::

    <think>reasoning</think>text<tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    ...
    </tool_call>

A string argument's value is written raw, any other value as JSON. A tool's result comes back in
the next turn as an ``observation`` message. Front ends (``serve``'s OpenAI and Anthropic
endpoints) keep their own request shapes; this module holds what they share: :class:`Tool`,
:func:`check_tools`, :func:`parse_reply`, :class:`ReplyStream` and :func:`call_grammar`.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

__all__ = ["Tool", "ToolCall", "ToolError", "check_tools", "check_schema", "render_tools", "render_call",
           "parse_reply", "ReplyStream", "call_grammar", "new_call_id"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")        # OpenAI's rule for a function name


class ToolError(ValueError):
    """A malformed tool definition or tool choice: ``param`` names the field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_openai(self) -> dict:
        """The shape chat templates iterate over (transformers passes OpenAI's tool dicts)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def string_keys(self) -> set:
        """Arguments whose schema is a plain string: their values are written (and read) raw."""
        props = self.parameters.get("properties") or {}
        return {k for k, s in props.items() if isinstance(s, dict) and s.get("type") == "string"}


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = ""


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def check_schema(schema, param: str) -> dict:
    """A tool's parameters: a JSON schema object (compiled once, so a bad one fails here)."""
    from .grammar import GrammarError, grammar_text
    if schema is None:
        return {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise ToolError(f"{param} must be a JSON schema object", param)
    if schema.get("type", "object") != "object":
        raise ToolError(f"{param} must describe an object (type 'object'), got type {schema.get('type')!r}", param)
    try:
        grammar_text(json_schema=schema)
    except GrammarError as e:
        raise ToolError(f"{param} is not a usable JSON schema: {e}", param) from None
    return schema


def check_tools(tools: Sequence[Tool]) -> List[Tool]:
    """Distinct valid names (the front end has built the Tool objects from its own shapes)."""
    seen = set()
    for i, t in enumerate(tools):
        if not _NAME.match(t.name):
            raise ToolError(f"tools[{i}]: the name {t.name!r} must be 1-64 letters, digits, '_', '.' or '-'",
                            f"tools[{i}].name")
        if t.name in seen:
            raise ToolError(f"tools[{i}]: two tools are named {t.name!r}", f"tools[{i}].name")
        seen.add(t.name)
    return list(tools)


# -- writing -----------------------------------------------------------------------------------------

def render_value(v, raw: bool) -> str:
    return v if raw and isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def render_call(call: ToolCall, tool: Optional[Tool] = None) -> str:
    """A call in GLM's format (for the history of a conversation)."""
    raw = tool.string_keys() if tool is not None else {k for k, v in call.arguments.items() if isinstance(v, str)}
    args = "".join(f"{KEY_OPEN}{k}{KEY_CLOSE}\n{VALUE_OPEN}{render_value(v, k in raw)}{VALUE_CLOSE}\n"
                   for k, v in call.arguments.items())
    return f"{CALL_OPEN}{call.name}\n{args}{CALL_CLOSE}"


def render_tools(tools: Sequence[Tool]) -> str:
    """The tool list as a system message, for a model without its own chat template (a template
    renders ``tools`` itself)."""
    lines = "\n".join(json.dumps(t.as_openai()["function"], ensure_ascii=False) for t in tools)
    return ("# Tools\n\nThese functions can be called; their signatures, one per line:\n"
            f"<tools>\n{lines}\n</tools>\n\nTo call one, write its name and each argument in this form:\n"
            f"{CALL_OPEN}NAME\n{KEY_OPEN}ARGUMENT{KEY_CLOSE}\n{VALUE_OPEN}VALUE{VALUE_CLOSE}\n{CALL_CLOSE}")


# -- reading -----------------------------------------------------------------------------------------

_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)
_ARG = re.compile(re.escape(KEY_OPEN) + r"(.*?)" + re.escape(KEY_CLOSE) + r"\s*" + re.escape(VALUE_OPEN)
                  + r"(.*?)" + re.escape(VALUE_CLOSE), re.S)


def _parse_call(body: str, tools: dict) -> Optional[ToolCall]:
    """The inside of <tool_call>...</tool_call>; None when it names no known tool."""
    head, _, _ = body.partition(KEY_OPEN)
    name = head.strip()
    tool = tools.get(name)
    if tool is None:
        return None
    raw = tool.string_keys()
    args = {}
    for k, v in _ARG.findall(body):
        k = k.strip()
        if k in raw:
            args[k] = v
            continue
        try:
            args[k] = json.loads(v)
        except ValueError:
            args[k] = v                           # a value the model left unquoted: keep its text
    return ToolCall(name, args, new_call_id())


def split_reasoning(text: str) -> Tuple[str, str]:
    """(reasoning, rest): the <think> block at the start of a reply (the prompt may have opened it)."""
    if THINK_CLOSE in text:
        head, _, rest = text.partition(THINK_CLOSE)
        return head.replace(THINK_OPEN, "", 1).strip(), rest
    if text.lstrip().startswith(THINK_OPEN):          # cut off inside its reasoning
        return text.lstrip()[len(THINK_OPEN):].strip(), ""
    return "", text


def parse_reply(text: str, tools: Sequence[Tool]) -> Tuple[str, str, List[ToolCall]]:
    """(reasoning, content, calls) of a reply: the tool calls naming known tools are taken out of
    the text (a call naming no tool stays in the content)."""
    reasoning, rest = split_reasoning(text)
    by_name = {t.name: t for t in tools}
    calls, kept, last = [], [], 0
    for m in _CALL.finditer(rest):
        call = _parse_call(m.group(1), by_name)
        if call is None:
            continue
        kept.append(rest[last:m.start()])
        last = m.end()
        calls.append(call)
    kept.append(rest[last:])
    return reasoning, "".join(kept).strip() if calls else "".join(kept), calls


class ReplyStream:
    """A reply's text as it streams, in parts a front end sends at once: ``feed(piece)`` and
    ``finish()`` return ``[(kind, value)]`` with kind 'reasoning' or 'content' (text) or 'call'
    (a ToolCall, once its </tool_call> arrived). Text that may begin a tag is held back until it
    is known not to; a call's text is never sent as content."""

    def __init__(self, tools: Sequence[Tool], thinking: bool = False):
        self.tools = {t.name: t for t in tools}
        self.buf = ""
        self.mode = "reasoning" if thinking else "start"    # start: a <think> may open the reply
        self.calls = 0

    def _held(self, s: str, tags) -> int:
        """How many trailing characters of s could be the start of one of tags."""
        for n in range(min(len(s), max(len(t) for t in tags) - 1), 0, -1):
            if any(t.startswith(s[-n:]) for t in tags):
                return n
        return 0

    def feed(self, piece: str) -> list:
        self.buf += piece
        out = []
        while True:
            if self.mode == "start":
                s = self.buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self.buf, self.mode = s[len(THINK_OPEN):], "reasoning"
                    continue
                if THINK_OPEN.startswith(s) and s:
                    return out                        # may still become <think>
                self.mode = "content"
                continue
            if self.mode == "reasoning":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    if i:
                        out.append(("reasoning", self.buf[:i]))
                    self.buf, self.mode = self.buf[i + len(THINK_CLOSE):], "content"
                    continue
                keep = self._held(self.buf, (THINK_CLOSE,))
                if len(self.buf) > keep:
                    out.append(("reasoning", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                return out
            if self.mode == "content":
                if self.calls and not self.buf.strip():
                    return out                        # the whitespace between calls is not content
                i = self.buf.find(CALL_OPEN)
                if i >= 0:
                    if i:
                        out.append(("content", self.buf[:i]))
                    self.buf, self.mode = self.buf[i:], "call"
                    continue
                keep = self._held(self.buf, (CALL_OPEN,))
                if len(self.buf) > keep:
                    out.append(("content", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                return out
            # mode == "call": wait for the end of the call
            j = self.buf.find(CALL_CLOSE)
            if j < 0:
                return out
            body = self.buf[len(CALL_OPEN):j]
            call = _parse_call(body, self.tools)
            if call is not None:
                out.append(("call", call))
                self.calls += 1
            else:
                out.append(("content", self.buf[:j + len(CALL_CLOSE)]))
            self.buf, self.mode = self.buf[j + len(CALL_CLOSE):], "content"

    def finish(self) -> list:
        """What is left at the end of the reply (an unfinished call is sent as content)."""
        rest, self.buf = self.buf, ""
        if not rest or (self.calls and self.mode == "content" and not rest.strip()):
            return []
        kind = "reasoning" if self.mode == "reasoning" else "content"
        return [(kind, rest)]


# -- forcing a call ----------------------------------------------------------------------------------

def _lit(text: str) -> str:
    return json.dumps(text)                            # a Lark string literal


def _seq(parts, tags) -> str:
    """Lark for a sequence of texts; a text in ``tags`` (a tag the tokenizer holds as one special
    token, {text: id}) is that token (llguidance's <[id]>), since a grammar's literals match the
    bytes of ordinary tokens only."""
    return " ".join(f"<[{tags[p]}]>" if p in tags else _lit(p) for p in parts if p)


def _value_rule(schema) -> str:
    """The grammar of one argument's value as GLM writes it: raw text for a plain string (an enum
    of strings: one of them), JSON for anything else."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        if isinstance(schema.get("enum"), list) and all(isinstance(e, str) for e in schema["enum"]):
            return " | ".join(_lit(e) for e in schema["enum"]) or '""'
        if "maxLength" in schema and isinstance(schema["maxLength"], int):
            return "/[^<]{0,%d}/" % max(0, schema["maxLength"])
        return "/[^<]*/"
    return "%json " + json.dumps(schema if isinstance(schema, (dict, bool)) else {})


def call_grammar(tools: Sequence[Tool], several: bool = False, tags: Optional[dict] = None) -> str:
    """A Lark grammar (llguidance's) whose sentences are one call (``several``: one or more) of one
    of ``tools`` in GLM's format, each argument's value valid for its schema: required arguments
    present, optional ones optional, in the schema's order. ``tags``: {tag: token id} of the tags
    the tokenizer holds as special tokens (GLM-5's does)."""
    tags = dict(tags or {})
    rules, alts = [], []
    for i, t in enumerate(tools):
        props = t.parameters.get("properties") or {}
        required = set(t.parameters.get("required") or [])
        parts = []
        for j, (k, s) in enumerate(props.items()):
            name = f"t{i}_a{j}"
            rules.append(f"{name}: {_seq([KEY_OPEN, k, KEY_CLOSE, chr(10), VALUE_OPEN], tags)} ({_value_rule(s)}) "
                         f"{_seq([VALUE_CLOSE, chr(10)], tags)}")
            parts.append(name if k in required else name + "?")
        rules.append(f"t{i}: {_lit(t.name + chr(10))} {' '.join(parts)}".rstrip())
        alts.append(f"t{i}")
    call = f"call: {_seq([CALL_OPEN], tags)} ({' | '.join(alts)}) {_seq([CALL_CLOSE], tags)}"
    start = "start: call (\"\\n\" call)*" if several else "start: call"
    return "\n".join([start, call] + rules) + "\n"


TAGS = (CALL_OPEN, CALL_CLOSE, KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE)
