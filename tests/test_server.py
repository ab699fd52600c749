"""The OpenAI-compatible server (colibri/server.py) over the embedded default model, in-process on
localhost: the official ``openai`` client, raw HTTP/SSE, bad requests, the queue under load,
client disconnects, and ``serve`` as a process stopped with SIGTERM."""
import contextlib
import http.client
import json
import os
import pathlib
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import openai
import pytest

import colibri

REPO = pathlib.Path(__file__).resolve().parent.parent
MODEL = "colibri-default"
CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Write a function that adds two numbers."}]


from colibri import server as srv  # noqa: E402



@pytest.fixture(scope="module")
def llm():
    m = colibri.load(temperature=0)
    yield m
    m.close()


@contextlib.contextmanager
def serving(llm, **kw):
    kw = {"max_queue": 4, "queue_timeout": 30, "api_key": None, **kw}
    s = srv.make_server(llm, "127.0.0.1", 0, kw.pop("max_queue"), kw.pop("queue_timeout"), kw.pop("api_key"), **kw)
    th = threading.Thread(target=s.serve_forever, daemon=True)
    th.start()
    try:
        yield s
    finally:
        s.shutdown()
        th.join(10)
        assert not th.is_alive()


@pytest.fixture(scope="module")
def server(llm):
    with serving(llm) as s:
        yield s


def client(s, key="unused"):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key=key, max_retries=0, timeout=60)


def call(s, method, path, body=None, headers=None, raw=None):
    """(status, headers, parsed JSON body) of one request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        h = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        payload = r.read()
        ctype = r.getheader("Content-Type", "")
        return r.status, r, (json.loads(payload) if ctype.startswith("application/json") else payload)
    finally:
        conn.close()


def health(s):
    status, _, h = call(s, "GET", "/health")
    assert status == 200
    return h


def assert_error(body, status_type="invalid_request_error", param=None, code=None):
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and len(err["message"]) > 10
    assert err["type"] == status_type
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# -- the official client -----------------------------------------------------------------------

def test_models(server):
    c = client(server)
    models = c.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "colibri"
    assert c.models.retrieve(MODEL).id == MODEL
    status, _, body = call(server, "GET", "/v1/models/nope")
    assert status == 404
    assert_error(body, code="model_not_found")


def test_chat_greedy_matches_the_api(server, llm):
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].index == 0
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str) and msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert msg.content == llm.chat(CHAT, max_tokens=24, temperature=0)
    u = r.usage
    assert u.prompt_tokens == len(llm.encode(llm.render_chat(CHAT)))
    assert 1 <= u.completion_tokens <= 24 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    # max_completion_tokens is the newer name of max_tokens
    r2 = c.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=24, temperature=0)
    assert r2.choices[0].message.content == msg.content


def test_chat_completions_render_the_model_template(tmp_path):
    """/v1/chat/completions prompts are the model's own template (chat_template.jinja), tokenized
    without the tokenizer's own special tokens (this tokenizer.json adds <|endoftext|> to every
    encoding); a template that rejects the conversation is a 400 naming the file."""
    from conftest import GLM_STYLE_TEMPLATE, model_folder, tokenizer_json_adding_endoftext
    template = ("{% if messages[0].role == 'assistant' %}{{ raise_exception('start with a user turn') }}{% endif %}"
                + GLM_STYLE_TEMPLATE)
    d = model_folder(tmp_path, {"chat_template.jinja": template, "tokenizer.json": tokenizer_json_adding_endoftext()})
    m = colibri.load(str(d), temperature=0)
    try:
        prompt = ("[gMASK]<sop><|system|>You write Python.<|user|>Write a function that adds two numbers."
                  "<|assistant|><think>")
        assert m.render_chat(CHAT) == prompt
        ids = m.encode(prompt, add_special_tokens=False)
        assert len(m.encode(prompt)) == len(ids) + 1
        with serving(m) as s:
            r = client(s).chat.completions.create(model="model", messages=CHAT, max_tokens=6, temperature=0)
            assert r.usage.prompt_tokens == len(ids)
            assert m.history[:len(ids)] == ids                  # the prompt the engine ran
            want = m.complete(ids, max_tokens=6, stop=list(srv._ROLE_STOPS)).text
            assert r.choices[0].message.content == want
            status, _, body = call(s, "POST", "/v1/chat/completions",
                                   {"messages": [{"role": "assistant", "content": "hi"}], "max_tokens": 2})
            assert status == 400
            err = assert_error(body, param="messages")
            assert err["message"] == (f"{d / 'chat_template.jinja'}: the chat template rejects this conversation: "
                                      "start with a user turn")
    finally:
        m.close()


def test_chat_stream_equals_the_plain_answer(server):
    c = client(server)
    kw = dict(model=MODEL, messages=CHAT, max_tokens=40, temperature=0)
    plain = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    # without include_usage: no usage chunk
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert all(ch.choices for ch in chunks)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == plain.choices[0].message.content


def test_legacy_completion_equals_generate(server, llm):
    c = client(server)
    prompt = "def fibonacci(n):"
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == llm.generate(prompt, max_tokens=20, temperature=0)
    assert r.usage.prompt_tokens == len(llm.encode(prompt))
    ids = llm.encode("class Stack:")
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, stop=["\n\n"])
    assert r.choices[0].text == llm.generate(ids, max_tokens=12, temperature=0, stop=["\n\n"])
    assert "\n\n" not in r.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in
                       c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True))
    assert streamed == llm.generate(prompt, max_tokens=20, temperature=0)


def test_sampling_with_a_seed_is_reproducible():
    # with --draft auto the draft depth follows measured timings, and a sampled speculative step
    # draws from the RNG according to the depth: a seed reproduces a sample only at a fixed depth
    fixed = colibri.load(draft=0)
    try:
        with serving(fixed) as s:
            c = client(s)
            kw = dict(model=MODEL, prompt="import os\n", max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
            first = c.completions.create(**kw).choices[0].text
            assert c.completions.create(**kw).choices[0].text == first
            assert first == fixed.generate("import os\n", max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    finally:
        fixed.close()


def test_top_k_and_penalties_reach_the_sampler(server, llm):
    """top_k 1 at temperature 1.5 is greedy; the penalties give what LLM.complete gives with them
    (OpenAI's client sends the non-OpenAI fields through extra_body)."""
    c = client(server)
    prompt = "def fibonacci(n):"
    greedy = llm.generate(prompt, max_tokens=16, temperature=0)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.5, extra_body={"top_k": 1})
    assert r.choices[0].text == greedy
    pen = dict(frequency_penalty=1.5, presence_penalty=0.5)
    want = llm.generate(prompt, max_tokens=16, temperature=0, repeat_penalty=1.8, **pen)
    assert want != greedy
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, **pen,
                             extra_body={"repetition_penalty": 1.8})
    assert r.choices[0].text == want


