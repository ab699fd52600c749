"""``python -m colibri serve``: an OpenAI-compatible HTTP server over one model in the process.

Endpoints (JSON in, JSON or Server-Sent Events out; errors in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``):

- ``GET /v1/models``, ``GET /v1/models/{id}``: the one model served. Its id is the model folder's
  name, or ``colibri-default`` for the embedded default model.
- ``POST /v1/chat/completions``: ``messages`` (roles system/developer/user/assistant/tool; content a
  string or a list of text parts; an assistant's ``tool_calls``), rendered with the model's chat
  template, or a fallback format named at start-up when it has none (:meth:`LLM.render_chat`).
  ``tools`` (functions with JSON-schema parameters) and ``tool_choice`` (auto, none, required, or
  a named function): the model's calls, in GLM's format (colibri.tools), come back as
  ``tool_calls`` (streamed as one delta per call, which the official client assembles) with
  finish_reason ``tool_calls``; a required or named call is grammar-constrained, its arguments
  valid for the tool's schema. A reply's ``<think>`` block comes back as ``reasoning_content``.
  ``response_format``: ``json_object`` or ``json_schema`` constrain the output (colibri.grammar).
- ``POST /v1/completions`` (legacy): ``prompt`` a string or a list of token ids (or a list holding
  one of those).
- ``GET /health`` (never needs the API key): see :meth:`Scheduler.snapshot` for the counters.

Request fields: ``model`` (optional; when given it must be the served id, else 404
``model_not_found``), ``max_tokens`` / ``max_completion_tokens`` (default: the engine option
``max_tokens``, 256, clipped to the room left in the context), ``temperature`` (0..2, default the
engine option, 0.7; 0 = greedy), ``top_p`` ((0, 1], default 0.9), ``top_k`` (0 = off),
``repetition_penalty`` (or llama.cpp's ``repeat_penalty``; 1 = off), ``frequency_penalty`` and
``presence_penalty`` ([-2, 2]; the penalties look at the last ``repeat_last_n`` tokens, an engine
option, 64), ``seed``, ``stop`` (a string or a list of up to 16), ``stream``, ``stream_options.include_usage``, ``n`` (only 1); ``user``,
``safety_identifier``, ``prompt_cache_key``, ``metadata``, ``service_tier`` (auto/default) are
accepted and have no effect here; ``parallel_tool_calls`` false makes a required call a single
one. OpenAI fields this server cannot honour are refused with a 400 unless they carry their
neutral value (null, false, 0, "none", [], ...): functions / function_call (send tools),
logprobs / top_logprobs, n > 1, logit_bias, audio, modalities other than text, prediction,
reasoning_effort, store, echo, suffix, best_of > 1, role function, non-text content parts.
Unknown fields are refused too (``unknown_parameter``): nothing is silently ignored.

Scheduling: the model generates for one request at a time. Requests that passed validation wait
in a FIFO queue of at most ``max_queue`` entries; when it is full, or after waiting
``queue_timeout`` seconds, they get a 429 (``type: rate_limit_exceeded``, code ``queue_full`` /
``queue_timeout``, ``Retry-After: 1``), always before any byte of a stream. A client that goes away
(detected by a failed write or, every 50 ms, by a peek at its socket) has its generation cancelled.
Streams are written by a per-request writer thread, so a slow reader never holds the model.

The LLM keeps the KV cache of the previous request: a prompt sharing a prefix with it (the next
turn of a conversation) prefills only the new tokens. ``usage.prompt_tokens_details.cached_tokens``
says how many prompt tokens came from that cache.
"""
from __future__ import annotations

import argparse
import collections
import hmac
import json
import math
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import unquote, urlsplit

from .messages_api import MessagesEncoder, MessagesError, count_request, error_body
from .messages_api import parse as parse_messages
from .tools import ReplyStream, call_grammar, parse_reply

__all__ = ["make_server", "OpenAIServer", "Scheduler", "add_arguments", "run", "main", "DEFAULT_MODEL_ID"]

DEFAULT_MODEL_ID = "colibri-default"
MAX_BODY = 4 << 20            # bytes of a request body
MAX_STOPS = 16
CLIENT_TIMEOUT = 60.0         # seconds a socket read or write may block (idle keep-alive included)
WATCH_INTERVAL = 0.05         # seconds between two checks that a client is still connected
_ROLE_STOPS = ("<|user|>", "<|system|>")      # a chat turn ends at the next role tag (as LLM.chat)


# -- errors --------------------------------------------------------------------------------------

