"""Tool calls (colibri.tools) through serve's OpenAI API, checked with the official openai client:
forced calls whose arguments validate against the tool's schema, tool_choice auto, tool results in
the next turn, response_format json_schema, and GLM's call format parsed whole and as it streams."""
import json

import jsonschema
import openai
import pytest

import colibri
from colibri.tools import ReplyStream, Tool, ToolCall, call_grammar, parse_reply, render_call
from test_server import client, serving

WEATHER = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
SEARCH = {"type": "object", "required": ["query"],
          "properties": {"query": {"type": "string", "maxLength": 30}, "limit": {"type": "integer", "maximum": 50}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search_code", "description": "Search the repository.",
                                           "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search_code": SEARCH}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def api():
    llm = colibri.load(temperature=0.8, max_tokens=200)
    with serving(llm) as s:
        yield client(s)
    llm.close()


def _streamed_calls(stream):
    """The tool calls and content the official client's chunks add up to."""
    calls, content, finish = {}, "", None
    for ch in stream:
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            c["id"] = tc.id or c["id"]
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


def test_forced_tool_calls_validate_streamed_and_not(api):
    for i in range(20):
        name = ("get_weather", "search_code")[i % 2]
        kw = dict(model="colibri-default", messages=ASK, tools=TOOLS, seed=i,
                  tool_choice={"type": "function", "function": {"name": name}})
        if i % 4 < 2:
            r = api.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "tool_calls"
            calls = [{"name": c.function.name, "arguments": c.function.arguments, "id": c.id}
                     for c in r.choices[0].message.tool_calls]
        else:
            calls, content, finish = _streamed_calls(api.chat.completions.create(stream=True, **kw))
            assert finish == "tool_calls" and content == ""
        assert len(calls) == 1 and calls[0]["name"] == name and calls[0]["id"].startswith("call_")
        jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[name])


def test_required_picks_one_of_the_tools(api):
    for i in range(4):
        r = api.chat.completions.create(model="colibri-default", messages=ASK, tools=TOOLS, tool_choice="required",
                                        seed=100 + i, parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_without_a_call_is_plain_content(api):
    r = api.chat.completions.create(model="colibri-default", messages=ASK, tools=TOOLS, tool_choice="auto", seed=1,
                                    max_tokens=24)
    m = r.choices[0].message
    assert not m.tool_calls and m.content and r.choices[0].finish_reason in ("stop", "length")


def test_tool_result_turn(api):
    """The assistant's call and the tool's result go back through the chat format (the embedded
    model has no template: GLM's call text and an observation message)."""
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris", "days": 3}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny", "high": 24}'}]
    r = api.chat.completions.create(model="colibri-default", messages=turn, tools=TOOLS, seed=3, max_tokens=16)
    assert r.choices[0].message.content is not None and r.usage.prompt_tokens > 60
    llm = colibri.load()
    try:
        text = llm.render_chat([dict(m, content=m["content"] or "",
                                     tool_calls=[ToolCall("get_weather", {"city": "Paris", "days": 3})]
                                     if m["role"] == "assistant" else [])
                                for m in ({k: v for k, v in m.items() if k in ("role", "content")} for m in turn)],
                               tools=[Tool("get_weather", "", WEATHER)])
    finally:
        llm.close()
    assert "<|observation|>\n{\"forecast\": \"sunny\"" in text
    assert "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>" in text
    assert '"name": "get_weather"' in text                         # the tool list in the system message


