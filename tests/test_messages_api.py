"""Anthropic's Messages API on serve (colibri.messages_api), checked with the official anthropic
client: a chat, a streamed chat, forced tool_use whose input validates against the tool's schema
(streamed and not), a tool_result turn served from the KV cache, stop sequences, count_tokens,
a wrong key refused and errors in Anthropic's shape."""
import http.client
import json

import anthropic
import jsonschema
import pytest

import colibri
from test_server import serving

KEY = "test-key"
WEATHER = {"type": "object", "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"name": "get_weather", "description": "The forecast for a city.", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What will the weather be in Paris?"}]


@pytest.fixture(scope="module")
def srv():
    llm = colibri.load(temperature=0.7, max_tokens=200)
    with serving(llm, api_key=KEY) as s:
        yield s
    llm.close()


@pytest.fixture(scope="module")
def api(srv):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{srv.port}", api_key=KEY, max_retries=0, timeout=60)


def test_chat_and_streamed_chat(api):
    m = api.messages.create(model="colibri-default", max_tokens=24, system="You write Python.", messages=ASK)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 24
    greedy = {"temperature": 0}                       # (sent as extra_body: today's client has no such field)
    with api.messages.stream(model="colibri-default", max_tokens=24, messages=ASK, extra_body=greedy) as st:
        pieces = list(st.text_stream)
        final = st.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == final.content[0].text
    again = api.messages.create(model="colibri-default", max_tokens=24, messages=ASK, extra_body=greedy)
    assert again.content[0].text == final.content[0].text
    assert final.usage.cache_read_input_tokens > 0            # the same prompt again: its KV rows reused


def test_stop_sequences(api):
    """A stop sequence taken from the model's own greedy answer (so the test holds for any model):
    the answer ends before it, with stop_reason stop_sequence."""
    kw = dict(model="colibri-default", max_tokens=60, messages=ASK, extra_body={"temperature": 0})
    full = api.messages.create(**kw).content[0].text
    assert len(full) >= 8, full
    stop = full[len(full) // 2:len(full) // 2 + 3]                 # it may occur earlier: cut at the first
    assert full.index(stop) > 0, full
    m = api.messages.create(stop_sequences=[stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == full[:full.index(stop)]


def test_forced_tool_use_validates_and_its_result_turn(api):
    for i in range(6):
        kw = dict(model="colibri-default", max_tokens=200, tools=TOOLS, messages=ASK,
                  tool_choice={"type": "tool", "name": "get_weather"} if i % 2 else
                  {"type": "any", "disable_parallel_tool_use": True})
        if i < 3:
            m = api.messages.create(**kw)
        else:
            with api.messages.stream(**kw) as st:
                m = st.get_final_message()
        assert m.stop_reason == "tool_use"
        (use,) = [b for b in m.content if b.type == "tool_use"]
        assert use.name == "get_weather" and use.id.startswith("toolu_")
        jsonschema.validate(use.input, WEATHER)
    turn = ASK + [{"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "sunny, 24 C"}]}]
    r = api.messages.create(model="colibri-default", max_tokens=20, tools=TOOLS, messages=turn)
    assert r.content[0].type == "text" and r.usage.input_tokens > 0


def test_output_format_json_schema(api):
    schema = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 16}}}
    for seed in range(3):
        m = api.messages.create(model="colibri-default", max_tokens=60, messages=ASK,
                                output_config={"format": {"type": "json_schema", "schema": schema}})
        jsonschema.validate(json.loads(m.content[0].text), schema)


def test_count_tokens(api):
    n = api.messages.count_tokens(model="colibri-default", messages=ASK).input_tokens
    assert n == api.messages.create(model="colibri-default", max_tokens=1, messages=ASK).usage.input_tokens + \
        api.messages.create(model="colibri-default", max_tokens=1, messages=ASK).usage.cache_read_input_tokens


def test_wrong_key_and_bad_requests_in_anthropic_shape(srv, api):
    bad = anthropic.Anthropic(base_url=f"http://127.0.0.1:{srv.port}", api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="colibri-default", max_tokens=5, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    for key, status in (("wrong", 401), (KEY, 200)):             # Anthropic's own header, as older clients send it
        c.request("POST", "/v1/messages/count_tokens", json.dumps({"model": "colibri-default", "messages": ASK}),
                  {"x-api-key": key, "content-type": "application/json"})
        r = c.getresponse()
        assert r.status == status, r.read()
        body = json.loads(r.read())
    assert body["input_tokens"] > 5
    for kw, msg in ((dict(messages=[{"role": "robot", "content": "x"}]), "messages.0.role"),
                    (dict(messages=ASK, extra_body={"temperature": 1.5}), "temperature"),
                    (dict(messages=ASK, tools=[{"name": "f"}]), "input_schema"),
                    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "image")):
        with pytest.raises(anthropic.BadRequestError, match=msg) as e:
            api.messages.create(model="colibri-default", max_tokens=5, **kw)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    c.request("POST", "/v1/messages", json.dumps({"model": "colibri-default", "messages": ASK}),
              {"x-api-key": KEY, "content-type": "application/json"})
    r = c.getresponse()
    assert r.status == 400 and json.loads(r.read())["error"]["message"] == "max_tokens: Field required"
    with pytest.raises(anthropic.NotFoundError):
        api.messages.create(model="claude-opus-4", max_tokens=5, messages=ASK)


def test_encoder_blocks_and_event_order():
    """A reply with reasoning, text and a call: the response's blocks, and the stream's events in
    Anthropic's order (each block opened, filled and closed before the next), whatever the pieces."""
    from types import SimpleNamespace

    from colibri.messages_api import MessagesEncoder
    from colibri.tools import Tool
    reply = ('<think>look it up</think>Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n'
             '<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>')
    req = {"tools": [Tool("get_weather", "", WEATHER)], "thinking": False, "user_stops": []}
    c = SimpleNamespace(text=reply, finish_reason="stop", stop_string=None, prompt_tokens=10, prefill_tokens=4,
                        completion_tokens=30)
    r = MessagesEncoder("m", req, 0).response(c)
    assert [b["type"] for b in r["content"]] == ["thinking", "text", "tool_use"]
    assert r["content"][2]["input"] == {"city": "Oslo", "days": 2} and r["stop_reason"] == "tool_use"
    assert r["usage"] == {"input_tokens": 4, "output_tokens": 30, "cache_read_input_tokens": 6,
                          "cache_creation_input_tokens": 0}
    for step in (1, 5, 1000):
        enc = MessagesEncoder("m", req, 0)
        raw = enc.begin() + [e for i in range(0, len(reply), step) for e in enc.text(reply[i:i + step])] + enc.end(c)
        events = [json.loads(e.split(b"data: ", 1)[1]) for e in raw]
        kinds = [e["type"] for e in events]
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
        assert starts == ["thinking", "text", "tool_use"]
        open_ = None
        for e in events:                                  # blocks never overlap
            if e["type"] == "content_block_start":
                assert open_ is None
                open_ = e["index"]
            elif e["type"] == "content_block_delta":
                assert e["index"] == open_
            elif e["type"] == "content_block_stop":
                assert e["index"] == open_
                open_ = None
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        assert text == "Checking."
        assert events[-2]["delta"]["stop_reason"] == "tool_use"
