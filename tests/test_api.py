"""The Python API: colibri.load / Options / LLM.generate, stream, complete, chat."""
import json

import pytest

import colibri
from colibri import api
from conftest import DATA


@pytest.fixture(scope="module")
def llm():
    m = colibri.load(temperature=0)
    yield m
    m.close()


def test_load_uses_the_embedded_model_and_options(llm):
    from colibri.models import default_model_dir
    assert llm.path == default_model_dir() and llm.tokenizer is not None
    assert llm.options.temperature == 0 and llm.options.draft == "auto"
    assert llm.context == min(llm.cfg.max_positions, 4096)


def test_greedy_generate_matches_the_engine(llm):
    ref = json.loads((DATA / "default_ref.json").read_text())["cli"]
    # the reference continuation was made by transformers; the engine reproduces it (test_default_model)
    assert llm.generate(ref["prompt"], max_tokens=ref["max_tokens"]) == ref["text"]
    c = llm.complete(ref["prompt_ids"], max_tokens=ref["max_tokens"], draft=0)
    assert c.token_ids == ref["ids"] and c.finish_reason == "length"
    assert c.prompt_tokens == len(ref["prompt_ids"]) and c.completion_tokens == len(ref["ids"])


def test_stream_yields_the_same_text_in_whole_characters(llm):
    prompt = "def read_config(path):"
    want = llm.generate(prompt, max_tokens=40)
    pieces = list(llm.stream(prompt, max_tokens=40))
    assert "".join(pieces) == want and len(pieces) > 1
    assert all("\ufffd" not in p for p in pieces)


def test_stream_closed_early_stops_the_generation(llm):
    it = llm.stream("class Stack:", max_tokens=200)
    first = next(it)
    it.close()                                   # the worker is cancelled and joined
    assert first
    assert llm.generate("class Stack:", max_tokens=5)       # the model is free again


def test_stop_strings_cut_the_text_and_are_never_streamed(llm):
    prompt = "def fibonacci(n):"
    full = llm.generate(prompt, max_tokens=40)
    stop = full[10:16]
    c = llm.complete(prompt, max_tokens=40, stop=[stop])
    assert c.text == full[:full.index(stop)] and c.finish_reason == "stop"
    streamed = "".join(llm.stream(prompt, max_tokens=40, stop=stop))
    assert streamed == c.text


def test_prompt_prefix_kv_is_reused(llm):
    ids = llm.encode("import os\nimport sys\n\n\ndef main(")
    a = llm.complete(ids, max_tokens=8)
    b = llm.complete(ids + a.token_ids[:-1] + llm.encode(" x"), max_tokens=8)
    assert b.prefill_tokens < b.prompt_tokens - 4            # only the new tokens were forwarded
    cold = colibri.load(temperature=0)
    assert cold.complete(ids + a.token_ids[:-1] + llm.encode(" x"), max_tokens=8).token_ids == b.token_ids
    cold.close()


def test_sampling_is_seeded(llm):
    kw = dict(max_tokens=24, temperature=0.8, top_p=0.9, seed=11)
    assert llm.generate("def f(x):", **kw) == llm.generate("def f(x):", **kw)


def test_chat_renders_roles_and_answers(llm):
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "add two numbers"}]
    text = llm.render_chat(msgs)
    assert text == "<|system|>\nYou write Python.\n<|user|>\nadd two numbers\n<|assistant|>\n"
    assert isinstance(llm.chat(msgs, max_tokens=8), str)


def test_the_default_model_has_no_chat_template_and_says_so(llm):
    from colibri.models import default_model_dir
    assert llm.chat_template is None and llm.chat_template_source is None
    assert llm.chat_format_note() == (f"{default_model_dir()} has no chat template (chat_template.jinja, or "
                                      "chat_template in tokenizer_config.json); using a plain chat format "
                                      "(<|role|>\\ntext\\n)")


@pytest.mark.parametrize("kw,msg", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=10 ** 6), "context"), (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"), (dict(stop=[3]), "stop"), (dict(draft=99), "^draft must be"),
])
def test_bad_arguments_are_clear_errors(llm, kw, msg):
    with pytest.raises(ValueError, match=msg):
        llm.complete("x", **kw)


def test_bad_prompts_and_messages(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.complete([10 ** 9])
    with pytest.raises(ValueError, match="no tokens"):
        llm.complete("")
    with pytest.raises(ValueError, match="context"):
        llm.complete("x " * 5000)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "robot", "content": "hi"}])
    with pytest.raises(ValueError, match="non-empty list"):
        llm.chat([])


