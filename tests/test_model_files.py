"""The text files of a model folder (colibri/tokenizer.py): a damaged tokenizer.json or
tokenizer_config.json is one error naming the file (CLI: exit 1, no traceback; API:
ModelFileError); the model's own chat template (chat_template.jinja, else tokenizer_config.json's
chat_template, string or list form) renders chat prompts as transformers' apply_chat_template does,
and LLM.chat uses it."""
import json
import os
import re
import subprocess
import sys

import pytest

import colibri
from colibri.tokenizer import ChatTemplate, ModelFileError, load_chat_template
from conftest import DATA, GLM_STYLE_TEMPLATE, model_folder, tokenizer_json_adding_endoftext

ROOT = DATA.parent.parent
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "  hello  "}, {"role": "user", "content": "again"}]
# GLM_STYLE_TEMPLATE over CONVERSATION; transformers 5.24 (render_jinja_template) gives the same text
GLM_STYLE_PROMPT = ("[gMASK]<sop><|system|>Be brief.<|user|>hi<|assistant|><think></think>hello<|user|>again"
                    "<|assistant|><think>")


def cli(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "colibri", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL)


def default_tokenizer_text():
    from colibri.models import default_model_dir
    with open(os.path.join(default_model_dir(), "tokenizer.json"), encoding="utf-8") as f:
        return f.read()


def assert_clean_cli_error(p, path):
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert f"colibri: error: {path}" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr


# -- tokenizer.json ---------------------------------------------------------------------------------