class ApiError(Exception):
    """An HTTP error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None,
                 code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message, param=None, code="invalid_value"):
    return ApiError(400, message, param=param, code=code)


def _unsupported(message, param, code="unsupported_parameter"):
    return ApiError(400, message, param=param, code=code)


# -- the queue -----------------------------------------------------------------------------------

class _Ticket:
    __slots__ = ("cancel", "shutdown")

    def __init__(self):
        self.cancel = threading.Event()
        self.shutdown = False               # cancelled by the server's shutdown, not by the client


class Scheduler:
    """One generation at a time; the others wait in a bounded FIFO queue.

    Counters (``snapshot``), for the requests that passed validation and asked for the model
    (requests refused earlier with a 4xx - auth, JSON, fields, context - are not counted):

    - ``requests``: all of them, so at every moment
      ``requests == active + queued + completed + rejected + errors``;
    - ``active`` (0 or 1) generating now; ``queued`` waiting for their turn;
    - ``completed``: got the model and the generation ended without a server error - normally
      (stop, length) or cut short because the client went away (those are also counted in
      ``cancelled``, a part of ``completed``; such a client gets no answer, or a stream that
      ends without ``[DONE]``);
    - ``rejected``: answered 429 (queue full, waited longer than queue_timeout) or 503 (the
      server is shutting down) without generating;
    - ``errors``: got the model and the generation failed (answered 500, or 400 for an error only
      the engine could see) or was cut short by the server's shutdown (answered 503); when the
      stream had started, the error comes as a last ``data: {"error": ...}`` event, without
      ``[DONE]``.
    """

    def __init__(self, max_queue: int = 4, queue_timeout: float = 30.0):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        if not (isinstance(queue_timeout, (int, float)) and queue_timeout > 0 and math.isfinite(queue_timeout)):
            raise ValueError(f"queue_timeout must be a number of seconds > 0, got {queue_timeout!r}")
        self.max_queue, self.queue_timeout = max_queue, float(queue_timeout)
        self._cond = threading.Condition()
        self._waiting: "collections.deque[_Ticket]" = collections.deque()
        self._active: Optional[_Ticket] = None
        self.closed = False
        self.requests = self.completed = self.rejected = self.errors = self.cancelled = 0

    def acquire(self, ticket: _Ticket) -> float:
        """Wait for the model; returns the seconds waited. Raises ApiError 429/503 when refused."""
        t0 = time.monotonic()
        with self._cond:
            self.requests += 1
            if self.closed:
                self.rejected += 1
                raise _closed_error()
            if (self._active is not None or self._waiting) and len(self._waiting) >= self.max_queue:
                self.rejected += 1
                raise ApiError(429, f"the server is busy: {len(self._waiting)} request(s) already wait for the "
                                    f"model (max_queue {self.max_queue}); retry later",
                               type="rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"})
            self._waiting.append(ticket)
            deadline = t0 + self.queue_timeout
            while True:
                if self.closed:
                    break
                if self._active is None and self._waiting[0] is ticket:
                    self._waiting.popleft()
                    self._active = ticket
                    self._cond.notify_all()
                    return time.monotonic() - t0
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._waiting.remove(ticket)
            self.rejected += 1
            self._cond.notify_all()
            if self.closed:
                raise _closed_error()
            raise ApiError(429, f"the request waited {self.queue_timeout:g} s for the model (queue_timeout) and "
                                "was dropped; retry later",
                           type="rate_limit_exceeded", code="queue_timeout", headers={"Retry-After": "1"})

    def release(self, ticket: _Ticket, ok: bool, cancelled: bool = False):
        with self._cond:
            if self._active is not ticket:
                raise RuntimeError("release of a request that does not hold the model")
            self._active = None
            if ok:
                self.completed += 1
                self.cancelled += bool(cancelled)
            else:
                self.errors += 1
            self._cond.notify_all()

    def close(self):
        """Refuse new requests (503) and drop the waiting ones (503); the active one goes on."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def cancel_active(self):
        with self._cond:
            if self._active is not None:
                self._active.shutdown = True
                self._active.cancel.set()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing generates or waits; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._active is not None or self._waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def snapshot(self) -> dict:
        with self._cond:
            return {"active": int(self._active is not None), "queued": len(self._waiting),
                    "completed": self.completed, "rejected": self.rejected, "errors": self.errors,
                    "cancelled": self.cancelled, "requests": self.requests,
                    "max_queue": self.max_queue, "queue_timeout": self.queue_timeout}


def _closed_error():
    return ApiError(503, "the server is shutting down", type="server_error", code="server_shutting_down")


# -- request validation --------------------------------------------------------------------------

def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_PENALTY_FIELDS = {"top_k", "repetition_penalty", "repeat_penalty", "frequency_penalty", "presence_penalty"}
_CHAT_FIELDS = _PENALTY_FIELDS | {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
                "stop", "stream", "stream_options", "n", "user", "safety_identifier", "prompt_cache_key",
                "metadata", "store", "service_tier",
                # refused unless neutral
                "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "logprobs",
                "top_logprobs", "logit_bias", "response_format",
                "modalities", "audio", "prediction", "reasoning_effort", "web_search_options", "verbosity"}
_COMPLETION_FIELDS = _PENALTY_FIELDS | {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                      "stream_options", "n", "user", "safety_identifier", "prompt_cache_key",
                      # refused unless neutral
                      "logprobs", "echo", "suffix", "best_of", "logit_bias"}


def _neutral(v, *allowed) -> bool:
    """``v`` is one of ``allowed``, compared with its type (0 is not False, 1 is not True)."""
    return any(v is a if a is None or isinstance(a, bool) else (type(v) is type(a) and v == a) for a in allowed)


def _check_neutral(body: dict):
    """400 for the OpenAI fields whose non-neutral values this server cannot honour."""
    def nonempty(name):
        return not _neutral(body.get(name), None, [], {})

    if nonempty("functions"):
        raise _unsupported("'functions' is not supported (deprecated by OpenAI): send 'tools'", "functions")
    if not _neutral(body.get("function_call"), None, "none"):
        raise _unsupported("'function_call' is not supported (deprecated by OpenAI): send 'tool_choice'",
                           "function_call")
    if not _neutral(body.get("parallel_tool_calls"), None, True, False):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type")
    if not _neutral(body.get("logprobs"), None, False):
        raise _unsupported("'logprobs' is not supported: this server does not return log probabilities",
                           "logprobs")
    if not _neutral(body.get("top_logprobs"), None, 0):
        raise _unsupported("'top_logprobs' is not supported: this server does not return log probabilities",
                           "top_logprobs")
    if nonempty("logit_bias"):
        raise _unsupported("'logit_bias' is not supported", "logit_bias")
    if not _neutral(body.get("modalities"), None, ["text"]):
        raise _unsupported("'modalities' is not supported: only [\"text\"]", "modalities")
    for name in ("audio", "prediction", "web_search_options", "verbosity"):
        if body.get(name) is not None:
            raise _unsupported(f"'{name}' is not supported", name)
    if body.get("reasoning_effort") is not None:
        raise _unsupported("'reasoning_effort' is not supported by this server", "reasoning_effort")
    if not _neutral(body.get("echo"), None, False):
        raise _unsupported("'echo' is not supported", "echo")
    if not _neutral(body.get("suffix"), None, ""):
        raise _unsupported("'suffix' is not supported (no fill-in-the-middle)", "suffix")
    if not _neutral(body.get("best_of"), None, 1):
        raise _unsupported("'best_of' is not supported (only 1)", "best_of")
    if not _neutral(body.get("store"), None, False):
        raise _unsupported("'store' is not supported: this server stores nothing (only false)", "store")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise _bad("'metadata' must be an object", "metadata", "invalid_type")
    if not _neutral(body.get("service_tier"), None, "auto", "default"):
        raise _unsupported("'service_tier' is not supported (only auto/default)", "service_tier")
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _bad(f"'{name}' must be a string", name, "invalid_type")


