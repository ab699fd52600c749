"""Grammar-constrained decoding (colibri.grammar, llguidance): JSON schemas and grammars hold on
the output, the output is constrained sampling's whatever the drafts (greedy and sampled), the
grammar's forced tokens go into verify forwards as free drafts, and bad schemas are refused before
any work."""
import json
import subprocess
import sys

import jsonschema
import numpy as np
import pytest

import colibri
from colibri import _core
from colibri.grammar import Constraint, GrammarError, constraint_tokenizer, grammar_text
from test_spec import _chi2_pvalue

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3}}}
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "# config\n"]


@pytest.fixture(scope="module")
def llm():
    m = colibri.load(temperature=0, max_tokens=80)
    yield m
    m.close()


def test_schema_outputs_validate_greedy_and_sampled(llm):
    for i in range(20):
        kw = dict(temperature=0) if i < 4 else dict(temperature=0.8, seed=i)
        c = llm.complete(PROMPTS[i % 4], json_schema=PERSON, **kw)
        assert c.stopped_by == "eos", c.text                   # the grammar's output is complete
        jsonschema.validate(json.loads(c.text), PERSON)
        assert c.stats["constrained"] and c.stats["forced_tokens"] > 0


@pytest.mark.parametrize("depth", [1, 3, "auto"])
def test_constrained_drafts_are_lossless(llm, depth):
    """Greedy and seeded sampled output with drafts (the MTP head's, cut by the grammar, and the
    forced tokens) equals the output without drafts."""
    for i, prompt in enumerate(PROMPTS):
        for kw in (dict(temperature=0), dict(temperature=0.9, seed=7 + i)):
            plain = llm.complete(prompt, json_schema=PERSON, draft=0, **kw)
            spec = llm.complete(prompt, json_schema=PERSON, draft=depth, **kw)
            assert spec.token_ids == plain.token_ids and spec.text == plain.text


def test_forced_tokens_raise_tokens_per_forward(llm):
    """With drafting off, the forced tokens alone make a verify forward emit more than one token."""
    c = llm.complete("def f():", json_schema=PERSON, draft=0)
    s = c.stats
    assert s["forced_tokens"] >= 5 and s["drafts_proposed"] == 0
    assert s["tokens_per_forward"] > 1.2
    free = llm.complete("def f():", draft=0, max_tokens=len(c.token_ids))
    n = len(free.token_ids)
    assert free.stats["tokens_per_forward"] <= n / (n - 1) + 1e-9      # (the first token is the prefill's)


def _mask(con, logits):
    return _core.mask_logits(logits, con.allowed(), con.out)


def _masked_probs(sampler, logits, con):
    sampler.dist_build(_mask(con, logits))
    return np.array(sampler.P, dtype=np.float64)


def test_constrained_sampling_follows_the_masked_distribution(llm):
    """The first token of a generation under a grammar that allows several first tokens: over many
    seeds its frequencies are the softmax over the allowed tokens only (chi-square), and no
    forbidden token is ever drawn. And through the verify's own accept / resample calls, with a
    draft the grammar allows and one it forbids, the emitted token still follows it."""
    grammar = 'start: /[a-z]+/ "=" /[0-9]/'
    s = llm.session
    con = s.constraint(llm.options.replace(grammar=grammar))
    prompt = llm.encode("def f(")
    m = s.model
    m.kv_alloc(s.context)
    logits = np.array(m.step(prompt, 0), dtype=np.float32)
    sampler = _core.Sampler(llm.cfg.vocab, 1.0, 1.0, seed=5)
    p = _masked_probs(sampler, logits, con)
    allowed = p > 0
    assert 5 < allowed.sum() < llm.cfg.vocab // 2
    n = 600
    counts = np.zeros(llm.cfg.vocab)
    for seed in range(n):
        c = llm.complete(prompt, grammar=grammar, temperature=1.0, top_p=1.0, seed=seed, max_tokens=1)
        counts[c.token_ids[0]] += 1
    assert counts[~allowed].sum() == 0
    assert _chi2_pvalue(counts[allowed], p[allowed]) > 0.01
    # the verify path: accepts() on the masked logits, else pick_tok with the draft banned
    good = int(np.argsort(-p)[1])
    bad = int(np.flatnonzero(~allowed)[0])
    for draft in (good, bad):
        counts = np.zeros(llm.cfg.vocab)
        for pos in range(8000):
            lg = _mask(con, logits)
            t = draft if sampler.accepts(lg, draft, pos) else sampler.pick_tok(lg, draft, pos)
            counts[t] += 1
        assert counts[~allowed].sum() == 0
        assert _chi2_pvalue(counts[allowed], p[allowed]) > 0.01


def test_gbnf_and_lark_grammars(llm):
    for g in ('root ::= "yes" | "no"', 'start: "yes" | "no"'):
        for seed in range(4):
            assert llm.generate("x", grammar=g, temperature=1.0, seed=seed) in ("yes", "no")


def test_constraint_tokenizer_is_built_once_and_forced_leaves_the_matcher(llm):
    g = grammar_text(json_schema={"const": {"a": 1}})
    con = Constraint(constraint_tokenizer(llm.tokenizer, llm.cfg.vocab, llm.cfg.eos_ids), g, llm.cfg.vocab)
    forced = con.forced(64)
    assert llm.decode(forced) == '{"a":1}'
    assert con.forced(64) == forced                            # rolled back: the same again
    assert con.valid_prefix(forced + forced) == len(forced)
    for t in forced:
        con.consume(t)
    assert con.forced(4) == [] and not con.valid_prefix(forced[:1])


@pytest.mark.parametrize("kw,msg", [
    (dict(json_schema='{"type": '), "json_schema is not a usable JSON schema: the schema is not JSON"),
    (dict(json_schema={"type": "strin"}), "json_schema is not a usable JSON schema"),
    (dict(json_schema="[1, 2]"), "a JSON schema is an object"),
    (dict(grammar="start: foo"), "grammar is not a usable grammar"),
    (dict(grammar="  "), "grammar is not a usable grammar: a grammar must be a non-empty text"),
])
def test_bad_constraints_are_refused_before_generating(llm, kw, msg):
    with pytest.raises(ValueError, match=msg):
        llm.complete("x", **kw)
    with pytest.raises(GrammarError, match="not both"):
        grammar_text(json_schema={"type": "object"}, grammar='start: "a"')


def test_run_json_schema_from_a_file(tmp_path):
    f = tmp_path / "person.json"
    f.write_text(json.dumps(PERSON))
    r = subprocess.run([sys.executable, "-m", "colibri", "run", "class Config:", "-t", "0.7", "--seed", "3",
                        "--json-schema", str(f), "-n", "80"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), PERSON)
    assert "grammar forced" in r.stderr
    r = subprocess.run([sys.executable, "-m", "colibri", "run", "x", "--json-schema", str(tmp_path / "no.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--json-schema is not a usable JSON schema" in r.stderr
    assert "Traceback" not in r.stderr