def test_kv_reuse_is_reported_as_cached_tokens(server):
    c = client(server)
    first = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    again = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    turn2 = CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "Now subtract them."}]
    other = c.completions.create(model=MODEL, prompt="x = 1", max_tokens=4, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens == 0            # a different prompt
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    r = c.chat.completions.create(model=MODEL, messages=turn2, max_tokens=8, temperature=0)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < r.usage.prompt_tokens                              # the conversation so far


# -- bad requests ------------------------------------------------------------------------------

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _with(**kw):
    return {**OK_CHAT, **kw}


BAD = [
    # (name, path, body or raw bytes, status, param, code, words in the message)
    ("malformed json", CHAT_PATH, b'{"model": "colibri-default", "messages": [', 400, None, "invalid_json", "JSON"),
    ("not an object", CHAT_PATH, b"[1, 2]", 400, None, "invalid_json", "object"),
    ("empty body", CHAT_PATH, b"", 400, None, "invalid_json", "empty"),
    ("NaN", CHAT_PATH, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, None,
     "invalid_json", "NaN"),
    ("temperature hot", CHAT_PATH, _with(temperature="hot"), 400, "temperature", None, "temperature"),
    ("temperature 3", CHAT_PATH, _with(temperature=3), 400, "temperature", None, "[0, 2]"),
    ("top_p 0", CHAT_PATH, _with(top_p=0), 400, "top_p", None, "top_p"),
    ("max_tokens -1", CHAT_PATH, _with(max_tokens=-1), 400, "max_tokens", None, ">= 1"),
    ("max_tokens float", CHAT_PATH, _with(max_tokens=2.5), 400, "max_tokens", None, "integer"),
    ("max_tokens bool", CHAT_PATH, _with(max_tokens=True), 400, "max_tokens", None, "integer"),
    ("huge max_tokens", CHAT_PATH, _with(max_tokens=10 ** 12), 400, "max_tokens", "context_length_exceeded",
     "context"),
    ("max_tokens = context", CHAT_PATH, _with(max_tokens=2048), 400, "max_tokens", "context_length_exceeded",
     "context"),
    ("messages not a list", CHAT_PATH, _with(messages="hi"), 400, "messages", None, "list"),
    ("messages empty", CHAT_PATH, _with(messages=[]), 400, "messages", None, "non-empty"),
    ("messages missing", CHAT_PATH, {"model": MODEL}, 400, "messages", None, "required"),
    ("bad role", CHAT_PATH, _with(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", None,
     "role"),
    ("content not text", CHAT_PATH, _with(messages=[{"role": "user", "content": 7}]), 400, "messages[0].content",
     None, "string"),
    ("image part", CHAT_PATH, _with(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]),
     400, "messages[0].content[1]", "unsupported_content_type", "image_url"),
    ("tool_calls on a user message", CHAT_PATH, _with(messages=[{"role": "user", "content": "1", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400,
     "messages[0].tool_calls", None, "assistant"),
    ("tool call arguments not JSON", CHAT_PATH, _with(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]), 400,
     "messages[0].tool_calls[0].function.arguments", None, "JSON"),
    ("tools not a list", CHAT_PATH, _with(tools={"type": "function"}), 400, "tools", None, "list"),
    ("tool without a name", CHAT_PATH, _with(tools=[{"type": "function", "function": {"parameters": {}}}]), 400,
     "tools[0].function.name", None, "name"),
    ("tool with a bad schema", CHAT_PATH, _with(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]), 400,
     "tools[0].function.parameters", None, "schema"),
    ("two tools of one name", CHAT_PATH, _with(tools=[{"type": "function", "function": {"name": "f"}}] * 2), 400,
     "tools[1].name", None, "two tools"),
    ("tool_choice of no tool", CHAT_PATH, _with(tools=[{"type": "function", "function": {"name": "f"}}],
                                                 tool_choice={"type": "function", "function": {"name": "g"}}),
     400, "tool_choice", None, "not in 'tools'"),
    ("tool_choice required without tools", CHAT_PATH, _with(tool_choice="required"), 400, "tool_choice", None,
     "empty"),
    ("tool_choice bad", CHAT_PATH, _with(tool_choice="sometimes"), 400, "tool_choice", None, "auto, none"),
    ("functions", CHAT_PATH, _with(functions=[{"name": "f"}]), 400, "functions", None, "function"),
    ("n=2", CHAT_PATH, _with(n=2), 400, "n", "unsupported_value", "one choice"),
    ("logprobs", CHAT_PATH, _with(logprobs=True), 400, "logprobs", None, "log probabilities"),
    ("top_logprobs", CHAT_PATH, _with(top_logprobs=3), 400, "top_logprobs", None, "log probabilities"),
    ("response_format type", CHAT_PATH, _with(response_format={"type": "xml"}), 400, "response_format.type", None,
     "json_schema"),
    ("response_format bad schema", CHAT_PATH, _with(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}), 400, "response_format.json_schema.schema", None, "schema"),
    ("penalty out of range", CHAT_PATH, _with(presence_penalty=2.5), 400, "presence_penalty", None, "[-2, 2]"),
    ("frequency penalty type", CHAT_PATH, _with(frequency_penalty="a"), 400, "frequency_penalty", None, "number"),
    ("repetition penalty 0", CHAT_PATH, _with(repetition_penalty=0), 400, "repetition_penalty", None, "(0, 10]"),
    ("two repetition penalties", CHAT_PATH, _with(repetition_penalty=1.1, repeat_penalty=1.2), 400,
     "repeat_penalty", None, "not both"),
    ("top_k float", CHAT_PATH, _with(top_k=2.5), 400, "top_k", None, "integer"),
    ("unknown field", CHAT_PATH, _with(frobnicate=1), 400, "frobnicate", "unknown_parameter", "frobnicate"),
    ("stop type", CHAT_PATH, _with(stop=[1, 2]), 400, "stop", None, "stop"),
    ("stream type", CHAT_PATH, _with(stream="yes"), 400, "stream", None, "boolean"),
    ("stream_options without stream", CHAT_PATH, _with(stream_options={"include_usage": True}), 400,
     "stream_options", None, "stream"),
    ("seed type", CHAT_PATH, _with(seed="42"), 400, "seed", None, "integer"),
    ("chat prompt too long", CHAT_PATH, _with(messages=[{"role": "user", "content": "x = 1\n" * 3000}]), 400,
     "messages", "context_length_exceeded", "context"),
    ("prompt ids too long", COMPLETIONS_PATH, {"model": MODEL, "prompt": [5] * 2100, "max_tokens": 4}, 400,
     "prompt", "context_length_exceeded", "context"),
    ("prompt ids outside the vocabulary", COMPLETIONS_PATH, {"model": MODEL, "prompt": [1, 999999]}, 400,
     "prompt", None, "vocabulary"),
    ("prompt type", COMPLETIONS_PATH, {"model": MODEL, "prompt": {"text": "x"}}, 400, "prompt", None, "prompt"),
    ("prompt batch", COMPLETIONS_PATH, {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", None, "batch"),
    ("echo", COMPLETIONS_PATH, {"model": MODEL, "prompt": "a", "echo": True}, 400, "echo", None, "echo"),
    ("legacy logprobs", COMPLETIONS_PATH, {"model": MODEL, "prompt": "a", "logprobs": 2}, 400, "logprobs", None,
     "log probabilities"),
    ("legacy logprobs 0", COMPLETIONS_PATH, {"model": MODEL, "prompt": "a", "logprobs": 0}, 400, "logprobs", None,
     "log probabilities"),
    ("store", CHAT_PATH, _with(store=True), 400, "store", None, "store"),
    ("deep JSON", CHAT_PATH, b"[" * 100000 + b"]" * 100000, 400, None, "invalid_json", "JSON"),
    ("best_of", COMPLETIONS_PATH, {"model": MODEL, "prompt": "a", "best_of": 3}, 400, "best_of", None, "best_of"),
    ("unknown model", CHAT_PATH, _with(model="gpt-4o"), 404, "model", "model_not_found", "gpt-4o"),
    ("model type", CHAT_PATH, _with(model=3), 400, "model", None, "string"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_requests(server, case):
    _, path, body, status, param, code, words = case
    before = health(server)
    raw = body if isinstance(body, bytes) else None
    got, resp, payload = call(server, "POST", path, body=None if raw is not None else body, raw=raw)
    assert got == status, payload
    err = assert_error(payload, param=param, code=code)
    assert words.lower() in err["message"].lower(), err["message"]
    assert resp.getheader("x-request-id", "").startswith("req_")
    after = health(server)
    assert after["requests"] == before["requests"]          # refused before the queue


def test_bad_paths_and_methods(server):
    status, _, body = call(server, "GET", "/v1/nothing")
    assert status == 404
    assert "/v1/nothing" in assert_error(body, code="not_found")["message"]
    status, _, body = call(server, "POST", "/v2/chat/completions", body=OK_CHAT)
    assert status == 404
    status, resp, body = call(server, "GET", CHAT_PATH)
    assert status == 405 and resp.getheader("Allow") == "POST"
    assert_error(body, code="method_not_allowed")
    status, _, body = call(server, "BREW", "/v1/models")     # http.server's own error, in OpenAI's shape
    assert status == 501
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status, _, body = call(server, "POST", CHAT_PATH, raw=b"x" * 10, headers={"Content-Length": "99999999"})
    assert status == 413
    # the server still answers
    assert call(server, "POST", CHAT_PATH, body=OK_CHAT)[0] == 200


def test_api_key(llm):
    with serving(llm, api_key="sekret") as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            status, resp, body = call(s, "POST", CHAT_PATH, body=OK_CHAT, headers=headers)
            assert status == 401
            assert "api key" in assert_error(body, code="invalid_api_key")["message"].lower()
        assert call(s, "GET", "/v1/models")[0] == 401
        assert call(s, "GET", "/health")[0] == 200                   # health needs no key
        with pytest.raises(openai.AuthenticationError):
            client(s, "wrong").models.list()
        assert client(s, "sekret").models.list().data[0].id == MODEL
        r = client(s, "sekret").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
        assert r.choices[0].message.content is not None
        assert health(s)["requests"] == 1                            # 401s never reach the queue


# -- SSE on the wire ---------------------------------------------------------------------------

def test_sse_raw(server, llm):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 20, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    conn.request("POST", COMPLETIONS_PATH, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.getheader("Content-Type").startswith("text/event-stream")
    assert r.getheader("Cache-Control") == "no-cache"
    lines = r.read().decode().split("\n")
    events = [ln for ln in lines if ln]
    assert all(ln.startswith("data: ") for ln in events)
    assert events[-1] == "data: [DONE]"
    assert lines[-2:] == ["", ""]                                    # each event ends with a blank line
    chunks = [json.loads(ln[len("data: "):]) for ln in events[:-1]]
    assert all(ch["object"] == "text_completion" for ch in chunks)
    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
    assert text == llm.generate("def fibonacci(n):", max_tokens=20, temperature=0)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    # the connection is reusable after a stream (chunked transfer encoding, keep-alive)
    conn.request("GET", "/health")
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    conn.close()


class _Spy:
    """The LLM, with the Completion of every request recorded."""

    def __init__(self, llm):
        self._llm, self.results = llm, []

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def complete(self, *a, **kw):
        c = self._llm.complete(*a, **kw)
        self.results.append(c)
        return c


def test_disconnect_mid_stream_stops_the_generation(llm):
    spy = _Spy(llm)
    with serving(spy) as s:
        body = json.dumps({"model": MODEL, "prompt": "def fib(n):", "max_tokens": 1500, "temperature": 0,
                           "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        while b"data: " not in seen:
            part = sock.recv(4096)
            assert part, "the server closed the stream early"
            seen += part
        assert b"text/event-stream" in seen
        sock.close()
        t0 = time.monotonic()
        r = client(s).completions.create(model=MODEL, prompt="x = 1", max_tokens=4, temperature=0)
        assert r.choices[0].text is not None and time.monotonic() - t0 < 30
        cancelled, nxt = spy.results
        assert cancelled.completion_tokens < 1500                   # cut short by the disconnect
        assert nxt.completion_tokens >= 1
        h = health(s)
        assert h["cancelled"] == 1 and h["completed"] == 2 and h["errors"] == 0
        assert h["active"] == h["queued"] == 0


# -- the queue ---------------------------------------------------------------------------------

def _wait_for(s, **want):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        h = health(s)
        if all(h[k] == v for k, v in want.items()):
            return h
        time.sleep(0.01)
    raise AssertionError(f"health never reached {want}: {h}")


def test_queue_full_and_queue_timeout_answer_429_before_streaming(llm):
    with serving(llm, max_queue=1, queue_timeout=2.0) as s:
        results = {}

        def send(name, body):
            results[name] = call(s, "POST", COMPLETIONS_PATH, body=body)

        base = {"model": MODEL, "prompt": "def f():", "max_tokens": 4}
        with llm.lock:                                   # the model is busy: A holds it, waiting on the lock
            a = threading.Thread(target=send, args=("a", base))
            a.start()
            _wait_for(s, active=1, queued=0)
            b = threading.Thread(target=send, args=("b", {**base, "stream": True}))
            b.start()
            _wait_for(s, queued=1)
            status, resp, body = call(s, "POST", COMPLETIONS_PATH, body={**base, "stream": True})   # C
            assert status == 429 and resp.getheader("Content-Type") == "application/json"
            assert resp.getheader("Retry-After") == "1"
            assert_error(body, "rate_limit_exceeded", code="queue_full")
            b.join(20)
            assert not b.is_alive()
            status, resp, body = results["b"]
            assert status == 429 and resp.getheader("Content-Type") == "application/json"
            assert_error(body, "rate_limit_exceeded", code="queue_timeout")
            assert a.is_alive()
        a.join(20)
        assert results["a"][0] == 200 and results["a"][2]["choices"][0]["text"] is not None
        h = health(s)
        assert (h["requests"], h["completed"], h["rejected"], h["errors"], h["active"], h["queued"]) == (3, 1, 2, 0, 0, 0)
        with llm.lock:                                   # the official client sees the 429 as such
            a = threading.Thread(target=send, args=("a", base))
            a.start()
            _wait_for(s, active=1)
            b = threading.Thread(target=send, args=("b", base))
            b.start()
            _wait_for(s, queued=1)
            with pytest.raises(openai.RateLimitError) as e:
                client(s).completions.create(**base)
            assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        a.join(20)
        b.join(20)
        assert results["a"][0] == results["b"][0] == 200


def test_load_200_requests_from_8_clients(llm):
    n_clients, per_client = 8, 25
    with serving(llm, max_queue=4, queue_timeout=30) as s:
        warm = client(s)
        for i in range(10):                               # first-use allocations out of the RSS figure
            warm.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6)
        base = health(s)
        rss0 = rss_bytes()
        outcomes, failures = [], []
        lock = threading.Lock()

        def worker(k):
            c = client(s)
            for i in range(per_client):
                kind = (k + i) % 3
                try:
                    if kind == 0:
                        r = c.chat.completions.create(model=MODEL, messages=[
                            {"role": "user", "content": f"Write function number {k}-{i}."}], max_tokens=6)
                        text, usage = r.choices[0].message.content, r.usage
                    elif kind == 1:
                        r = c.completions.create(model=MODEL, prompt=f"def f_{k}_{i}(x):", max_tokens=5,
                                                 temperature=0.8, seed=i)
                        text, usage = r.choices[0].text, r.usage
                    else:
                        chunks = list(c.completions.create(model=MODEL, prompt=f"x_{k} = {i}", max_tokens=4,
                                                           stream=True, stream_options={"include_usage": True}))
                        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
                        usage = chunks[-1].usage
                    ok = isinstance(text, str) and 1 <= usage.completion_tokens <= 6 and \
                        usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
                    with lock:
                        outcomes.append("ok" if ok else "malformed")
                except openai.RateLimitError as e:
                    ok = e.status_code == 429 and e.body["type"] == "rate_limit_exceeded" and \
                        e.body["code"] in ("queue_full", "queue_timeout")
                    with lock:
                        outcomes.append("429" if ok else "malformed 429")
                except Exception as e:                     # noqa: BLE001 - recorded, asserted below
                    with lock:
                        failures.append(repr(e))

        threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(n_clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "deadlock: a client never got its answer"
        elapsed = time.monotonic() - t0
        assert failures == []
        assert len(outcomes) == n_clients * per_client
        assert set(outcomes) <= {"ok", "429"}, outcomes
        assert outcomes.count("ok") >= n_clients                  # the queue does serve
        h = health(s)
        sent = n_clients * per_client
        assert h["requests"] - base["requests"] == sent
        assert (h["completed"] - base["completed"]) + (h["rejected"] - base["rejected"]) + \
            (h["errors"] - base["errors"]) == sent
        assert h["errors"] == 0 and h["active"] == 0 and h["queued"] == 0
        assert h["completed"] - base["completed"] == outcomes.count("ok")
        assert h["rejected"] - base["rejected"] == outcomes.count("429")
        grown = rss_bytes() - rss0
        assert grown < 50 << 20, f"RSS grew by {grown / 2**20:.1f} MB over {sent} requests ({elapsed:.1f}s)"
        # and it still answers
        assert warm.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1


# -- the command -------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_process_stops_cleanly_on_a_signal(tmp_path, sig):
    env = {**os.environ, "COLI_API_KEY": "k3y", "COLI_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "colibri", "serve", "--port", "0", "--max-queue", "2",
                          "--max-tokens", "8"],
                         cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()                                   # stderr, read without blocking the test

    def read_stderr():
        for ln in iter(p.stderr.readline, ""):
            lines.put(ln)
        lines.put(None)
    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        port, log = None, []
        deadline = time.monotonic() + 120                   # an editable install may rebuild on import
        while port is None:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                line = None
            if line is None:
                break
            log.append(line)
            if "serving on http://127.0.0.1:" in line:
                port = int(line.split("serving on http://127.0.0.1:")[1].split("/")[0])
        assert port is not None, "".join(log)
        # no template: said once, at start-up (the path is the subprocess's own package)
        assert len(re.findall(r"\[colibri serve\] \S*models/default has no chat template", "".join(log))) == 1, log
        s = types.SimpleNamespace(port=port)
        assert call(s, "GET", "/health")[2]["model"] == MODEL
        assert call(s, "GET", "/v1/models")[0] == 401                   # the key came from COLI_API_KEY
        r = client(s, "k3y").completions.create(model=MODEL, prompt="import sys\n")
        assert r.usage.completion_tokens <= 8                           # --max-tokens is the default
        p.send_signal(sig)
        assert p.wait(30) == 0
        reader.join(10)
        rest = []
        while not lines.empty():
            rest.append(lines.get() or "")
        assert "stopped: 1 completed, 0 rejected, 0 errors" in "".join(rest), rest
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
