"""Anthropic's Messages API for ``serve``: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A request (``system``, ``messages`` of text / ``tool_use`` / ``tool_result`` blocks, ``tools``,
``tool_choice``, ``stop_sequences``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``thinking``, ``output_config.format`` (a JSON schema the output follows), ``stream``,
``metadata``, ``cache_control`` (accepted: prompt prefixes are reused from the KV cache anyway))
becomes the conversation colibri renders with the model's
chat format (:func:`parse`); the answer comes back as content blocks (``thinking``, ``text``,
``tool_use``) with Anthropic's stop reasons and usage, prompt tokens reused from the KV cache
reported as ``cache_read_input_tokens`` (:class:`MessagesEncoder`, whole or as the stream's
events: message_start, content_block_start / _delta / _stop per block, message_delta,
message_stop). The HTTP side (auth by ``x-api-key``, queue, errors in Anthropic's shape) is
``colibri.server``'s.
"""
from __future__ import annotations

import json
import math
import uuid
from typing import List, Optional

from .tools import ReplyStream, Tool, ToolCall, ToolError, call_grammar, check_schema, check_tools, parse_reply

__all__ = ["MessagesError", "parse", "count_request", "MessagesEncoder", "error_body", "ERROR_TYPES"]

MAX_STOPS = 16
FIELDS = {"model", "messages", "max_tokens", "system", "tools", "tool_choice", "stop_sequences", "stream",
          "temperature", "top_p", "top_k", "thinking", "metadata", "service_tier", "cache_control", "output_config"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking"}

#: HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


class MessagesError(ValueError):
    """A request the Messages API refuses (400 invalid_request_error); the message names the field."""


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _text_of(content, where: str) -> str:
    """A string, or a list of text blocks, joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessagesError(f"{where}: must be a string or a list of text blocks")
    out = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise MessagesError(f"{where}.{j}: only text blocks are supported here")
        out.append(b["text"])
    return "".join(out)


def _conversation(body: dict) -> list:
    """system + messages -> colibri's messages ({role, content, tool_calls}): a user turn's
    tool_result blocks become tool messages (before its text), an assistant turn's tool_use blocks
    its tool calls; thinking blocks of earlier turns are left out (the template drops them too)."""
    out = []
    system = body.get("system")
    if system is not None:
        text = _text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text, "tool_calls": []})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise MessagesError("messages: must be a non-empty list of {\"role\", \"content\"} objects")
    for i, m in enumerate(msgs):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise MessagesError(f"{where}.role: must be 'user' or 'assistant'")
        extra = set(m) - {"role", "content"}
        if extra:
            raise MessagesError(f"{where}.{sorted(extra)[0]}: Extra inputs are not permitted")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content, "tool_calls": []})
            continue
        if not isinstance(content, list):
            raise MessagesError(f"{where}.content: must be a string or a list of content blocks")
        texts, calls = [], []
        for j, b in enumerate(content):
            bw = f"{where}.content.{j}"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise MessagesError(f"{bw}: a tool_use block needs a 'name' and an 'input' object")
                calls.append(ToolCall(b["name"], dict(b.get("input") or {}), str(b.get("id") or "")))
            elif kind == "tool_result" and m["role"] == "user":
                result = b.get("content", "")
                text = _text_of(result, f"{bw}.content") if result is not None else ""
                if b.get("is_error"):
                    text = "Error: " + text
                out.append({"role": "tool", "content": text, "tool_calls": []})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue
            elif kind in ("image", "document"):
                raise MessagesError(f"{bw}: {kind} blocks are not supported (this model reads text only)")
            else:
                raise MessagesError(f"{bw}: a block of type {kind!r} is not allowed in a {m['role']} message")
        if texts or calls or m["role"] == "assistant":
            out.append({"role": m["role"], "content": "".join(texts), "tool_calls": calls})
    return out


def _tools(body: dict):
    """(tools, choice, several): Tool objects; 'auto', 'none', 'any' or a tool's name."""
    raw = body.get("tools") or []
    if not isinstance(raw, list):
        raise MessagesError("tools: must be a list")
    tools = []
    try:
        for i, t in enumerate(raw):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                kind = t.get("type") if isinstance(t, dict) else None
                raise MessagesError(f"tools.{i}: tools of type {kind!r} (server tools) are not supported")
            if not isinstance(t.get("name"), str):
                raise MessagesError(f"tools.{i}.name: Field required")
            if "input_schema" not in t:
                raise MessagesError(f"tools.{i}.input_schema: Field required")
            tools.append(Tool(t["name"], t.get("description") or "",
                              check_schema(t["input_schema"], f"tools.{i}.input_schema")))
        tools = check_tools(tools)
    except ToolError as e:
        raise MessagesError(str(e)) from None
    tc = body.get("tool_choice") or {"type": "auto"}
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise MessagesError("tool_choice: must be {\"type\": auto | any | tool | none}")
    several = not tc.get("disable_parallel_tool_use", False)
    if tc["type"] == "tool":
        if tc.get("name") not in {t.name for t in tools}:
            raise MessagesError(f"tool_choice.name: {tc.get('name')!r} is not one of the request's tools")
        return tools, tc["name"], False
    if tc["type"] == "any" and not tools:
        raise MessagesError("tool_choice: 'any' needs tools")
    return tools, tc["type"], several


def _thinking(body: dict) -> Optional[bool]:
    th = body.get("thinking")
    if th is None:
        return None
    if not isinstance(th, dict) or th.get("type") not in ("enabled", "disabled", "adaptive"):
        raise MessagesError("thinking: must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}")
    if th["type"] == "enabled" and not (_int(th.get("budget_tokens")) and th["budget_tokens"] >= 1):
        raise MessagesError("thinking.budget_tokens: must be an integer >= 1")
    return th["type"] != "disabled"


def _prompt(body: dict, llm):
    """(prompt text, tools shown, choice, several, thinking) of a request."""
    msgs = _conversation(body)
    tools, choice, several = _tools(body)
    thinking = _thinking(body)
    shown = tools if choice != "none" else []
    try:
        prompt = llm.render_chat(msgs, tools=shown, thinking=thinking)
    except ValueError as e:
        raise MessagesError(f"messages: {e}") from None
    return prompt, shown, choice, several, thinking


def _output_format(oc):
    """output_config -> the JSON schema of output_config.format (None: free text)."""
    from .grammar import GrammarError, grammar_text
    if oc is None:
        return None
    if not isinstance(oc, dict):
        raise MessagesError("output_config: must be an object")
    fmt = oc.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise MessagesError("output_config.format: must be {\"type\": \"json_schema\", \"schema\": {...}}")
    try:
        grammar_text(json_schema=fmt["schema"])
    except GrammarError as e:
        raise MessagesError(f"output_config.format.schema: not a usable JSON schema: {e}") from None
    return fmt["schema"]


def count_request(body: dict, llm) -> str:
    """The prompt text of a count_tokens request."""
    unknown = sorted(set(body) - COUNT_FIELDS)
    if unknown:
        raise MessagesError(f"{unknown[0]}: Extra inputs are not permitted")
    return _prompt(body, llm)[0]


def parse(body: dict, llm, role_stops) -> dict:
    """A Messages request -> the server's generation request (without ids and the context check):
    prompt text, sampling settings, stops, the grammar of a forced call, tools and thinking."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise MessagesError(f"{unknown[0]}: Extra inputs are not permitted")
    mt = body.get("max_tokens")
    if mt is None:
        raise MessagesError("max_tokens: Field required")
    if not _int(mt) or mt < 1:
        raise MessagesError(f"max_tokens: must be an integer >= 1, got {mt!r}")
    t = body.get("temperature")
    if t is not None and (not _num(t) or not 0 <= t <= 1):
        raise MessagesError(f"temperature: must be a number in [0, 1], got {t!r}")
    p = body.get("top_p")
    if p is not None and (not _num(p) or not 0 < p <= 1):
        raise MessagesError(f"top_p: must be a number in (0, 1], got {p!r}")
    k = body.get("top_k")
    if k is not None and (not _int(k) or k < 0):
        raise MessagesError(f"top_k: must be an integer >= 0, got {k!r}")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise MessagesError("stop_sequences: must be a list of strings")
    if len(stops) > MAX_STOPS:
        raise MessagesError(f"stop_sequences: at most {MAX_STOPS} are allowed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise MessagesError("stream: must be a boolean")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise MessagesError("metadata: must be an object")
    schema = _output_format(body.get("output_config"))
    prompt, tools, choice, several, thinking = _prompt(body, llm)
    o = llm.options
    req = {"prompt": prompt, "max_tokens": mt, "max_tokens_param": "max_tokens",
           "temperature": o.temperature if t is None else float(t), "top_p": o.top_p if p is None else float(p),
           "top_k": o.top_k if k is None else k, "repeat_penalty": o.repeat_penalty,
           "frequency_penalty": o.frequency_penalty, "presence_penalty": o.presence_penalty, "seed": None,
           "stop": list(role_stops) + [s for s in stops if s], "user_stops": [s for s in stops if s],
           "stream": stream, "include_usage": False, "tools": tools,
           "thinking": bool(thinking) or prompt.rstrip().endswith("<think>")}
    if schema is not None:
        req["json_schema"] = schema
    if choice not in ("auto", "none"):
        if schema is not None:
            raise MessagesError("output_config.format: a forced tool call and an output format exclude each other")
        forced = [t for t in tools if choice == "any" or t.name == choice]
        req["grammar"] = call_grammar(forced, several=choice == "any" and several, tags=llm.special_token_ids())
    return req


def _usage(c) -> dict:
    cached = max(c.prompt_tokens - c.prefill_tokens, 0)
    return {"input_tokens": c.prompt_tokens - cached, "output_tokens": c.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _stop(c, calls: int, user_stops) -> tuple:
    """(stop_reason, stop_sequence) of a generation."""
    if calls:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.stop_string is not None and c.stop_string in user_stops:
        return "stop_sequence", c.stop_string
    return "end_turn", None


def _sse(event: str, obj: dict) -> bytes:
    return f"event: {event}\ndata: ".encode() + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class MessagesEncoder:
    """Anthropic's shapes of one answer (the server's encoder protocol: response, begin, text,
    end, error). The stream opens a block per kind of text as it comes (thinking, text), a
    tool_use block per call once its </tool_call> arrived."""

    def __init__(self, model: str, req: dict, created: int):
        self.model, self.req = model, req
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.split = ReplyStream(req["tools"], req["thinking"])
        self.index, self.open, self.calls = -1, None, 0

    def _message(self, content, stop_reason=None, stop_sequence=None, usage=None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": usage or {"input_tokens": 0, "output_tokens": 0}}

    def response(self, c) -> dict:
        reasoning, text, calls = parse_reply(c.text, self.req["tools"])
        blocks = []
        if reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if text or not (calls or reasoning):
            blocks.append({"type": "text", "text": text})
        blocks += [{"type": "tool_use", "id": "toolu_" + k.id[len("call_"):], "name": k.name, "input": k.arguments}
                   for k in calls]
        reason, seq = _stop(c, len(calls), self.req["user_stops"])
        return self._message(blocks, reason, seq, _usage(c))

    def begin(self) -> list:
        return [_sse("message_start", {"type": "message_start", "message": self._message([])})]

    def _close(self) -> List[bytes]:
        out = []
        if self.open == "thinking":
            out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                    "delta": {"type": "signature_delta", "signature": ""}}))
        if self.open is not None:
            out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        return out

    def _start(self, block: dict) -> List[bytes]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [_sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                   "content_block": block})]

    def _events(self, events) -> list:
        out = []
        for kind, v in events:
            if kind == "call":
                out += self._start({"type": "tool_use", "id": "toolu_" + v.id[len("call_"):], "name": v.name,
                                    "input": {}})
                out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(v.arguments, ensure_ascii=False)}}))
                out += self._close()
                self.calls += 1
                continue
            block = "thinking" if kind == "reasoning" else "text"
            if self.open != block:
                out += self._start({"type": "thinking", "thinking": "", "signature": ""} if block == "thinking"
                                   else {"type": "text", "text": ""})
            delta = {"type": "thinking_delta", "thinking": v} if block == "thinking" else {"type": "text_delta", "text": v}
            out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))
        return out

    def text(self, piece: str) -> list:
        return self._events(self.split.feed(piece))

    def end(self, c) -> list:
        out = self._events(self.split.finish()) + self._close()
        reason, seq = _stop(c, self.calls, self.req["user_stops"])
        out.append(_sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                             "stop_sequence": seq},
                                          "usage": _usage(c)}))
        return out + [_sse("message_stop", {"type": "message_stop"})]

    def error(self, err) -> bytes:
        return _sse("error", error_body(err.status, err.message))
