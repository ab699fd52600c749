"""Containers without the DSA indexer tensors (as colibrì's converter writes them by default).

They load and run; while a context fits in index_topk the output equals the model with its
indexer (which would keep every key); past it, attention is dense and the run says so once.
--dsa-force on such a container is an error naming the missing tensor. A sweep of config/tensor
combinations checks that no forward reaches a kernel with a buffer that was never bound.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from colibri import model_init
from colibri.convert import convert
from colibri.st import ContainerError
from conftest import DATA


def _strip(src_dir, dst_dir, drop):
    """Copy a converted container, leaving out the tensors for which drop(name) is true."""
    dst_dir.mkdir()
    for n in os.listdir(src_dir):
        p = src_dir / n
        if n.endswith(".safetensors"):
            t = load_file(str(p))
            save_file({k: v for k, v in t.items() if not drop(k)}, str(dst_dir / n))
        elif p.is_file():
            (dst_dir / n).write_bytes(p.read_bytes())
    return dst_dir


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(container with indexer, the same without any indexer tensor) of tiny_dsa (index_topk 8)."""
    root = tmp_path_factory.mktemp("noidx")
    full = root / "full"
    convert(DATA / "tiny_dsa", full, verbose=False)
    bare = _strip(full, root / "bare", lambda k: ".indexer." in k)
    return full, bare


def _logits(path, ids, **kw):
    m = model_init(path, **kw)
    m.kv_alloc(len(ids) + 4)
    out = m.step_all(ids, 0)
    return m, out


def test_loads_and_is_exact_within_index_topk(pair):
    full, bare = pair
    ids = [3, 14, 15, 92, 65, 35]                       # 6 <= index_topk = 8
    a, la = _logits(full, ids)
    b, lb = _logits(bare, ids)
    assert a.has_dsa and not b.has_dsa and b.indexer_absent.endswith(".indexer.wq_b.weight")
    np.testing.assert_array_equal(la, lb)
    assert not b.dense_past_topk and a.dsa_note() is None and "no DSA indexer" in b.dsa_note()


def test_attends_densely_past_index_topk(pair):
    full, bare = pair
    ids = [(7 * i + 3) % 200 for i in range(20)]       # past index_topk = 8
    b, lb = _logits(bare, ids)
    _, ld = _logits(full, ids, dsa=False)               # the same weights, dense attention
    _, ls = _logits(full, ids)                          # the model's own sparse attention
    np.testing.assert_array_equal(lb, ld)
    assert b.dense_past_topk
    assert np.all(np.isfinite(lb)) and not np.array_equal(lb, ls)


def _cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "colibri", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)


def test_cli_says_once_that_long_context_is_dense(pair, tmp_path):
    _, bare = pair
    stats = tmp_path / "s.json"
    p = _cli("run", "--model", bare, "--prompt-ids", ",".join(str(5 + i) for i in range(10)),
             "--max-tokens", 6, "--temperature", 0, "--stats-json", stats)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("no DSA indexer") == 1
    s = json.loads(stats.read_text())
    assert s["dsa_indexer"] is False and s["dsa_dense_past_topk"] is True
    assert len(s["notes"]) == 1 and "no DSA indexer" in s["notes"][0]
    # within index_topk: nothing to say, and the stats show the context stayed in it
    p = _cli("run", "--model", bare, "--prompt-ids", "5,6", "--max-tokens", 3, "--temperature", 0,
             "--stats-json", stats, "--draft", 0)
    assert p.returncode == 0 and "no DSA indexer" not in p.stderr
    s = json.loads(stats.read_text())
    assert s["dsa_dense_past_topk"] is False and s["notes"] == []


def test_dsa_force_without_indexer_names_the_tensor(pair):
    _, bare = pair
    with pytest.raises(ContainerError, match=r"--dsa-force.*model\.layers\.0\.self_attn\.indexer\.wq_b\.weight"):
        model_init(bare, dsa_force=True)
    p = _cli("run", "--model", bare, "--prompt-ids", "5,6", "--max-tokens", 2, "--dsa-force")
    assert p.returncode == 1 and "indexer.wq_b.weight" in p.stderr and "Traceback" not in p.stderr


