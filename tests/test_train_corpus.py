"""The embedded model's corpus rules in tools/train_tiny.py (pure Python; torch, a test extra, only for fake_quant).

The held-out benchmark must stay the same set of stdlib files from one edition of the model to the
next, training files must not carry copies of held-out ones (vendored or backported modules), and
the loop measure of the model card must mean what it says.
"""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _train_tiny():
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "tools" / "train_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tt = _train_tiny()


def test_heldout_split_is_by_path_and_stable():
    # the rule hashes the relative path only: the same file is held out on every machine
    assert tt.is_heldout("a/b.py") == tt.is_heldout("a/b.py")
    rels = [f"pkg/m{i}.py" for i in range(2000)]
    share = sum(map(tt.is_heldout, rels)) / len(rels)
    assert 0.03 < share < 0.07, share
    train, held = tt.load_corpus()
    assert held and train and not {r for r, _ in held} & {r for r, _ in train}
    assert all(tt.is_heldout(r) for r, _ in held)


def test_package_paths_skip_test_folders():
    assert tt._skipped("django/tests/test_x.py") and tt._skipped("sympy/core/tests/test_basic.py")
    assert not tt._skipped("django/db/models/query.py") and not tt._skipped("tests.py")


def _module(name, n):
    return "\n".join(f"def {name}_function_number_{i}(argument_{i}):\n    return argument_{i} * {i}"
                     for i in range(n))


def test_duplicates_of_heldout_files_are_dropped():
    held = [("std/heldout.py", _module("held", 40))]
    vendored = "# vendored copy\n" + held[0][1]
    partial = _module("held", 20) + "\n" + _module("other", 20)       # half the held-out file's lines
    train = [("pkg/a.py", _module("alpha", 30)),
             ("pkg/vendor/heldout.py", vendored),
             ("pkg/b.py", _module("alpha", 30)),                      # exact copy of a.py
             ("pkg/partial.py", partial),
             ("pkg/c.py", _module("gamma", 30) + "\n" + _module("held", 3))]   # a few shared lines
    kept, dropped = tt.drop_duplicates(train, held)
    assert [r for r, _ in kept] == ["pkg/a.py", "pkg/c.py"]
    assert dropped == 3


def test_boilerplate_lines_do_not_make_files_duplicates():
    header = "\n".join(f"# Licensed under the same long licence header, line {i} of it" for i in range(12))
    held = [(f"pkg/h{i}.py", header + "\n" + _module(f"h{i}", 2)) for i in range(3)]
    train = [(f"pkg/t{i}.py", header + "\n" + _module(f"t{i}", 30)) for i in range(3)]
    kept, dropped = tt.drop_duplicates(train, held)
    assert dropped == 0 and len(kept) == 3


def test_distinct_ngrams_measures_loops():
    assert tt.distinct_ngrams(list(range(100))) == 1.0
    loop = [1, 2, 3] * 40
    assert tt.distinct_ngrams(loop) < 0.05
    assert tt.distinct_ngrams([5, 6]) == 1.0                             # shorter than one 4-gram
    half = list(range(50)) + [7, 8, 9, 10] * 13
    assert 0.4 < tt.distinct_ngrams(half) < 0.6


def test_repeat_marks_flag_the_tokens_a_loop_repeats():
    """The unlikelihood fine-tuning penalises exactly the continuation tokens that lie inside a
    4-gram seen earlier in the row (prefix included), never prefix tokens."""
    import numpy as np
    x = np.array([[1, 2, 3, 4, 5, 1, 2, 3, 4, 9, 1, 2, 3, 4],
                  [1, 2, 3, 4, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]])
    m = tt.repeat_marks(x, 2, 4)
    assert m[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1]
    assert m[1].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert not tt.repeat_marks(x, 6, 4)[:, :6].any()                      # prefix never marked
    assert not tt.repeat_marks(np.arange(40)[None], 0, 4).any()           # no repeat, no mark