def _penalties(body: dict, defaults) -> dict:
    """top_k (vLLM, llama.cpp's server), repetition_penalty (transformers, vLLM; llama.cpp's
    repeat_penalty too) and OpenAI's frequency/presence penalties, validated; defaults: the
    server's options."""
    out = {}
    k = body.get("top_k")
    if k is not None and (not _is_int(k) or k < -1):
        raise _bad(f"'top_k' must be an integer >= 0 (0 or -1: off), got {k!r}", "top_k")
    out["top_k"] = defaults.top_k if k is None else max(int(k), 0)
    rp, alias = body.get("repetition_penalty"), body.get("repeat_penalty")
    if rp is not None and alias is not None and rp != alias:
        raise _bad("give 'repetition_penalty' or 'repeat_penalty', not both with different values",
                   "repeat_penalty")
    name, rp = ("repetition_penalty", rp) if rp is not None else ("repeat_penalty", alias)
    if rp is not None and (not _is_num(rp) or not 0 < rp <= 10):
        raise _bad(f"'{name}' must be a number in (0, 10] (1 = off), got {rp!r}", name)
    out["repeat_penalty"] = defaults.repeat_penalty if rp is None else float(rp)
    for name in ("frequency_penalty", "presence_penalty"):
        v = body.get(name)
        if v is not None and (not _is_num(v) or not -2 <= v <= 2):
            raise _bad(f"'{name}' must be a number in [-2, 2], got {v!r}", name)
        out[name] = getattr(defaults, name) if v is None else float(v)
    return out


def _sampling(body: dict, defaults) -> dict:
    """The common generation fields, validated (max_tokens is checked against the context later)."""
    out = {}
    n = body.get("n")
    if n is not None:
        if not _is_int(n) or n < 1:
            raise _bad(f"'n' must be an integer >= 1, got {n!r}", "n", "invalid_type" if not _is_int(n) else None)
        if n != 1:
            raise _unsupported(f"'n' = {n} is not supported: this server generates one choice per request",
                               "n", "unsupported_value")
    mt, mct = body.get("max_tokens"), body.get("max_completion_tokens")
    if mt is not None and mct is not None and mt != mct:
        raise _bad("give 'max_tokens' or 'max_completion_tokens', not both with different values",
                   "max_completion_tokens")
    name, value = ("max_completion_tokens", mct) if mct is not None else ("max_tokens", mt)
    if value is not None and (not _is_int(value) or value < 1):
        raise _bad(f"'{name}' must be an integer >= 1, got {value!r}", name)
    out["max_tokens"], out["max_tokens_param"] = value, name
    t = body.get("temperature")
    if t is not None and (not _is_num(t) or not 0 <= t <= 2):
        raise _bad(f"'temperature' must be a number in [0, 2], got {t!r}", "temperature")
    out["temperature"] = defaults.temperature if t is None else float(t)
    p = body.get("top_p")
    if p is not None and (not _is_num(p) or not 0 < p <= 1):
        raise _bad(f"'top_p' must be a number in (0, 1], got {p!r}", "top_p")
    out["top_p"] = defaults.top_p if p is None else float(p)
    out.update(_penalties(body, defaults))
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(1 << 63) <= seed < (1 << 64)):
        raise _bad(f"'seed' must be a 64-bit integer, got {seed!r}", "seed")
    out["seed"] = seed
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOPS:
            raise _bad(f"'stop' holds {len(stop)} strings; at most {MAX_STOPS} are allowed", "stop")
        stops = list(stop)
    else:
        raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    out["stop"] = [s for s in stops if s]
    stream = body.get("stream")
    if not _neutral(stream, None, True, False):
        raise _bad(f"'stream' must be a boolean, got {stream!r}", "stream", "invalid_type")
    out["stream"] = bool(stream)
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not out["stream"]:
            raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(so, dict):
            raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
        extra = set(so) - {"include_usage"}
        if extra:
            raise _unsupported(f"stream_options.{sorted(extra)[0]} is not supported", "stream_options")
        if not _neutral(so.get("include_usage"), None, True, False):
            raise _bad("'stream_options.include_usage' must be a boolean", "stream_options", "invalid_type")
        include_usage = bool(so.get("include_usage"))
    out["include_usage"] = include_usage
    return out


def _response_format(rf):
    """OpenAI's response_format -> the JSON schema the output must follow (None: free text)."""
    from .grammar import GrammarError, grammar_text
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise _bad("'response_format' must be an object with a 'type'", "response_format", "invalid_type")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise _bad(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                   "response_format.type")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str):
        raise _bad("response_format.json_schema must be an object with a 'name' and a 'schema'",
                   "response_format.json_schema", "invalid_type")
    schema = js.get("schema", {})
    try:
        grammar_text(json_schema=schema)
    except GrammarError as e:
        raise _bad(f"response_format.json_schema.schema is not a usable JSON schema: {e}",
                   "response_format.json_schema.schema") from None
    return schema