def test_partial_indexer_is_an_error(pair, tmp_path):
    full, _ = pair
    part = _strip(full, tmp_path / "part", lambda k: k.startswith("model.layers.3.self_attn.indexer.wk."))
    with pytest.raises(ContainerError, match=r"incomplete.*model\.layers\.3\.self_attn\.indexer\.wk\.weight"):
        model_init(part)
    p = _cli("plan", part)
    assert p.returncode == 2 and "indexer.wk.weight" in p.stderr


SWEEP = textwrap.dedent("""
    import itertools, json, sys
    import numpy as np
    from colibri import model_init
    from colibri._core import Sampler
    from colibri.draft import DraftPolicy
    dirs = json.loads(sys.argv[1])
    done = 0
    for (name, path), dsa, force, absorb, S in itertools.product(
            dirs.items(), (True, False), (False, True), (-1, 0, 1), (1, 5, 12)):
        combo = f"{name} dsa={dsa} force={force} absorb={absorb} S={S}"
        print(combo, flush=True)                # the last line names the combination that crashed
        try:
            m = model_init(path, dsa=dsa, dsa_force=force, absorb=absorb, cache_experts=2)
        except ValueError as e:                 # ContainerError: refused cleanly
            assert force and "--dsa-force" in str(e), combo
            continue
        ids = [(11 * i + 2) % m.cfg.vocab for i in range(S)]
        m.kv_alloc(S + 8)
        logits = m.step(ids, 0, absorb_mtp=True)
        out, _ = m.spec_decode(list(ids), S, 4, logits, Sampler(m.cfg.vocab, 0.0, 1.0, 1),
                               DraftPolicy(2 if m.has_mtp else 0))
        rows = m.step_all([1, 2, 3], S + len(out)) if S + len(out) + 3 <= m.max_t else logits[None]
        assert np.all(np.isfinite(rows)) and len(out) == 4, combo
        done += 1
    print("done", done)
""")


def test_no_combination_reaches_a_kernel_with_a_missing_buffer(pair, tmp_path):
    """Containers with and without the indexer, an HF float checkpoint, an MTP model, each with
    the indexer on/off/forced, every attention path and prompt lengths on both sides of
    index_topk: each either runs with finite logits or is refused with an error (in a
    subprocess, so a crash fails this test with the combination named)."""
    full, bare = pair
    mtp_bare = _strip(DATA / "tiny_mtp", tmp_path / "mtp_bare", lambda k: ".indexer." in k)
    cfg = json.loads((mtp_bare / "config.json").read_text())
    cfg["index_topk"] = 4                               # make the MTP model's contexts pass it
    (mtp_bare / "config.json").write_text(json.dumps(cfg))
    dirs = {"container": str(full), "container_no_indexer": str(bare), "hf_f32": str(DATA / "tiny_dsa"),
            "mtp_no_indexer": str(mtp_bare), "mtp": str(DATA / "tiny_mtp")}
    p = subprocess.run([sys.executable, "-c", SWEEP, json.dumps(dirs)], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="2"), timeout=600)
    last = p.stdout.strip().splitlines()[-1:] or [""]
    assert p.returncode == 0, f"exit {p.returncode} at: {last[0]}\n{p.stderr[-2000:]}"
    assert last[0].startswith("done") and int(last[0].split()[1]) >= 150


def test_chat_and_serve_front_ends_get_the_note(pair):
    """The API's start-up notes (printed by chat and serve) include the dense-attention note."""
    from colibri import load
    full, bare = pair
    a = load(str(bare))
    assert any("no DSA indexer" in n for n in a.model_notes())
    a.close()
    b = load(str(full))
    assert not any("no DSA indexer" in n for n in b.model_notes())
    b.close()
