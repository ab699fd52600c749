"""The native MTP head against the independent torch reference (tools/make_oracle.py)."""
import json

import numpy as np
import pytest

from colibri import _core, model_init
from colibri.convert import ConvertOptions, convert
from colibri.draft import DraftPolicy
from colibri.parity import check, load_ref
from conftest import DATA, decode

MTP = DATA / "tiny_mtp"


@pytest.fixture(scope="module")
def mref():
    return json.loads((MTP / "mtp_ref.json").read_text())


def _chains(m, full, depth):
    """Draft chain at every position p: MTP KV holds the true pairs of rows 0..p-1 (absorbed)."""
    m.kv_alloc(len(full) + depth + 2)
    m.step_all(full, 0)
    h = np.array(m.h_all, copy=True)
    chains, first = [], []
    for p in range(len(full) - 1):
        m.kv_start[m.cfg.n_layers] = -1
        if p > 0:
            m.mtp_absorb(full[1:p + 1], h[:p], 0)
        m.hlast = h[p].copy()
        chains.append(m.mtp_draft(full[p + 1], p + 1, depth))
        first.append(m.mtp_logits[0])
    return chains, np.array(first), h


def test_mtp_detected_with_few_experts():
    m = model_init(MTP)
    assert m.has_mtp and m.cfg.n_experts == 8 and m.mtp.index == m.cfg.n_layers
    assert not model_init(MTP, mtp=False).has_mtp
    assert not model_init(DATA / "tiny_dense").has_mtp


def test_main_model_parity_unchanged_by_head():
    res = check(model_init(MTP), load_ref(MTP / "ref.json"))
    assert res["tf_match"] == res["tf_total"] and res["greedy_match"] == res["greedy_total"]


def test_mtp_chains_match_torch_reference(mref):
    m = model_init(MTP)
    full = mref["full_ids"]
    chains, first, h = _chains(m, full, mref["depth"])
    assert len(chains) >= 20
    assert chains == mref["chains"]
    np.testing.assert_allclose(first, np.array(mref["first_logits"], np.float32), atol=2e-5)
    for p, ref_h in zip(mref["hidden_last_positions"], mref["hidden_last"]):
        np.testing.assert_allclose(h[p], ref_h, atol=1e-5)


def test_int8_head_drafts_like_f32(tmp_path, mref):
    """The converter writes the MTP layer at int8 even when experts are int4."""
    convert(MTP, tmp_path, ConvertOptions(expert_bits=4, dense_bits=4), verbose=False)
    m = model_init(tmp_path)
    assert m.eh_proj.fmt == "int8" and m.mtp.q_a.fmt == "int8"
    assert m.expert_load(m.cfg.n_layers, 0).gate.fmt == "int8"
    assert m.layers[3].q_a.fmt == "int4"


def test_greedy_mtp_drafts_are_lossless():
    m = model_init(MTP)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, int(rng.integers(3, 12))).tolist() for _ in range(20)]
    proposed = 0
    for prompt in prompts:
        plain, _ = decode(m, prompt, 64, 0)
        for depth in (1, 3):
            spec, pol = decode(m, prompt, 64, depth)
            assert spec == plain
            proposed += pol.proposed
    assert proposed > 0


def test_counters_and_guard_with_a_useless_head():
    """A random head is rejected nearly always: the guard turns drafting off after 24 proposals."""
    m = model_init(MTP)
    out, pol = decode(m, [3, 14, 159, 26, 53], 60, 3)
    assert len(out) == 60
    assert pol.proposed >= 24
    assert pol.off
    assert m.decode_forwards + pol.accepted == 59      # every emitted token but the first, once
    sampled, spol = decode(m, [3, 14, 159, 26, 53], 40, 2, temperature=0.9, seed=5)
    assert len(sampled) == 40 and spol.proposed > 0
    assert decode(m, [3, 14, 159, 26, 53], 40, 2, temperature=0.9, seed=5)[0] == sampled


class _Pattern(DraftPolicy):
    """Depths in a fixed pattern: drafting iterations separated by draft-free ones."""

    def __init__(self, pattern):
        super().__init__(max(pattern))
        self.pattern, self.i = pattern, 0

    def depth(self):
        d = self.pattern[self.i % len(self.pattern)]
        self.i += 1
        return d

    def record(self, *a, **kw):
        super().record(*a, **kw)
        self.off = False