def _tools(body: dict):
    """(tools, choice) of a chat request: colibri.tools.Tool objects, and 'auto', 'none',
    'required' or the name of the function the model must call."""
    from .tools import Tool, ToolError, check_schema, check_tools
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise _bad("'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects", "tools",
                   "invalid_type")
    tools = []
    try:
        for i, t in enumerate(raw):
            where = f"tools[{i}]"
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
                raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}", where)
            f = t["function"]
            if not isinstance(f.get("name"), str):
                raise ToolError(f"{where}.function.name must be a string", f"{where}.function.name")
            if f.get("description") is not None and not isinstance(f["description"], str):
                raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
            tools.append(Tool(f["name"], f.get("description") or "",
                              check_schema(f.get("parameters"), f"{where}.function.parameters")))
        tools = check_tools(tools)
    except ToolError as e:
        raise _bad(str(e), e.param) from None
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"function\": "
                       "{\"name\": ...}}", "tool_choice", "invalid_type")
        if fn["name"] not in {t.name for t in tools}:
            raise _bad(f"'tool_choice' names the function {fn['name']!r}, which is not in 'tools'", "tool_choice")
        return tools, fn["name"]
    if choice not in ("auto", "none", "required"):
        raise _bad(f"'tool_choice' must be auto, none, required or a function, got {choice!r}", "tool_choice")
    if choice == "required" and not tools:
        raise _bad("'tool_choice' is 'required' but 'tools' is empty", "tool_choice")
    return tools, choice


def _tool_calls(m: dict, where: str) -> list:
    """An assistant message's tool_calls -> ToolCall objects (arguments: a JSON object text)."""
    from .tools import ToolCall
    raw = m.get("tool_calls")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls", "invalid_type")
    calls = []
    for j, c in enumerate(raw):
        cw = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{cw} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                       cw, "invalid_type")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise _bad(f"{cw}.function.arguments is not JSON", f"{cw}.function.arguments") from None
        if not isinstance(args, dict):
            raise _bad(f"{cw}.function.arguments must be a JSON object", f"{cw}.function.arguments")
        calls.append(ToolCall(fn["name"], args, c.get("id") if isinstance(c.get("id"), str) else ""))
    return calls


_MESSAGE_KEYS = {"role", "content", "name", "refusal", "tool_calls", "tool_call_id", "function_call", "audio",
                 "reasoning_content"}