def test_options_from_the_environment(capsys):
    o = api.Options.from_env({"COLIBRI_CACHE_EXPERTS": "8", "COLIBRI_PREFETCH": "0", "COLIBRI_RAM_GB": "1.5",
                              "COLIBRI_DRAFT": "2", "COLIBRI_DENSE_BITS": "8", "COLIBRI_ABSORB": "never"},
                             temperature=0.1)
    assert (o.cache_experts, o.prefetch, o.ram_gb, o.draft, o.temperature) == (8, False, 1.5, 2, 0.1)
    assert (o.dense_bits, o.absorb) == (8, "never")
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="^COLIBRI_PREFETCH='maybe' is not a boolean"):
        api.Options.from_env({"COLIBRI_PREFETCH": "maybe"})
    with pytest.raises(ValueError, match="^COLIBRI_CACHE_EXPERTS must be an integer >= 0"):
        api.Options.from_env({"COLIBRI_CACHE_EXPERTS": "-3"})
    with pytest.raises(ValueError, match="^cache_experts must be"):
        api.Options(cache_experts=-1)
    # the old prefix still works, with a warning, and errors name the variable that was set
    assert api.Options.from_env({"COLI_THREADS": "1"}).threads == 1
    assert "COLI_THREADS is now COLIBRI_THREADS" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^COLI_IO_THREADS must be an integer >= 1"):
        api.Options.from_env({"COLI_IO_THREADS": "0"})


def test_experts_are_read_at_load_unless_lazy(llm):
    """Every expert of the embedded model fits: load() reads them all (the tiers say so); with
    warm_experts=False (COLIBRI_WARM_EXPERTS=0, serve/chat --lazy-experts) none is read up front, and
    the text is the same."""
    assert llm.tiers.warmed > 0 and llm.tiers.warmed_bytes > 0
    assert api.Options.from_env({"COLIBRI_WARM_EXPERTS": "0"}).warm_experts is False
    lazy = colibri.load(temperature=0, warm_experts=False)
    try:
        assert lazy.tiers.warmed == 0
        prompt = "def add(a, b):"
        assert lazy.generate(prompt, max_tokens=16) == llm.generate(prompt, max_tokens=16)
    finally:
        lazy.close()


def test_a_model_without_tokenizer_takes_token_ids():
    m = colibri.load(str(DATA / "tiny_dense"), temperature=0)
    ref = json.loads((DATA / "tiny_dense" / "ref.json").read_text())
    c = m.complete(ref["prompt_ids"], max_tokens=12, draft=0)
    assert c.token_ids == ref["full_ids"][len(ref["prompt_ids"]):][:12]
    with pytest.raises(ValueError, match="tokenizer"):
        m.complete("text")
    m.close()


def test_glm_tokenizers_get_the_glm5_chat_format(llm, monkeypatch):
    """A tokenizer with GLM's special tokens gets colibrì's GLM-5 format (no thinking)."""
    special = {"[gMASK]": 1, "<sop>": 2, "<|user|>": 3, "<|assistant|>": 4}

    class Tok:
        def token_to_id(self, t):
            return special.get(t)
    monkeypatch.setattr(llm, "tokenizer", Tok())
    text = llm.render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": " yo "}, {"role": "user", "content": "again"}])
    assert text == ("[gMASK]<sop><|system|>S<|user|>hi<|assistant|><think></think>yo<|user|>again"
                    "<|assistant|><think></think>")
    assert llm.chat_format_note().endswith("has no chat template (chat_template.jinja, or chat_template in "
                                           "tokenizer_config.json); using GLM-5's chat format "
                                           "([gMASK]<sop><|role|>text...)")


def test_batch_option_prefills_in_pieces_with_the_same_text(llm):
    """Options(batch=N) (COLIBRI_BATCH, chat/serve --batch): the prompt in pieces of <= N tokens, the
    same tokens; the completion's stats give the time to first token."""
    prompt = "import os\nimport sys\n\ndef main(argv):\n    " * 3
    want = llm.complete(prompt, max_tokens=24, draft=0)
    assert api.Options.from_env({"COLIBRI_BATCH": "20"}).batch == 20
    with pytest.raises(ValueError, match="batch"):
        api.Options(batch=-1)
    small = colibri.load(temperature=0, batch=20)
    try:
        assert small.tiers.batch == 20
        got = small.complete(prompt, max_tokens=24, draft=0)
    finally:
        small.close()
    assert got.prompt_tokens >= 40 and got.token_ids == want.token_ids     # >= 2 pieces
    s = got.stats
    assert s["prefill_s"] <= s["ttft_s"] <= s["prefill_s"] + s["decode_s"]
