"""The embedded default model (colibri/models/default, built by tools/train_tiny.py)."""
import json
import os
import subprocess
import sys

import pytest

import colibri
from colibri.models import DEFAULT_MODEL_DIR, default_model_dir
from colibri.parity import check, load_ref
from conftest import DATA

REF = DATA / "default_ref.json"
ROOT = DATA.parent.parent


@pytest.fixture(scope="module")
def ref():
    return load_ref(REF)


@pytest.fixture(scope="module")
def model():
    return colibri.model_init(default_model_dir())


def colibri_cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "colibri", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)     # the repository root, like the README


def test_shipped_model_loads(model):
    d = default_model_dir()
    assert d == DEFAULT_MODEL_DIR and os.path.isdir(d)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md"):
        assert os.path.isfile(os.path.join(d, f)), f
    raw = json.load(open(os.path.join(d, "config.json")))
    assert raw["model_type"] == "glm_moe_dsa" and raw["num_nextn_predict_layers"] == 1
    cfg = model.cfg
    assert model.has_mtp and model.mtp.index == cfg.n_layers
    assert cfg.n_experts > cfg.topk >= 2 and cfg.n_shared == 1 and cfg.q_lora > 0 and cfg.kv_lora > 0
    assert any(cfg.sparse) and not cfg.sparse[0] and all(cfg.idx_full[:1])
    assert cfg.index_topk >= cfg.max_positions > 0          # the DSA selection never drops a key
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    assert tok.get_vocab_size() == cfg.vocab
    assert cfg.eos_ids == [tok.token_to_id("<|endoftext|>")]


@pytest.mark.parametrize("absorb", [-1, 0, 1])
def test_f32_parity_against_transformers(ref, absorb):
    """The float path (f32 dots on the dequantized rows) computes exactly what transformers does on
    the shipped weights, with the absorbed attention path automatic, never and always."""
    res = check(colibri.model_init(default_model_dir(), idot=0, absorb=absorb), ref)
    assert res["tf_match"] == res["tf_total"] >= 64, res
    assert res["greedy_match"] == res["greedy_total"] >= 64, res
    assert res["max_abs_logit_diff"] <= 1e-3, res["max_abs_logit_diff"]


def test_quantized_parity_against_transformers(model, ref):
    """The container against transformers run on the same weights, dequantized."""
    assert len(ref["full_ids"]) >= 64
    res = check(model, ref)
    assert res["tf_match"] >= 0.95 * res["tf_total"], res
    assert res["max_abs_logit_diff"] < 0.05, res["max_abs_logit_diff"]


def test_cli_without_model_uses_the_default(ref):
    want = ref["cli"]
    p = colibri_cli("run", want["prompt"], "--max-tokens", want["max_tokens"], "--temperature", 0)
    assert p.returncode == 0, p.stderr
    assert "embedded default model" in p.stderr and "MTP head" in p.stderr
    assert p.stdout.strip()
    assert p.stdout == want["text"] + "\n"


def test_prompt_option_is_the_positional_prompt(ref):
    """`-p/--prompt TEXT` (as in llama.cpp) gives the same text as the positional PROMPT; giving both
    is an error, not a silent choice."""
    want = ref["cli"]
    p = colibri_cli("run", "--prompt", want["prompt"], "--max-tokens", want["max_tokens"], "--temperature", 0)
    assert p.returncode == 0, p.stderr
    assert p.stdout == want["text"] + "\n"
    both = colibri_cli("run", want["prompt"], "-p", want["prompt"], "--max-tokens", 2)
    assert both.returncode == 2 and "once" in both.stderr


def test_mtp_drafts_accepted_on_a_heldout_prompt(tmp_path, ref):
    stats = tmp_path / "s.json"
    plain = colibri_cli("run", ref["prompt_text"], "--max-tokens", 48, "--temperature", 0, "--draft", 0, "--quiet")
    p = colibri_cli("run", ref["prompt_text"], "--max-tokens", 48, "--temperature", 0, "--draft", 3,
                    "--stats-json", stats, "--quiet")
    assert p.returncode == 0 and plain.returncode == 0, p.stderr + plain.stderr
    s = json.loads(stats.read_text())
    assert s["drafts_proposed"] > 0 and s["drafts_accepted"] > 0
    assert s["tokens_per_forward"] > 1.0
    assert p.stdout == plain.stdout                       # greedy speculation is lossless


def test_build_installs_every_model_file_and_stays_small():
    """meson.build lists each file of the shipped model (a file left out would be missing from the
    wheel), and the package stays far below the 50 MB wheel budget even before compression."""
    meson = (ROOT / "meson.build").read_text()
    d = ROOT / "colibri" / "models" / "default"
    files = sorted(p.name for p in d.iterdir() if p.is_file() and not p.name.startswith("."))
    for name in files:
        assert f"'colibri/models/default/{name}'" in meson, name
    total = sum(p.stat().st_size for p in (ROOT / "colibri").rglob("*") if p.is_file()
                and "__pycache__" not in p.parts and p.suffix not in (".so", ".c"))
    assert total < 50e6, total