def _messages(messages) -> list:
    """OpenAI chat messages -> [{role, content}] with string contents (developer -> system)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects", "messages",
                   "invalid_type" if not isinstance(messages, list) else "invalid_value")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object with 'role' and 'content'", where, "invalid_type")
        extra = set(m) - _MESSAGE_KEYS
        if extra:
            raise _unsupported(f"{where}.{sorted(extra)[0]} is not supported", f"{where}.{sorted(extra)[0]}")
        role = m.get("role")
        if not isinstance(role, str):
            raise _bad(f"{where}.role must be a string", f"{where}.role", "invalid_type")
        if role == "function":
            raise _unsupported(f"{where}: role 'function' is not supported (deprecated by OpenAI): send role "
                               "'tool'", f"{where}.role", "unsupported_value")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise _bad(f"{where}.role must be system, developer, user, assistant or tool, got {role!r}",
                       f"{where}.role")
        for key in ("function_call", "audio"):
            if m.get(key) not in (None, []):
                raise _unsupported(f"{where}.{key} is not supported", f"{where}.{key}")
        calls = _tool_calls(m, where) if role == "assistant" else []
        if role != "assistant" and m.get("tool_calls") not in (None, []):
            raise _bad(f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls")
        if m.get("refusal") is not None and not isinstance(m["refusal"], str):
            raise _bad(f"{where}.refusal must be a string", f"{where}.refusal", "invalid_type")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise _bad(f"{where}.name must be a string", f"{where}.name", "invalid_type")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                pw = f"{where}.content[{j}]"
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise _bad(f"{pw} must be an object with a 'type'", pw, "invalid_type")
                if part["type"] not in ("text", "input_text"):
                    raise _unsupported(f"{pw}: content parts of type '{part['type']}' are not supported "
                                       "(this model reads text only)", pw, "unsupported_content_type")
                if not isinstance(part.get("text"), str):
                    raise _bad(f"{pw}.text must be a string", f"{pw}.text", "invalid_type")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and calls:
            content = ""
        elif not isinstance(content, str):
            raise _bad(f"{where}.content must be a string or a list of text parts", f"{where}.content",
                       "invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content, "tool_calls": calls})
    return out


# -- the client connection -----------------------------------------------------------------------

def _client_gone(sock) -> bool:
    """True when the peer closed or reset the connection (a zero-byte peek on a readable socket).
    A client that half-closes its sending side after the request counts as gone."""
    try:
        if hasattr(select, "poll"):
            p = select.poll()
            p.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            events = p.poll(0)
            if not events:
                return False
            if events[0][1] & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                return True
        else:
            r, _, x = select.select([sock], [], [sock], 0)
            if x:
                return True
            if not r:
                return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


_END = object()


class _Writer(threading.Thread):
    """Writes a response's stream events to the client off the generation thread, and watches the
    connection: on a failed write, or when the client has gone, sets ``cancel`` (and writes no
    more). With no events it is the watchdog of a non-streamed request."""

    def __init__(self, handler, cancel: threading.Event, chunked: bool):
        super().__init__(name="colibri-sse", daemon=True)
        self.handler, self.cancel, self.chunked = handler, cancel, chunked
        self.items: "queue.SimpleQueue" = queue.SimpleQueue()
        self.failed = False

    def put(self, data: bytes):
        self.items.put(data)

    def finish(self, timeout: float):
        self.items.put(None)
        self.join(timeout)
        if self.is_alive():                 # a write blocked longer than the socket timeout allows
            self.failed = True

    def _fail(self):
        self.failed = True
        self.cancel.set()

    def run(self):
        sock, wfile = self.handler.connection, self.handler.wfile
        last = -math.inf
        while True:
            now = time.monotonic()
            if not self.failed and now - last >= WATCH_INTERVAL:
                last = now
                if _client_gone(sock):
                    self._fail()
            try:
                item = self.items.get(timeout=WATCH_INTERVAL)
            except queue.Empty:
                item = b""
            if item is None:
                return
            if self.failed:
                continue
            try:
                if item is _END:
                    if self.chunked:
                        wfile.write(b"0\r\n\r\n")
                elif item:
                    wfile.write(b"%x\r\n%s\r\n" % (len(item), item) if self.chunked else item)
            except (OSError, ValueError):
                self._fail()


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# -- the HTTP handler ----------------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "colibri"
    sys_version = ""
    disable_nagle_algorithm = True         # small SSE events go out at once

    def version_string(self):
        return self.server_version

    def setup(self):
        self.timeout = self.server.client_timeout
        super().setup()

    def log_message(self, format, *args):
        if self.server.access_log:
            sys.stderr.write("[colibri serve] %s - %s\n" % (self.address_string(), format % args))

    # every method goes through _dispatch
    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def do_PATCH(self):
        self._dispatch("PATCH")

    def do_OPTIONS(self):
        self._dispatch("OPTIONS")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def send_error(self, code, message=None, explain=None):
        """Errors raised by http.server itself (bad request line, headers) in OpenAI's shape."""
        try:
            short, _ = self.responses.get(code, ("error", ""))
        except AttributeError:
            short = "error"
        self.close_connection = True
        self._send_json(code, ApiError(code, message or short, code=None).body())

    # -- plumbing ---------------------------------------------------------------------------------

    def _send_json(self, status: int, obj, headers=None):
        data = json.dumps(obj, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _dispatch(self, method: str):
        self.request_id = "req_" + uuid.uuid4().hex
        self._body_pending = True           # until the body has been read
        self.anthropic = urlsplit(self.path).path.rstrip("/").startswith("/v1/messages")   # its error shape
        try:
            try:
                self._route(method)
            except ApiError:
                raise
            except (BrokenPipeError, ConnectionResetError, socket.timeout):
                raise
            except Exception as e:          # a bug: never let it take the server down
                traceback.print_exc(file=sys.stderr)
                raise ApiError(500, f"internal server error: {type(e).__name__}: {e}", type="server_error",
                               code="internal_error") from None
        except ApiError as e:
            if self._body_pending:
                self.close_connection = True
            try:
                body = error_body(e.status, e.message) if self.anthropic else e.body()
                self._send_json(e.status, body, {"x-request-id": self.request_id, **e.headers})
            except OSError:
                self.close_connection = True
        except (OSError, ValueError):        # the client went away while we wrote to it
            self.close_connection = True

    def _route(self, method: str):
        path = urlsplit(self.path).path
        if len(path) > 1:
            path = path.rstrip("/")
        srv = self.server
        if path == "/health":
            self._allow(method, ("GET", "HEAD"))
            self._drain()
            h = srv.scheduler.snapshot()
            self._send_json(200, {"status": "stopping" if srv.scheduler.closed else "ok", "model": srv.model_id,
                                  **h}, {"x-request-id": self.request_id})
            return
        if path == "/v1/models" or path.startswith("/v1/models/"):
            self._allow(method, ("GET", "HEAD"))
            self._auth()
            self._drain()
            card = {"id": srv.model_id, "object": "model", "created": srv.created, "owned_by": "colibri"}
            if path == "/v1/models":
                self._send_json(200, {"object": "list", "data": [card]}, {"x-request-id": self.request_id})
                return
            name = unquote(path[len("/v1/models/"):])
            if name != srv.model_id:
                raise ApiError(404, f"the model '{name}' does not exist; this server serves '{srv.model_id}'",
                               param="model", code="model_not_found")
            self._send_json(200, card, {"x-request-id": self.request_id})
            return
        if path in ("/v1/chat/completions", "/v1/completions"):
            self._allow(method, ("POST",))
            self._auth()
            body = self._json_body()
            self._completion(body, chat=path == "/v1/chat/completions")
            return
        if path in ("/v1/messages", "/v1/messages/count_tokens"):
            self._allow(method, ("POST",))
            self._auth()
            self._messages(self._json_body(), count=path.endswith("count_tokens"))
            return
        raise ApiError(404, f"Invalid URL ({method} {path}): this server answers /v1/models, "
                            "/v1/chat/completions, /v1/completions, /v1/messages and /health", code="not_found")

    def _allow(self, method, allowed):
        if method not in allowed:
            raise ApiError(405, f"method {method} is not allowed on this path (allowed: {', '.join(allowed)})",
                           code="method_not_allowed", headers={"Allow": ", ".join(allowed)})

    def _auth(self):
        key = self.server.api_key
        if not key:
            return
        given = self.headers.get("Authorization")
        if self.anthropic and self.headers.get("x-api-key") is not None:        # Anthropic's header
            if not hmac.compare_digest(self.headers["x-api-key"].encode("utf-8", "replace"), key.encode()):
                raise ApiError(401, "invalid x-api-key", code="invalid_api_key")
            return
        if given is None:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(given.encode("utf-8", "replace"), ("Bearer " + key).encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _read_body(self) -> bytes:
        te = (self.headers.get("Transfer-Encoding") or "").lower()
        if "chunked" in te:
            chunks, total = [], 0
            while True:
                line = self.rfile.readline(1026)
                try:
                    size = int(line.split(b";")[0].strip(), 16)
                except ValueError:
                    raise ApiError(400, "malformed chunked request body", code="invalid_body") from None
                if size == 0:
                    while self.rfile.readline(8194) not in (b"\r\n", b"\n", b""):
                        pass                 # trailers
                    break
                total += size
                if total > MAX_BODY:
                    raise ApiError(413, f"request body larger than {MAX_BODY} bytes", code="body_too_large")
                chunks.append(self.rfile.read(size))
                self.rfile.readline(3)
            self._body_pending = False
            return b"".join(chunks)
        raw = self.headers.get("Content-Length")
        if raw is None:
            self._body_pending = False       # HTTP/1.1 without length or chunking: no body
            return b""
        try:
            length = int(raw)
            if length < 0:
                raise ValueError
        except ValueError:
            raise ApiError(400, f"invalid Content-Length {raw!r}", code="invalid_body") from None
        if length > MAX_BODY:
            raise ApiError(413, f"request body of {length} bytes is larger than the limit of {MAX_BODY}",
                           code="body_too_large")
        data = self.rfile.read(length)
        if len(data) != length:
            raise ApiError(400, "the request body is shorter than its Content-Length", code="invalid_body")
        self._body_pending = False
        return data

    def _drain(self):
        """Read and drop a body sent with a GET (keeps the connection usable)."""
        if self.headers.get("Content-Length") or self.headers.get("Transfer-Encoding"):
            self._read_body()
        self._body_pending = False

    def _json_body(self) -> dict:
        data = self._read_body()
        if not data.strip():
            raise _bad("the request body is empty: send a JSON object", None, "invalid_json")

        def no_constant(name):
            raise ValueError(f"{name} is not valid JSON")
        try:
            body = json.loads(data.decode("utf-8"), parse_constant=no_constant)
        except (UnicodeDecodeError, ValueError) as e:
            raise _bad(f"could not parse the JSON body: {e}", None, "invalid_json") from None
        except RecursionError:
            raise _bad("could not parse the JSON body: nested too deeply", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise _bad(f"the JSON body must be an object, got {type(body).__name__}", None, "invalid_json")
        model = body.get("model")
        if model is not None:
            if not isinstance(model, str):
                raise _bad("'model' must be a string", "model", "invalid_type")
            if model != self.server.model_id:
                raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                                    f"'{self.server.model_id}'", param="model", code="model_not_found")
        return body

    # -- completions ------------------------------------------------------------------------------

    def _completion(self, body: dict, chat: bool):
        srv = self.server
        llm = srv.llm
        fields = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
        unknown = sorted(set(body) - fields)
        if unknown:
            raise _unsupported(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0],
                               "unknown_parameter")
        _check_neutral(body)
        req = _sampling(body, llm.options)
        if chat:
            if "messages" not in body:
                raise _bad("'messages' is required", "messages", "missing_required_parameter")
            msgs = _messages(body["messages"])
            tools, choice = _tools(body)
            shown = tools if choice != "none" else []
            try:
                prompt = llm.render_chat(msgs, tools=shown)
            except ValueError as e:
                raise _bad(str(e), "messages") from None
            ids = self._encode(prompt, "messages", add_special_tokens=False)     # the format holds them
            req["stop"] = list(_ROLE_STOPS) + req["stop"]
            req["json_schema"] = _response_format(body.get("response_format"))
            req["tools"], req["thinking"] = shown, prompt.rstrip().endswith("<think>")
            if choice not in ("auto", "none"):
                if req["json_schema"] is not None:
                    raise _bad("'response_format' and a required tool call exclude each other", "response_format")
                forced = [t for t in tools if choice == "required" or t.name == choice]
                req["grammar"] = call_grammar(forced, several=choice == "required" and
                                              body.get("parallel_tool_calls") is not False,
                                              tags=llm.special_token_ids())
        else:
            if "prompt" not in body:
                raise _bad("'prompt' is required", "prompt", "missing_required_parameter")
            ids = self._prompt_ids(body["prompt"])
        self._fit(req, ids, "messages" if chat else "prompt")
        self._generate(req, lambda created: _OpenAIEncoder(chat, srv.model_id, req, created))

    def _messages(self, body: dict, count: bool):
        """Anthropic's POST /v1/messages (and its count_tokens)."""
        srv = self.server
        try:
            if count:
                ids = self._encode(count_request(body, srv.llm), "messages", add_special_tokens=False)
                self._send_json(200, {"input_tokens": len(ids)}, {"x-request-id": self.request_id})
                return
            req = parse_messages(body, srv.llm, _ROLE_STOPS)
        except MessagesError as e:
            raise _bad(str(e)) from None
        self._fit(req, self._encode(req["prompt"], "messages", add_special_tokens=False), "messages")
        self._generate(req, lambda created: MessagesEncoder(srv.model_id, req, created))

    def _fit(self, req: dict, ids, param: str):
        """req["max_tokens"] (None: the engine's default, clipped to the room left) checked against
        the context the prompt ``ids`` leave; sets req["ids"]. ``param``: the prompt's field."""
        srv = self.server
        llm = srv.llm
        n = len(ids)
        room = srv.context - n - srv.draft_room
        limit = srv.context - srv.draft_room
        if room < 1:
            raise _bad(f"the prompt is {n} tokens long, which leaves no room in this model's context of "
                       f"{srv.context} positions ({srv.draft_room} of them reserved for speculative drafts: a "
                       f"prompt may have at most {limit - 1} tokens)",
                       param, "context_length_exceeded")
        max_tokens = req["max_tokens"]
        if max_tokens is None:
            max_tokens = min(llm.options.max_tokens, room)
        elif max_tokens > room:
            raise _bad(f"'{req['max_tokens_param']}' is too large: the prompt ({n} tokens) + {max_tokens} "
                       f"completion tokens + {srv.draft_room} positions for speculative drafts = "
                       f"{n + max_tokens + srv.draft_room} exceed this model's context of {srv.context} positions; "
                       f"at most {room} completion tokens fit after this prompt", req["max_tokens_param"],
                       "context_length_exceeded")
        req["max_tokens"], req["ids"] = max_tokens, ids

    def _encode(self, text: str, param: str, add_special_tokens: bool = True):
        try:
            ids = self.server.llm.encode(text, add_special_tokens=add_special_tokens)
        except ValueError as e:
            raise _bad(str(e), param) from None
        if not ids:
            raise _bad("the prompt encodes to no tokens", param)
        return ids

    def _prompt_ids(self, prompt):
        vocab = self.server.llm.cfg.vocab
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]               # a batch of one
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise _unsupported("a batch of several prompts is not supported: send one prompt per request",
                               "prompt", "unsupported_value")
        if isinstance(prompt, str):
            return self._encode(prompt, "prompt")
        if not isinstance(prompt, list) or not prompt or not all(_is_int(t) for t in prompt):
            raise _bad("'prompt' must be a string or a non-empty list of token ids", "prompt", "invalid_type")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise _bad(f"token id {bad[0]} in 'prompt' is outside the vocabulary [0, {vocab})", "prompt")
        return list(prompt)

    def _generate(self, req: dict, encoder):
        """Generate for a validated request; ``encoder(created)`` makes the object that writes the
        answer in the endpoint's shapes (response, begin/text/end stream events, error event)."""
        srv = self.server
        ticket = _Ticket()
        kw = dict(max_tokens=req["max_tokens"], temperature=req["temperature"], top_p=req["top_p"],
                  top_k=req["top_k"], repeat_penalty=req["repeat_penalty"],
                  frequency_penalty=req["frequency_penalty"], presence_penalty=req["presence_penalty"],
                  seed=req["seed"], stop=req["stop"], cancel=ticket.cancel,
                  json_schema=req.get("json_schema"), grammar=req.get("grammar"))
        waited = srv.scheduler.acquire(ticket)           # 429 / 503 raised here, before any header
        enc = encoder(int(time.time()))
        headers = {"x-request-id": self.request_id, "x-colibri-queue-wait-ms": str(int(waited * 1000))}
        if _client_gone(self.connection):                # left while it waited: nothing to generate
            srv.scheduler.release(ticket, True, cancelled=True)
            self.close_connection = True
            return
        if req["stream"]:
            self._stream(req, enc, ticket, headers, kw)
            return
        ok, error = False, None
        watch = _Writer(self, ticket.cancel, chunked=False)          # watches the connection
        try:
            watch.start()
            result = srv.llm.complete(req["ids"], **kw)
            if ticket.shutdown:
                error = _closed_error()
            else:
                payload = enc.response(result)
                ok = True
        except ValueError as e:                          # only the engine could tell
            error = _bad(str(e))
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            error = ApiError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error",
                             code="internal_error")
        finally:
            watch.finish(1.0)
            srv.scheduler.release(ticket, ok, cancelled=watch.failed)
        if watch.failed:                # the client has gone (or half-closed): no truncated answer
            self.close_connection = True
            return
        if error is not None:
            raise error
        self._send_json(200, payload, headers)

    def _stream(self, req, enc, ticket, headers, kw):
        srv = self.server
        chunked = self.request_version == "HTTP/1.1"
        writer = _Writer(self, ticket.cancel, chunked)

        def put(events):
            for e in events:
                writer.put(e)
        ok, result = False, None
        try:
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("X-Accel-Buffering", "no")
                for k, v in headers.items():
                    self.send_header(k, v)
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
            except OSError:
                ticket.cancel.set()
                writer.failed = True
            writer.start()
            put(enc.begin())
            try:
                result = srv.llm.complete(req["ids"], on_text=lambda piece: put(enc.text(piece)), **kw)
                if ticket.shutdown:
                    writer.put(enc.error(_closed_error()))
                else:
                    ok = True
            except Exception as e:
                if not isinstance(e, ValueError):
                    traceback.print_exc(file=sys.stderr)
                err = ApiError(400, str(e)) if isinstance(e, ValueError) else \
                    ApiError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error",
                             code="internal_error")
                writer.put(enc.error(err))
        finally:
            srv.scheduler.release(ticket, ok, cancelled=writer.failed)
        if ok:
            put(enc.end(result))
        else:
            self.close_connection = True
        writer.put(_END)
        writer.finish(srv.client_timeout + 5)
        if writer.failed:
            self.close_connection = True