def test_line_prefixes_are_whole_top_level_def_and_class_lines():
    import numpy as np
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(ROOT / "colibri" / "models" / "default" / "tokenizer.json"))
    text = ("import os\n\n\ndef alpha(x, y):\n    def inner(z):\n        return z\n    return x\n\n"
            "class Beta(object):\n    pass\n<|endoftext|>def gamma():\n    return 1\n")
    ids = np.asarray(tok.encode(text).ids)
    got = tt.line_prefixes(tok, np.concatenate([ids] * 8), 32)            # >= 8 lines of a length kept
    lines = {tok.decode(ids[s % len(ids):s % len(ids) + L].tolist()) for L, v in got.items() for s in v}
    assert lines == {"def alpha(x, y):", "class Beta(object):", "def gamma():"}    # not the indented def


def test_tune_rounds_chain_and_the_card_rebuilds_each(tmp_path):
    """A tuning round starts from the container of the round before: base_meta keeps the rounds that
    made the container (older metadata holds one round as a dict), refuses a round number that does
    not follow them, and the card's recipe lists every round in order."""
    import argparse
    import json
    meta = {"train": {}, "tune": {"steps": 420, "params": {}}}           # one round, the older layout
    (tmp_path / "train_meta.json").write_text(json.dumps(meta))
    args = argparse.Namespace(base_meta=str(tmp_path / "train_meta.json"), model=str(tmp_path), round=2)
    got = tt.base_meta(args)
    assert got["tune"] == [meta["tune"]]
    args.round = 1
    assert tt.base_meta(args)["tune"] == []                              # round 1 again: from the training
    args.round = 3
    try:
        tt.base_meta(args)
        raise AssertionError("round 3 accepted after one round")
    except SystemExit as e:
        assert "--round 3" in str(e)
    recipe = tt.rebuild_commands({"tune": [{"round": 1}, {"round": 2}]})
    r1, r2 = recipe.index("tune --round 1"), recipe.index("tune --round 2")
    assert r1 < recipe.index("convert --src /tmp/colibri_tiny_tuned1") < r2
    assert "--base-meta /tmp/colibri_tiny_tuned1/train_meta.json" in recipe[r2:]
    assert "card --src /tmp/colibri_tiny_tuned2" in recipe


def test_fake_quant_is_the_converters_quantization():
    """Quantization-aware tuning trains the image the converter will store: fake_quant equals
    colibri.quant's per-row quantize + dequantize bit for bit (int4 and int8, a zero row, ties)."""
    import numpy as np
    import torch
    from colibri.quant import dequantize, quantize
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 96)).astype(np.float32) * np.float32(0.05)
    w[1] = 0.0                                                           # scale floor
    w[2, :8] = np.float32(0.5) * np.arange(-4, 4, dtype=np.float32)      # exact halves: round to even
    for bits in (4, 8):
        payload, scales, _ = quantize(w, bits)
        want = dequantize(payload, scales, *w.shape)
        got = tt.fake_quant(torch.from_numpy(w.copy()), bits).numpy()
        assert np.array_equal(got, want), bits
        stacked = tt.fake_quant(torch.from_numpy(np.stack([w, w[::-1].copy()])), bits).numpy()
        assert np.array_equal(stacked[0], want)                          # [E, O, I]: rows of the last dim


def test_ditto_batches_repeat_one_corpus_span():
    """A DITTO sequence is a corpus prefix and then the span that follows it in the corpus,
    repeated to the sequence's length (period L from P on)."""
    import numpy as np
    tu = dict(tt.TUNE, ul_batch=4, ditto_len=96, ditto_span=(4, 9))
    std, pkg = np.arange(5000, dtype=np.uint16), np.arange(5000, 9000, dtype=np.uint16)
    for seed in range(5):
        x, P, L = tt.ditto_batch(np.random.default_rng(seed), std, pkg, 0.5, tu)
        x = x.numpy()
        assert x.shape == (4, 96) and 16 <= P <= 64 and 4 <= L <= 9
        for row in x:
            assert (np.diff(row[:P + L]) == 1).all()                     # contiguous corpus text
            assert (row[P + L:] == row[P:96 - L]).all()                  # then the span, again and again
