"""Speculative decoding: lossless greedy and sampled decoding, drafts, counters, draft policy."""
import numpy as np
import pytest

from colibri import _core, model_init
from colibri.convert import ConvertOptions, convert
from colibri.draft import DraftPolicy, parse_draft
from conftest import DATA, decode

VOCAB = 256


def _prompts(n, seed=0):
    """Prompts with repeats, so n-gram lookup finds drafts."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(0, VOCAB, size=int(rng.integers(4, 10))).tolist()
        out.append(base + base[: int(rng.integers(2, len(base)))] + rng.integers(0, VOCAB, 3).tolist())
    return out


@pytest.fixture(scope="module")
def int4_dsa(tmp_path_factory):
    dst = tmp_path_factory.mktemp("dsa_int4")
    convert(DATA / "tiny_dsa", dst, ConvertOptions(expert_bits=4, dense_bits=4, io_bits=8), verbose=False)
    return dst


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_dsa"])
def test_greedy_ngram_drafts_are_lossless_f32(name):
    m = model_init(DATA / name)
    proposed = accepted = 0
    for prompt in _prompts(20, seed=1):
        plain, _ = decode(m, prompt, 64, 0)
        assert len(plain) == 64
        for depth in (3, "auto"):
            spec, pol = decode(m, prompt, 64, depth)
            assert spec == plain
            proposed += pol.proposed
            accepted += pol.accepted
    assert proposed > 100 and accepted > 0


def test_greedy_drafts_lossless_on_int4_container(int4_dsa):
    """Rows never depend on their batch (same kernels, same attention path, experts accumulated in
    ascending id), so verification is bit-exact against plain decoding on quantized weights too."""
    m = model_init(int4_dsa)
    for prompt in _prompts(20, seed=2):
        plain, _ = decode(m, prompt, 64, 0)
        for depth in (1, 4, 16):
            assert decode(m, prompt, 64, depth)[0] == plain


@pytest.mark.parametrize("name,bits", [("tiny_dense", 8), ("tiny_mtp", 4)])
def test_greedy_drafts_lossless_on_containers(tmp_path, name, bits):
    """int8 container with n-gram drafts; int4 container with its int8 MTP head drafting."""
    convert(DATA / name, tmp_path, ConvertOptions(expert_bits=bits, dense_bits=bits, io_bits=8), verbose=False)
    m = model_init(tmp_path)
    assert m.has_mtp == (name == "tiny_mtp")
    proposed = 0
    for prompt in _prompts(20, seed=4):
        plain, _ = decode(m, prompt, 64, 0)
        spec, pol = decode(m, prompt, 64, 3)
        assert spec == plain
        proposed += pol.proposed
    assert proposed > 0


def test_verify_rows_equal_single_rowdecode(int4_dsa):
    m = model_init(int4_dsa)
    ids = _prompts(1, seed=3)[0] + [5, 6, 7, 8, 9]
    m.kv_alloc(len(ids))
    batch = m.step_all(ids[:8], 0)     # prefill-sized batch
    b2 = m.step_all(ids[8:], 8)        # verify-sized batch
    m.kv_alloc(len(ids))
    m.step_all(ids[:8], 0)
    rows = np.stack([m.step([t], 8 + i) for i, t in enumerate(ids[8:])])
    np.testing.assert_array_equal(rows, b2)


def test_ngram_draft():
    assert _core.ngram_draft([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert _core.ngram_draft([1, 2, 3, 4, 1, 2], 1) == [3]
    assert _core.ngram_draft([9, 1, 2, 7, 1, 2, 5, 1, 2], 2) == [5, 1]     # most recent match
    assert _core.ngram_draft([1, 2, 3, 4, 5], 3) == []
    assert _core.ngram_draft([1, 2, 1], 3) == []


# -- sampling ----------------------------------------------------------------------------------

def _chi2_pvalue(counts, probs):
    """Pearson chi-square p-value (categories with expected < 5 merged), via the regularized gamma."""
    n = counts.sum()
    exp = probs * n
    order = np.argsort(exp)
    c, e, acc_c, acc_e = [], [], 0.0, 0.0
    for i in order:
        acc_c += counts[i]
        acc_e += exp[i]
        if acc_e >= 5:
            c.append(acc_c)
            e.append(acc_e)
            acc_c = acc_e = 0.0
    if acc_e > 0:
        c[-1] += acc_c
        e[-1] += acc_e
    c, e = np.array(c), np.array(e)
    stat = float(((c - e) ** 2 / e).sum())
    dof = len(c) - 1
    return _gammaincc(dof / 2.0, stat / 2.0)


def _gammaincc(a, x):
    """Regularized upper incomplete gamma Q(a, x) (series / continued fraction)."""
    import math
    if x <= 0:
        return 1.0
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(10000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return 1.0 - total * math.exp(-x + a * math.log(x) - math.lgamma(a))
    b = x + 1 - a
    c = 1 / 1e-300
    d = 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def _accept_resample(sampler, logits, draft, pos, broken=False):
    """One draw of the token of position ``pos`` through spec_decode's own accept/resample calls
    for a draft: ``accepts`` (the position's race over p draws the draft: for a draft chosen
    without the key, probability p(draft)), else ``pick_tok`` with the draft banned through carry_ban.
    The broken rule accepts whenever an independent sample equals the draft and otherwise draws
    again from p without banning the draft (so the draft is over-represented)."""
    if broken:
        sampler.dist_build(logits)
        t = sampler.dist_sample()
        return draft if t == draft else sampler.dist_sample()
    if sampler.accepts(logits, draft, pos):
        return draft
    t = sampler.pick_tok(logits, draft, pos)     # (logits None: reuse P, built once by the caller)
    assert t != draft
    return t


@pytest.fixture(scope="module")
def next_logits():
    m = model_init(DATA / "tiny_dsa")
    m.kv_alloc(16)
    return m.step([3, 14, 159, 26, 53], 0) * 0.5     # a spread-out distribution


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.9, 0), (1.0, 24), (0.9, 40)])
@pytest.mark.parametrize("which", ["likely", "unlikely", "impossible"])
def test_sampled_acceptance_matches_target(next_logits, top_p, top_k, which):
    logits = next_logits.copy()
    logits[17] = -1e30                         # token 17 is impossible under p
    s = _core.Sampler(VOCAB, 1.0, top_p, seed=1234, top_k=top_k)
    s.dist_build(logits)
    p = np.array(s.P, dtype=np.float64)
    order = np.argsort(-p, kind="stable")
    draft = {"likely": order[0], "unlikely": order[np.count_nonzero(p) // 2], "impossible": 17}[which]
    assert (p[draft] == 0) == (which == "impossible")
    n = 20000
    counts = np.zeros(VOCAB)
    for pos in range(n):
        counts[_accept_resample(s, logits if pos == 0 else None, int(draft), pos)] += 1
    assert counts[p == 0].sum() == 0
    assert _chi2_pvalue(counts[p > 0], p[p > 0]) > 0.01


def test_broken_acceptance_rule_fails(next_logits):
    s = _core.Sampler(VOCAB, 1.0, 1.0, seed=99)
    s.dist_build(next_logits)
    p = np.array(s.P, dtype=np.float64)
    draft = int(np.argmax(p))
    counts = np.zeros(VOCAB)
    for pos in range(20000):
        counts[_accept_resample(s, next_logits, draft, pos, broken=True)] += 1
    assert _chi2_pvalue(counts[p > 0], p[p > 0]) < 0.01


@pytest.mark.parametrize("depth", [1, 3])
def test_sampled_output_does_not_depend_on_drafting(depth):
    """Draws are keyed by sequence position and coupled to the draft test, so a seeded sampled
    generation is the same text with drafts, without them, or with --draft auto (which decides by
    wall time)."""
    m = model_init(DATA / "tiny_mtp")
    for seed, prompt in enumerate(_prompts(4, seed=9)):
        plain, _ = decode(m, prompt, 40, 0, temperature=0.9, seed=seed, top_p=0.95)
        spec, pol = decode(m, prompt, 40, depth, temperature=0.9, seed=seed, top_p=0.95)
        auto, _ = decode(m, prompt, 40, "auto", temperature=0.9, seed=seed, top_p=0.95)
        assert spec == plain == auto
        assert pol.proposed > 0


def test_sampled_spec_decode_runs_and_counts():
    m = model_init(DATA / "tiny_dense")
    prompt = _prompts(1, seed=5)[0]
    out, pol = decode(m, prompt, 40, 3, temperature=0.8, seed=3)
    assert len(out) == 40
    assert m.decode_forwards + pol.accepted == 39
    again, _ = decode(m, prompt, 40, 3, temperature=0.8, seed=3)
    assert again == out


def test_sampler_details():
    s = _core.Sampler(5, 1.0, 0.5, seed=7)
    s.dist_build(np.log(np.array([0.1, 0.4, 0.2, 0.2, 0.1], np.float32)))
    # nucleus 0.5: 0.4, then the tie 0.2/0.2 resolved by ascending id -> ids 1 and 2 kept
    np.testing.assert_allclose(s.P, [0, 2 / 3, 1 / 3, 0, 0], rtol=1e-6)
    assert all(s.dist_sample(1) == 2 for _ in range(50))
    g = _core.Sampler(5, 0.0, 0.9)
    assert g.pick_tok(np.array([0, 3, 3, 1, 0], np.float32)) == 1        # first maximum
    with pytest.raises(ValueError):
        _core.Sampler(5, -1.0, 0.9)
    with pytest.raises(ValueError):
        _core.Sampler(5, 1.0, 0.0)
    a, b = _core.Sampler(5, 1.0, 1.0, seed=11), _core.Sampler(5, 1.0, 1.0, seed=11)
    assert [a.rndu() for _ in range(5)] == [b.rndu() for _ in range(5)]


# -- policy ------------------------------------------------------------------------------------

def test_guard_turns_drafting_off():
    pol = DraftPolicy(3)
    for _ in range(8):
        assert pol.depth() == 3
        pol.record(3, 3, 0, 0.01)
    assert pol.proposed == 24 and pol.off
    assert pol.depth() == 0


def test_guard_keeps_useful_drafts():
    pol = DraftPolicy(3)
    for _ in range(20):
        pol.record(3, 3, 1, 0.01)
    assert not pol.off and pol.depth() == 3


def test_the_drop_rule_keeps_learning_the_acceptance():
    """verify_values (what the engine weighs a draft row's expert reads against): None, keep every
    row, until DROP_MIN_VERIFIED drafts were verified; then the measured prefix acceptance, except
    on every DROP_EXPLORE_EVERY-th call, so that an estimate low enough to drop every draft (which
    would never be tested again) still meets the drafts' real fate and recovers."""
    from colibri.draft import DROP_EXPLORE_EVERY, DROP_MIN_VERIFIED
    pol = DraftPolicy(2)
    assert pol.verify_values(2) is None
    for _ in range(DROP_MIN_VERIFIED + 1):
        pol.record(2, 2, 0, 0.01)                    # an unlucky start: every draft rejected
    low = pol.verify_values(2)
    assert low is not None and low[0] < 0.2 and len(low) == 2
    kept = 0
    for _ in range(16 * DROP_EXPLORE_EVERY):         # from now on every draft would be accepted
        v = pol.verify_values(2)
        keep = v is None or v[0] > 0.5               # a drop rule that drops below one in two
        kept += keep
        pol.record(2, 2, 2 if keep else 0, 0.01, verified=2 if keep else 0)
    assert kept > 32 and pol.verify_values(2)[0] > 0.8   # exploration met the drafts' fate, the estimate recovered


def test_auto_prefers_no_drafts_when_they_do_not_pay():
    pol = DraftPolicy("auto")
    depths = []
    for _ in range(200):
        d = pol.depth()
        depths.append(d)
        pol.record(d, d, 0, 0.010 + 0.008 * d)       # every draft rejected, verify costs more
    assert depths[-50:].count(0) >= 48
    assert sum(1 for d in depths if d > 0) <= 12      # a few probes (each + 1 transition iteration), not a tax


def simulate(pol, n, accept, seconds, seed):
    """Run a policy n iterations: each draft accepted with probability `accept` until the first
    rejection; seconds(i, depth, depths so far) is the iteration's time. The depths it chose."""
    rng = np.random.default_rng(seed)
    depths = []
    for i in range(n):
        d = pol.depth()
        depths.append(d)
        k = 0
        while k < d and rng.random() < accept:
            k += 1
        pol.record(d, d, k, seconds(i, d, depths))
    return depths


def _noisy(base, rng):
    """An iteration's seconds on a host whose iterations vary with their expert reads: most near
    base, one in five several times slower."""
    return base * rng.lognormal(0.0, 0.25) * (3.0 if rng.random() < 0.2 else 1.0)


def _auto_vs_best(accept, row_cost, seed):
    """auto on the noisy host for 400 iterations: drafts accepted with probability `accept`, each
    verify row costing row_cost of a step. Its expected seconds per token against the best fixed
    depth's (1.0: as good as the best)."""
    rng = np.random.default_rng(seed)
    depths = simulate(DraftPolicy("auto"), 400, accept, lambda i, d, _: _noisy(0.03 * (1 + d * row_cost), rng),
                      seed=seed)
    spt = [(1 + d * row_cost) / sum(accept ** r for r in range(d + 1)) for d in range(5)]
    return min(spt) / np.mean([spt[d] for d in depths])


@pytest.mark.parametrize("seed", range(4))
def test_auto_is_not_fooled_by_noise_when_drafts_do_not_pay(seed):
    """Drafts that do not pay (three in ten accepted, a draft row costs a third of a step: depth 1
    is 2% slower per token than depth 0, depth 2 19%) on a host whose iteration times vary by a
    factor of several: a probe's verdict within the noise is no win, so auto stays within 5% of
    depth 0 (a policy that believed four noisy samples wandered to depths 3-4: 0.79)."""
    assert _auto_vs_best(0.3, 1 / 3, seed) >= 0.95


@pytest.mark.parametrize("seed", range(4))
def test_auto_finds_a_clear_win_through_noise(seed):
    """The same noise, drafts accepted 9 in 10 and cheap verify rows: auto climbs towards depth 4
    (the first hundred iterations included)."""
    assert _auto_vs_best(0.9, 0.1, seed) >= 0.75


def test_auto_finds_the_best_depth():
    depths = simulate(DraftPolicy("auto"), 300, 0.8, lambda i, d, _: 0.010 + 0.001 * d, seed=0)  # cheap verify
    assert np.mean(depths[-100:]) >= 2.5


def test_auto_does_not_probe_a_depth_that_cannot_pay():
    """Depth 1 wins (0.00875 s/token against depth 0's 0.010), depth 2 loses even at a linear cost
    per row (0.0092): once depths 0 and 1 are measured, probes up from 1 are skipped (their best
    case loses), so after one probe (while the acceptance of draft 2 is still a guess) no iteration
    runs at depth 2 or deeper, and depth 1 holds."""
    pol = DraftPolicy("auto")
    depths = simulate(pol, 300, 0.6, lambda i, d, _: 0.010 + 0.004 * d, seed=3)
    assert depths[-200:].count(1) >= 190
    assert sum(1 for d in depths if d >= 2) <= 6 and max(depths[50:]) == 1
    assert pol._cannot_pay(2) and not pol._cannot_pay(1)


def test_auto_judges_a_probe_against_fresh_costs():
    """Depth 0's first iterations are slow (a cold cache after load): a probe must not win against
    them once depth 0 runs fast; the iterations right after a losing probe (the probe's evictions)
    are not depth 0's cost."""
    def seconds(i, d, depths):
        cost = (0.030 if i < 6 else 0.010) if d == 0 else 0.0095 + 0.0095 * d   # depth 1: 0.0109 s/token
        after_probe = i > 0 and depths[-2] > 0 and d == 0
        return cost * (3 if after_probe else 1)

    pol = DraftPolicy("auto")
    depths = simulate(pol, 300, 0.75, seconds, seed=2)
    assert depths[-100:].count(0) >= 90
    assert pol.iteration_seconds(0) == 0.010


def test_parse_draft():
    assert parse_draft("auto") == "auto" and parse_draft("3") == 3 and parse_draft(0) == 0
    for bad in ("-1", "17", "x", "2.5"):
        with pytest.raises(ValueError, match="--draft"):
            parse_draft(bad)


def test_auto_carries_its_measurements_to_the_next_generation():
    """A policy built from a previous generation's starts at the depth that won there."""
    first = DraftPolicy("auto")
    simulate(first, 200, 0.85, lambda i, d, _: 0.010 + 0.001 * d, seed=1)
    best = first.incumbent()
    assert best >= 3
    nxt = DraftPolicy("auto", prior=first)
    assert nxt.depth() == best and nxt.proposed == 0 and nxt.iterations == 0
    assert DraftPolicy(2, prior=first).depth() == 2                 # a fixed depth ignores it


def test_auto_keeps_probing_across_short_generations():
    """Generations shorter than the probe gap (which grows to 64 after losing probes) still probe:
    the count of iterations since the last probe goes on from one generation to the next, so a
    depth that won by the host's noise is re-judged, and a session settles on the faster depth."""
    def seconds(i, d, _):
        return 0.010 if d == 0 else 0.0095 + 0.0095 * d          # depth 1: 0.0109 s/token
    pol = DraftPolicy("auto")
    pol._cur = 1                                                  # as if depth 1 had won by luck
    pol.probe_gap = 64
    tail = []
    for g in range(12):                                           # 12 generations of 30 iterations
        tail = simulate(pol, 30, 0.75, seconds, seed=10 + g)
        pol = DraftPolicy("auto", prior=pol)
    assert tail.count(0) >= 25


def test_auto_policy_survives_the_embedded_model_session():
    """Through the public API: two requests in one LLM; the second starts from the first's policy,
    and both equal --draft 0 (greedy)."""
    import colibri
    llm = colibri.load(options=colibri.Options(max_tokens=24, temperature=0.0))
    plain = colibri.load(options=colibri.Options(max_tokens=24, temperature=0.0, draft=0))
    for prompt in ("def fibonacci(n):\n", "import os\n"):
        assert llm.complete(prompt).token_ids == plain.complete(prompt).token_ids
    assert llm.session.policy is not None and llm.session.policy.iterations > 0


def test_raced_drafts_keep_the_target_distribution_and_agree_more(next_logits):
    """A draft raced from a nearby distribution Q with the position's key (draft_pick, what the
    MTP chain does when sampling) is accepted when the position's race over p draws it: the
    emitted tokens still follow p exactly (chi-square), and the draft is accepted more often than
    the point-mass draft argmax Q, which is accepted with probability p(argmax Q)."""
    s = _core.Sampler(VOCAB, 1.0, 1.0, seed=4321)
    q_logits = next_logits + np.random.default_rng(3).normal(0, 0.3, next_logits.shape).astype(np.float32)
    s.dist_build(next_logits)
    p = np.array(s.P, dtype=np.float64)
    n = 20000
    counts = np.zeros(VOCAB)
    raced = 0
    for pos in range(n):
        draft = s.draft_pick(q_logits, pos)          # leaves P as dist_build made it
        t = _accept_resample(s, None, int(draft), pos)
        raced += t == draft
        counts[t] += 1
    assert _chi2_pvalue(counts[p > 0], p[p > 0]) > 0.01
    point_mass = p[int(np.argmax(q_logits))]
    assert raced / n > point_mass + 0.1, (raced / n, point_mass)