class _OpenAIEncoder:
    """OpenAI's shapes of one answer: the response object, and the stream's chunks (a chat's tool
    calls and reasoning split out of the text by colibri.tools.ReplyStream)."""

    def __init__(self, chat: bool, model: str, req: dict, created: int):
        self.chat, self.model, self.req, self.created = chat, model, req, created
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.usage_null = {"usage": None} if req["include_usage"] else {}
        parse = chat and (req.get("tools") or req.get("thinking"))
        self.split = ReplyStream(req.get("tools") or [], req.get("thinking", False)) if parse else None
        self.calls = 0

    def response(self, c) -> dict:
        return _response(self.chat, self.id, self.created, self.model, c, self.req)

    def _chunk(self, piece=None, finish=None, delta=None) -> bytes:
        if self.chat:
            if delta is None:
                delta = {} if piece is None else {"content": piece}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
        return _sse({"id": self.id, "object": self.obj, "created": self.created, "model": self.model,
                     "choices": [choice], **self.usage_null})

    def begin(self) -> list:
        return [self._chunk(delta={"role": "assistant", "content": ""})] if self.chat else []

    def _events(self, events) -> list:
        out = []
        for kind, v in events:
            if kind == "call":
                out.append(self._chunk(delta={"tool_calls": [_openai_call(v, self.calls)]}))
                self.calls += 1
            else:
                out.append(self._chunk(delta={"reasoning_content" if kind == "reasoning" else "content": v}))
        return out

    def text(self, piece: str) -> list:
        return [self._chunk(piece)] if self.split is None else self._events(self.split.feed(piece))

    def end(self, c) -> list:
        out = self._events(self.split.finish()) if self.split is not None else []
        out.append(self._chunk(finish="tool_calls" if self.calls else c.finish_reason))
        if self.req["include_usage"]:
            out.append(_sse({"id": self.id, "object": self.obj, "created": self.created, "model": self.model,
                             "choices": [], "usage": _usage(c)}))
        return out + [b"data: [DONE]\n\n"]

    def error(self, err: "ApiError") -> bytes:
        return _sse(err.body())


