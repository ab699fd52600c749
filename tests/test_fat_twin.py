"""tools/make_fat_twin.py: experts zero-padded to a wider intermediate dimension compute the same
function (the same greedy tokens) at more bytes per expert, for containers and float checkpoints."""
import json
from pathlib import Path

import numpy as np
import pytest

from colibri import model_init
from colibri.convert import ConvertOptions, convert
from colibri.models import default_model_dir
from conftest import DATA, fat_twin as twin, greedy_steps

def greedy(path, n=12):
    """Prefill a fixed prompt, then n greedy steps: (tokens, logits of every step)."""
    m = model_init(path, cache_experts=0)
    out, logits = greedy_steps(m, [3, 14, 15, 92, 65, 35, 89, 79], n)
    expert = m.expert_load(next(l for l in range(m.cfg.n_layers) if m.cfg.sparse[l]), 0).nbytes
    m.close()
    return out, logits, expert


@pytest.mark.parametrize("source", ["embedded", "int4-groups", "int8", "float"])
def test_the_twin_decodes_the_same_tokens_at_more_bytes(tmp_path, source):
    if source == "embedded":
        src = default_model_dir()
    elif source == "float":
        src = DATA / "tiny_dsa"
    else:
        src = tmp_path / "src"
        opts = (ConvertOptions(expert_bits=4, dense_bits=4, group_size=64) if source == "int4-groups"
                else ConvertOptions(expert_bits=8, dense_bits=8))
        convert(DATA / "tiny_dsa", src, opts, verbose=False)
    inter = json.loads((Path(src) / "config.json").read_text())["moe_intermediate_size"]
    p = twin(src, tmp_path / "twin", 4 * inter)
    assert p.returncode == 0, p.stderr
    cfg = json.loads((tmp_path / "twin" / "config.json").read_text())
    assert cfg["moe_intermediate_size"] == 4 * inter
    tokens, logits, expert = greedy(src)
    t_tokens, t_logits, t_expert = greedy(tmp_path / "twin")
    assert t_tokens == tokens
    if source == "float":       # f32 dots over longer rows: other partial sums, the same function
        np.testing.assert_allclose(t_logits, logits, rtol=0, atol=1e-4)
    else:                       # integer dots: the padded zeros add nothing, bit for bit
        np.testing.assert_array_equal(t_logits, logits)
    assert t_expert > 3 * expert                     # the bytes a token reads grew with the width


def test_bad_requests_are_named_without_a_traceback(tmp_path):
    src = default_model_dir()
    inter = json.loads((Path(src) / "config.json").read_text())["moe_intermediate_size"]
    p = twin(src, tmp_path / "t", inter - 1)
    assert p.returncode == 2 and "--width" in p.stderr and "Traceback" not in p.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    p = twin(src, tmp_path / "full", 2 * inter)
    assert p.returncode == 2 and "not empty" in p.stderr and "Traceback" not in p.stderr
    p = twin(tmp_path / "nowhere", tmp_path / "t2", 2 * inter)
    assert p.returncode == 2 and "nowhere" in p.stderr and "Traceback" not in p.stderr