def test_lazy_absorb_gives_exact_mtp_context():
    """Iterations without drafts skip the head; the rows they leave out are absorbed in one batch
    before the next draft. Every chain must equal one computed from scratch with an eagerly
    absorbed context."""
    m = model_init(MTP)
    prompt = [3, 14, 159, 26, 53, 58, 200, 11]
    m.kv_alloc(80)
    ids = list(prompt)
    logits = m.step(ids, 0)
    trace = []
    out, _ = m.spec_decode(ids, len(prompt), 40, logits, _core.Sampler(256, 0.0),
                           _Pattern([0, 0, 0, 2, 0, 2, 2, 0, 0, 3]), trace=trace)
    history = prompt + out
    assert len(trace) >= 8
    ref = model_init(MTP)
    for kv, nxt, drafts in trace:
        ref.kv_alloc(80)
        ref.step_all(history[:kv], 0)
        h = np.array(ref.h_all, copy=True)
        ref.mtp_absorb(history[1:kv], h[:kv - 1], 0)
        ref.hlast = h[kv - 1].copy()
        assert ref.mtp_draft(nxt, kv, len(drafts)) == drafts, kv


@pytest.fixture(scope="module")
def mtp_int4(tmp_path_factory):
    dst = tmp_path_factory.mktemp("mtp_int4")
    convert(MTP, dst, ConvertOptions(expert_bits=4, dense_bits=4), verbose=False)
    return dst


@pytest.mark.parametrize("cache", [0, 1])
def test_draft_chain_in_c_equals_the_calls(mtp_int4, mref, cache):
    """The chain in C (mtp_chain: no Python between draft steps) drafts and scores exactly what
    the layer-by-layer calls do; with one expert per layer cached, steps whose MTP experts are not
    resident hand their MLP to the cache and the chain goes on."""
    full = mref["full_ids"]
    fast = model_init(mtp_int4, cache_experts=cache)
    slow = model_init(mtp_int4, cache_experts=cache)
    slow.stepped = False                                # the per-call path, draft steps too
    a, first_a, _ = _chains(fast, full, 4)
    b, first_b, _ = _chains(slow, full, 4)
    assert fast.stepped_calls > 0 and slow.stepped_calls == 0
    assert a == b and sum(map(len, a)) == 4 * len(a)
    np.testing.assert_array_equal(first_a, first_b)


def test_draft_chain_stops_below_min_p(mtp_int4, mref):
    """min_p ends the chain before a draft the head itself doubts: the drafts are a prefix of the
    full chain's, none at all when min_p exceeds 1; greedy decoding stays lossless."""
    m = model_init(mtp_int4)
    full = mref["full_ids"][:12]
    m.kv_alloc(len(full) + 8)
    m.step_all(full, 0)
    h = np.array(m.h_all, copy=True)
    m.mtp_absorb(full[1:], h[:-1], 0)
    lengths = set()
    for min_p in (0.0, 0.05, 0.3, 0.9, 1.01):
        m.hlast = h[-1].copy()
        d = m.mtp_draft(5, len(full), 4, min_p)
        if min_p == 0.0:
            whole = d
        assert d == whole[:len(d)] and len(m.mtp_logits) == len(d)
        lengths.add(len(d))
    assert len(whole) == 4 and 0 in lengths
    pol = DraftPolicy(3)
    pol.min_p = 0.3
    prompt = [3, 14, 159, 26, 53]
    plain, _ = decode(m, prompt, 40, 0)
    m.kv_alloc(60)
    ids = list(prompt)
    out, _ = m.spec_decode(ids, len(prompt), 40, m.step(ids, 0), _core.Sampler(256, 0.0), pol)
    assert out == plain


class _Dropping(DraftPolicy):
    """Depth 3, with draft values that make the verify forward drop drafts: from the first one
    (keep=0), or after the first (keep=1), at any MoE layer where they would read an expert."""

    def __init__(self, keep):
        super().__init__(3)
        self.keep = keep

    def verify_values(self, g):
        return [1.0 if i < self.keep else 0.0 for i in range(g)]            # sure, or rejected


@pytest.mark.parametrize("keep", [0, 1])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_rows_dropped_for_reads_change_nothing(mtp_int4, keep, temperature, monkeypatch):
    """A draft row dropped at an MoE layer (its experts would be read from disk) is not accepted;
    the kept rows compute what they would have: greedy and sampled output equal --draft 0."""
    # experts read with pread on every ISA (mapped ones, the default where the tiles read the
    # container's layout, count as resident: no reads, nothing to drop)
    monkeypatch.setenv("COLIBRI_MMAP", "0")
    m = model_init(mtp_int4, cache_experts=1, prefetch=False)     # misses independent of timing
    dropped = 0
    for seed, prompt in enumerate(([3, 14, 159, 26, 53], [7, 7, 1, 200, 31, 9, 12])):
        plain, _ = decode(m, prompt, 40, 0, temperature=temperature, seed=seed)
        m.kv_alloc(len(prompt) + 60)
        m.reset_stats()
        ids = list(prompt)
        pol = _Dropping(keep)
        out, _ = m.spec_decode(ids, len(prompt), 40, m.step(ids, 0),
                               _core.Sampler(m.cfg.vocab, temperature, 1.0, seed), pol)
        assert out == plain
        dropped += m.rows_dropped
        if keep == 0:
            assert pol.accepted == 0 and sum(pol.verified_at) < pol.proposed
    assert dropped > 0