def _usage(c) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": max(c.prompt_tokens - c.prefill_tokens, 0)}}


def _openai_call(call, index=None) -> dict:
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    return out if index is None else {"index": index, **out}


def _response(chat: bool, cid: str, created: int, model: str, c, req=None) -> dict:
    if chat:
        message = {"role": "assistant", "content": c.text, "refusal": None}
        finish = c.finish_reason
        if req and (req.get("tools") or req.get("thinking")):
            reasoning, content, calls = parse_reply(c.text, req.get("tools") or [])
            message["content"] = content if content or not calls else None
            if reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [_openai_call(k) for k in calls]
                finish = "tool_calls"
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
    return {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": _usage(c)}


# -- the server ----------------------------------------------------------------------------------

class OpenAIServer(ThreadingHTTPServer):
    """The HTTP server (one thread per connection). ``port`` is the bound port; ``shutdown()``
    stops it: no new requests, waiting ones get 503, the running generation may finish within
    ``grace`` seconds and is cancelled after that."""
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, llm, host, port, scheduler: Scheduler, api_key=None, model_id=None, access_log=False,
                 client_timeout=CLIENT_TIMEOUT):
        from .session import draft_room
        self.llm, self.scheduler, self.api_key = llm, scheduler, api_key or None
        self.model_id = model_id or model_id_for(llm.path)
        self.access_log, self.client_timeout = access_log, client_timeout
        self.created = int(time.time())
        self.context = llm.context
        self.draft_room = draft_room(llm.options.draft)      # positions a generation's drafts may use
        self._serving = threading.Event()
        self._stopped = False
        if ":" in host and not host.startswith("["):
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def serve_forever(self, poll_interval=0.2):
        self._serving.set()
        try:
            super().serve_forever(poll_interval)
        finally:
            self._serving.clear()

    def shutdown(self, grace: float = 5.0):
        if self._stopped:
            return
        self._stopped = True
        self.scheduler.close()
        if self._serving.is_set():
            super().shutdown()
        if not self.scheduler.wait_idle(grace):
            self.scheduler.cancel_active()
            self.scheduler.wait_idle(max(grace, 5.0))
        self.server_close()

    def handle_error(self, request, client_address):
        # a connection-level failure outside our handler's own catch (e.g. reset while reading
        # the request line): one line, not a traceback per dropped client
        e = sys.exc_info()[1]
        if not isinstance(e, (ConnectionError, socket.timeout)):
            super().handle_error(request, client_address)