def test_response_format_json_schema(api):
    schema = {"type": "object", "required": ["answer", "confidence"], "additionalProperties": False,
              "properties": {"answer": {"type": "string", "maxLength": 40},
                             "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}}
    rf = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    for i in range(20):
        r = api.chat.completions.create(model="colibri-default", messages=ASK, response_format=rf, seed=i,
                                        max_tokens=80)
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # any object: the tiny model may invent keys until max_tokens; what it wrote is still an object's start
    for seed in range(4):
        r = api.chat.completions.create(model="colibri-default", messages=ASK, seed=seed, max_tokens=120,
                                        response_format={"type": "json_object"})
        text = r.choices[0].message.content
        assert text.startswith("{")
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_bad_tools_are_refused_by_the_client(api):
    with pytest.raises(openai.BadRequestError, match="tools"):
        api.chat.completions.create(model="colibri-default", messages=ASK, tools=[{"type": "function",
                                                                                   "function": {"parameters": {}}}])


REPLY = ('<think>the user wants weather</think>Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n'
         '<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>'
         '<tool_call>nope\n</tool_call> done')


def test_parse_reply_and_its_stream_agree():
    tools = [Tool("get_weather", "", WEATHER)]
    reasoning, content, calls = parse_reply(REPLY, tools)
    assert reasoning == "the user wants weather"
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]
    assert content == "Let me check.<tool_call>nope\n</tool_call> done"     # an unknown tool stays text
    for step in (1, 2, 3, 7, 1000):
        rs = ReplyStream(tools)
        ev = []
        for i in range(0, len(REPLY), step):
            ev += rs.feed(REPLY[i:i + step])
        ev += rs.finish()
        assert "".join(v for k, v in ev if k == "reasoning") == reasoning
        assert "".join(v for k, v in ev if k == "content") == "Let me check." + "<tool_call>nope\n</tool_call> done"
        assert [(v.name, v.arguments) for k, v in ev if k == "call"] == [(c.name, c.arguments) for c in calls]
    assert parse_reply(render_call(calls[0], tools[0]), tools)[2][0].arguments == calls[0].arguments


def test_call_grammar_uses_special_tokens_for_tags():
    g = call_grammar([Tool("f", "", SEARCH)], tags={"<tool_call>": 7, "</tool_call>": 8})
    assert "<[7]>" in g and "<[8]>" in g and '"<arg_key>' in g


# A template in the style of GLM's: the tool list as JSON (tojson with keyword arguments, which
# plain Jinja lacks), past calls in GLM's format, results as observation turns.
TOOL_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}<|system|>Tools:{% for t in tools %}
{{ t.function | tojson(ensure_ascii=False) }}{% endfor %}{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}<|assistant|>{{ m.content }}
{%- for tc in m.tool_calls or [] -%}<tool_call>{{ tc.function.name }}
{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v if v is string else v | tojson(ensure_ascii=False) }}</arg_value>
{% endfor %}</tool_call>{%- endfor -%}
{%- elif m.role == 'tool' -%}<|observation|>{{ m.content }}
{%- else -%}<|{{ m.role }}|>{{ m.content }}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"""


def test_tools_through_the_models_own_template(tmp_path):
    from conftest import model_folder
    d = model_folder(tmp_path, {"chat_template.jinja": TOOL_TEMPLATE})
    llm = colibri.load(str(d), temperature=0.7, max_tokens=200)
    try:
        with serving(llm) as s:
            api = client(s)
            r = api.chat.completions.create(model="model", messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, seed=4)
            (call,) = r.choices[0].message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            turn = ASK + [r.choices[0].message.model_dump(include={"role", "content", "tool_calls"}),
                          {"role": "tool", "tool_call_id": call.id, "content": "Paris: sunny, 24 °C"}]
            r2 = api.chat.completions.create(model="model", messages=turn, tools=TOOLS, max_tokens=8)
            assert r2.usage.prompt_tokens_details.cached_tokens > 20      # the first turn's KV rows reused
        text = llm.render_chat([{"role": "user", "content": "x"},
                                {"role": "assistant", "content": "",
                                 "tool_calls": [ToolCall("get_weather", {"city": "Zürich", "days": 2})]},
                                {"role": "tool", "content": "ok"}], tools=[Tool("get_weather", "", WEATHER)])
    finally:
        llm.close()
    assert '{"name": "get_weather", "description": "", "parameters": {' in text
    assert "<arg_value>Zürich</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>" in text
    assert text.endswith("<|observation|>ok<|assistant|>")


def test_special_tag_tokens_decode_and_constrain():
    """A tokenizer holding GLM's tags as special tokens (GLM-5's kind): the reply text keeps them
    (decoded literally, as glm.c does), and the forced-call grammar produces them as tokens."""
    import os

    from tokenizers import AddedToken, Tokenizer

    from colibri.grammar import Constraint, constraint_tokenizer
    from colibri.models import default_model_dir
    from colibri.session import TextTail
    tok = Tokenizer.from_file(os.path.join(default_model_dir(), "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<tool_call>", "</tool_call>")])
    open_id, close_id = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")
    tail = TextTail(tok, [])
    text = "".join(tail.push(t) for t in [open_id] + tok.encode("f\n", add_special_tokens=False).ids + [close_id])
    text += tail.rest()
    assert text == "<tool_call>f\n</tool_call>"
    assert [c.name for c in parse_reply(text, [Tool("f")])[2]] == ["f"]
    vocab = tok.get_vocab_size()
    g = call_grammar([Tool("f")], tags={"<tool_call>": open_id, "</tool_call>": close_id})
    from colibri.grammar import grammar_text
    con = Constraint(constraint_tokenizer(tok, vocab, [0]), grammar_text(grammar=g), vocab)
    forced = con.forced(16)
    assert forced[0] == open_id and forced[-1] == close_id