BAD_TOKENIZERS = {
    "truncated": lambda: default_tokenizer_text()[:len(default_tokenizer_text()) // 2],
    "not JSON": lambda: "this is not JSON\n",
    "wrong schema": lambda: json.dumps({"version": "1.0", "model": {"type": "NoSuchModel"}}),
}


@pytest.mark.parametrize("damage", sorted(BAD_TOKENIZERS))
def test_run_with_a_damaged_tokenizer_names_the_file(tmp_path, damage):
    d = model_folder(tmp_path, {"tokenizer.json": BAD_TOKENIZERS[damage]()})
    p = cli("run", "--model", str(d), "text", "-n", "2")
    assert_clean_cli_error(p, d / "tokenizer.json")
    assert "not a valid tokenizer file" in p.stderr


def test_api_load_with_a_truncated_tokenizer_names_the_file(tmp_path):
    d = model_folder(tmp_path, {"tokenizer.json": BAD_TOKENIZERS["truncated"]()})
    with pytest.raises(ModelFileError, match=re.escape(f"{d / 'tokenizer.json'}: not a valid tokenizer file")):
        colibri.load(str(d))
    assert issubclass(colibri.ModelFileError, ValueError)       # what the CLI prints without a traceback


# -- tokenizer_config.json --------------------------------------------------------------------------

@pytest.mark.parametrize("text,msg", [
    ('{"eos_token": "<|endoftext|>",', "not valid JSON"),
    ('["a list"]', "top level must be a JSON object"),
    ('{"chat_template": 3}', "field 'chat_template' must be a string or a list"),
    ('{"chat_template": [{"name": "default"}]}', r"field 'chat_template\[0\]' must be"),
    ('{"chat_template": [{"name": "tool_use", "template": "x"}]}',
     r"field 'chat_template' names templates \['tool_use'\] but none is 'default'"),
    ('{"chat_template": "{{ 1 }}", "eos_token": 7}', "field 'eos_token' must be a string"),
    ('{"chat_template": "{% for m in messages %}"}', "the chat template does not parse"),
    ('{"chat_template": "  "}', "the chat template is empty"),
], ids=["not-json", "not-object", "template-type", "list-entry", "no-default", "eos-type", "syntax", "empty"])
def test_a_bad_tokenizer_config_names_the_file(tmp_path, text, msg):
    d = model_folder(tmp_path, {"tokenizer_config.json": text})
    with pytest.raises(ModelFileError, match=re.escape(str(d / "tokenizer_config.json")) + ": " + msg):
        colibri.load(str(d))


def test_chat_with_a_tokenizer_config_that_is_not_json_names_the_file(tmp_path):
    d = model_folder(tmp_path, {"tokenizer_config.json": '{"eos_token": '})
    p = cli("chat", "--model", str(d), "--no-save")
    assert_clean_cli_error(p, d / "tokenizer_config.json")
    assert "not valid JSON" in p.stderr


def test_serve_with_a_template_that_does_not_parse_names_the_file(tmp_path):
    d = model_folder(tmp_path, {"chat_template.jinja": "{% if add_generation_prompt %}<|assistant|>"})
    p = cli("serve", "--model", str(d), "--port", "0")
    assert_clean_cli_error(p, d / "chat_template.jinja")
    assert "the chat template does not parse" in p.stderr and "serving on" not in p.stderr


def test_bad_template_files_name_the_file(tmp_path):
    jinja = tmp_path / "chat_template.jinja"
    jinja.write_bytes(b"\xff\xfe{{ messages }}")
    with pytest.raises(ModelFileError, match=re.escape(f"{jinja}: not UTF-8 text")):
        load_chat_template(str(tmp_path))
    jinja.write_text("\n")
    with pytest.raises(ModelFileError, match=re.escape(f"{jinja}: the chat template is empty")):
        load_chat_template(str(tmp_path))


def test_a_model_without_tokenizer_config_has_no_template(tmp_path):
    d = model_folder(tmp_path, {"tokenizer_config.json": None})
    assert load_chat_template(str(d)) is None
    llm = colibri.load(str(d))
    try:
        assert llm.chat_template_source is None
        assert llm.chat_format_note().startswith(f"{d} has no chat template")
    finally:
        llm.close()


# -- rendering --------------------------------------------------------------------------------------

def test_a_glm_style_template_renders_as_transformers_does():
    t = ChatTemplate(GLM_STYLE_TEMPLATE, "chat_template.jinja")
    assert t.render(CONVERSATION) == GLM_STYLE_PROMPT
    assert t.render(CONVERSATION[:2], add_generation_prompt=False) == "[gMASK]<sop><|system|>Be brief.<|user|>hi"
    with pytest.raises(ModelFileError, match="chat_template.jinja: the chat template rejects this conversation: "
                                             "role tool is not supported"):
        t.render([{"role": "tool", "content": "{}"}])


def test_template_filters_globals_and_special_tokens(tmp_path):
    """tojson keeps non-ASCII text and does not HTML-escape (unlike Jinja's own); namespace, break,
    strftime_now, tools (None) and the special tokens of tokenizer_config.json (string or AddedToken
    object) are there; the sandbox refuses to change the messages."""
    template = """{% set ns = namespace(users=0) %}
{% for m in messages %}
    {% if loop.index > 2 %}
        {% break %}
    {% endif %}
    {% if m.role == 'user' %}
        {% set ns.users = ns.users + 1 %}
    {% endif %}
{{ bos_token }}{{ m | tojson }}{{ eos_token }}
{% endfor %}
users={{ ns.users }} tools={{ tools is none }} year={{ strftime_now('%Y') | length }}"""
    cfg = {"chat_template": template, "bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>",
           "unk_token": None}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = load_chat_template(str(tmp_path))
    msgs = [{"role": "user", "content": "é <b>&"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "not shown"}]
    # transformers 5.24 renders the same text
    assert t.render(msgs) == ('<s>{"role": "user", "content": "é <b>&"}</s>\n'
                              '<s>{"role": "assistant", "content": "ok"}</s>\nusers=1 tools=True year=4')
    unsafe = ChatTemplate("{{ messages.append(1) }}", "x.jinja")
    with pytest.raises(ModelFileError, match="x.jinja: the chat template failed to render .SecurityError"):
        unsafe.render(msgs)


def test_the_list_form_takes_the_default_template(tmp_path):
    cfg = {"eos_token": "</s>", "chat_template": [
        {"name": "tool_use", "template": "TOOLS{{ messages[0].content }}"},
        {"name": "default", "template": "DEFAULT {{ messages[0].content }}{{ eos_token }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = load_chat_template(str(tmp_path))
    assert t.source == str(tmp_path / "tokenizer_config.json")
    assert t.render([{"role": "user", "content": "hi"}]) == "DEFAULT hi</s>"


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "CONFIG{{ messages[0].content }}"}))
    (tmp_path / "chat_template.jinja").write_text("FILE {{ messages[0].content }}\n")
    t = load_chat_template(str(tmp_path))
    assert t.source == str(tmp_path / "chat_template.jinja")
    assert t.render([{"role": "user", "content": "hi"}]) == "FILE hi"


# -- LLM.chat ---------------------------------------------------------------------------------------

def test_llm_chat_renders_the_model_template(tmp_path):
    """LLM.chat's prompt is the template's text, tokenized without the tokenizer's own special
    tokens (this tokenizer.json puts <|endoftext|> before every encoding)."""
    d = model_folder(tmp_path, {"chat_template.jinja": GLM_STYLE_TEMPLATE,
                                "tokenizer.json": tokenizer_json_adding_endoftext()})
    llm = colibri.load(str(d), temperature=0)
    try:
        assert llm.chat_template_source == str(d / "chat_template.jinja") and llm.chat_format_note() is None
        assert llm.render_chat(CONVERSATION) == GLM_STYLE_PROMPT
        ids = llm.encode(GLM_STYLE_PROMPT, add_special_tokens=False)
        assert llm.encode(GLM_STYLE_PROMPT) == [llm.tokenizer.token_to_id("<|endoftext|>")] + ids
        assert llm.chat_ids(CONVERSATION) == ids
        text = llm.chat(CONVERSATION, max_tokens=6)
        assert llm.history[:len(ids)] == ids                    # the prompt the engine ran
        assert text == llm.complete(ids, max_tokens=6, stop=["<|user|>", "<|system|>"]).text
    finally:
        llm.close()


def test_a_template_that_fails_to_render_is_an_error_naming_the_file(tmp_path):
    d = model_folder(tmp_path, {"tokenizer_config.json": json.dumps(
        {"chat_template": "{% if messages[0].role == 'system' %}{{ raise_exception('no system prompts') }}{% endif %}"
                          "{{ messages[0].content }}"})})
    llm = colibri.load(str(d), temperature=0)
    try:
        with pytest.raises(ModelFileError, match=re.escape(str(d / "tokenizer_config.json"))
                           + ": the chat template rejects this conversation: no system prompts"):
            llm.chat([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}], max_tokens=2)
    finally:
        llm.close()