def model_id_for(path) -> str:
    from .models import DEFAULT_MODEL_DIR
    path = os.path.abspath(os.fspath(path))
    if os.path.realpath(path) == os.path.realpath(DEFAULT_MODEL_DIR):
        return DEFAULT_MODEL_ID
    return os.path.basename(os.path.normpath(path)) or path


def make_server(llm, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 4, queue_timeout: float = 30.0,
                api_key: Optional[str] = None, model_id: Optional[str] = None, access_log: bool = False,
                client_timeout: float = CLIENT_TIMEOUT) -> OpenAIServer:
    """An OpenAI-compatible server for ``llm`` bound to ``host:port`` (0 = a free port, see
    ``.port``); run it with ``.serve_forever()`` (e.g. in a thread), stop it with ``.shutdown()``."""
    if not _is_int(port) or not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port!r}")
    if api_key is not None and not isinstance(api_key, str):
        raise ValueError("api_key must be a string")
    return OpenAIServer(llm, host, port, Scheduler(max_queue, queue_timeout), api_key=api_key,
                        model_id=model_id, access_log=access_log, client_timeout=client_timeout)


# -- command line --------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser):
    """The options of ``python -m colibri serve``: the server's own, then every colibri.options
    setting (a setting left out comes from its ``COLIBRI_*`` environment variable, then the
    default; max_tokens, temperature and top_p are the defaults of requests that set none)."""
    from .options import add_arguments as add_options
    p.add_argument("--model", "-m", default=None,
                   help="model directory (default: COLIBRI_MODEL, else the embedded default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument("--max-queue", type=int, default=4, metavar="N",
                   help="requests that may wait for the model while it generates; more get HTTP 429 (default 4)")
    p.add_argument("--queue-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a request may wait for the model before HTTP 429 (default 30)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (default: the COLIBRI_API_KEY environment variable; "
                        "none = no authentication)")
    p.add_argument("--access-log", action="store_true", help="print one line per HTTP request on stderr")
    add_options(p, skip=("json_schema", "grammar"))      # a request constrains its own output


def run(args) -> int:
    """Load the model, serve until SIGINT/SIGTERM, shut down cleanly. Returns the exit status."""
    from .api import load
    from .options import env_get, from_args
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not (args.queue_timeout > 0 and math.isfinite(args.queue_timeout)):
        raise ValueError(f"--queue-timeout must be > 0 seconds, got {args.queue_timeout}")
    api_key = args.api_key if args.api_key is not None else env_get(os.environ, "API_KEY")
    api_key = api_key or None
    options = from_args(args)
    t0 = time.perf_counter()
    llm = load(args.model, options)
    for note in llm.model_notes():
        print(f"[colibri serve] {note}", file=sys.stderr, flush=True)
    try:
        server = make_server(llm, args.host, args.port, args.max_queue, args.queue_timeout, api_key,
                             access_log=args.access_log)
    except BaseException:
        llm.close()
        raise
    stop = threading.Event()
    received = []

    def on_signal(signum, frame):
        received.append(signum)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    th = threading.Thread(target=server.serve_forever, name="colibri-serve", daemon=True)
    th.start()
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"[colibri serve] {server.model_id} ({llm.path}) loaded in {time.perf_counter() - t0:.2f}s, context "
          f"{llm.context}; serving on http://{host}:{server.port}/v1 (max_queue {args.max_queue}, queue_timeout "
          f"{args.queue_timeout:g}s, {'API key required' if api_key else 'no API key'})", file=sys.stderr, flush=True)
    if not api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"[colibri serve] warning: listening on {args.host} without an API key: anyone who can reach "
              "this port can use the model (set --api-key or COLIBRI_API_KEY)", file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.5):
            if not th.is_alive():
                break
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        print("[colibri serve] shutting down", file=sys.stderr, flush=True)
        server.shutdown()
        th.join(10)
        if server.scheduler.wait_idle(0):
            llm.close()
        h = server.scheduler.snapshot()
        print(f"[colibri serve] stopped: {h['completed']} completed, {h['rejected']} rejected, {h['errors']} errors",
              file=sys.stderr, flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m colibri serve",
                                description="OpenAI-compatible HTTP server over one colibri model.")
    add_arguments(p)
    args = p.parse_args(argv)
    from .config import ConfigError
    try:
        return run(args)
    except (ConfigError, ValueError, OSError, RuntimeError) as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
