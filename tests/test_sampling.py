"""Sampling settings beyond temperature and top-p: top-k, the repetition penalty (transformers'),
frequency and presence penalties (OpenAI's), with speculation still lossless under each."""
import numpy as np
import pytest

from colibri import _core, model_init
from conftest import DATA, decode

V = 64


def _logits(seed=0):
    return np.random.default_rng(seed).normal(0, 2, V).astype(np.float32)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (5, 1.0), (5, 0.6), (V, 0.9), (V + 9, 1.0)])
def test_top_k_then_top_p(top_k, top_p):
    """P: softmax(l / T), then the top_k tokens, then the top-p nucleus of their renormalized
    mass (transformers' order), renormalized."""
    lg = _logits(1)
    s = _core.Sampler(V, 0.8, top_p, seed=1, top_k=top_k)
    s.dist_build(lg)
    p = _softmax(lg.astype(np.float64) / 0.8)
    order = np.argsort(-p, kind="stable")[:min(top_k, V)]
    kept = p[order] / p[order].sum()
    n = min(int(np.searchsorted(np.cumsum(kept), top_p * (1 - 1e-6))) + 1, len(order)) if top_p < 1 else len(order)
    want = np.zeros(V)
    want[order[:n]] = kept[:n] / kept[:n].sum()
    np.testing.assert_allclose(np.asarray(s.P), want, atol=1e-6)
    assert np.count_nonzero(s.P) == n


def test_top_k_one_is_greedy():
    lg = _logits(2)
    s = _core.Sampler(V, 1.5, 1.0, seed=3, top_k=1)
    assert {s.pick_tok(lg, pos=i) for i in range(50)} == {int(np.argmax(lg))}


def _penalized(lg, history, rep, freq, pres, last_n):
    out = lg.astype(np.float64).copy()
    window = history[-last_n:] if last_n > 0 else (history if last_n < 0 else [])
    for t in set(window):
        c = window.count(t)
        out[t] = (lg[t] / rep if lg[t] > 0 else lg[t] * rep) - c * freq - pres
    return out


@pytest.mark.parametrize("rep,freq,pres,last_n", [(1.3, 0.0, 0.0, 64), (0.8, 0.0, 0.0, 64), (1.0, 0.5, 0.0, 64),
                                                  (1.0, 0.0, 0.7, 64), (1.2, 0.3, 0.4, 3), (1.2, 0.3, 0.4, -1),
                                                  (1.5, 1.0, 1.0, 0)])
def test_penalties_follow_their_definitions(rep, freq, pres, last_n):
    lg = _logits(4)
    history = [3, 9, 3, 60, 3, 9, 11, 0]
    s = _core.Sampler(V, 1.0, 1.0, seed=0, repeat_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                      repeat_last_n=last_n)
    np.testing.assert_allclose(np.asarray(s.penalize(lg, history), np.float64),
                               _penalized(lg, history, rep, freq, pres, last_n), rtol=1e-6, atol=1e-6)
    # greedy picks the argmax of the penalized logits
    g = _core.Sampler(V, 0.0, 1.0, repeat_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                      repeat_last_n=last_n)
    assert g.pick_tok(lg, history=history) == int(np.argmax(_penalized(lg, history, rep, freq, pres, last_n)))


@pytest.mark.parametrize("kw,msg", [(dict(top_k=-1), "top_k"), (dict(repeat_penalty=0.0), "repeat_penalty"),
                                    (dict(repeat_last_n=-2), "repeat_last_n"),
                                    (dict(frequency_penalty=float("nan")), "frequency_penalty")])
def test_sampler_rejects_bad_settings(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _core.Sampler(V, 1.0, 1.0, **kw)


def _repeating_prompt():
    return [5, 17, 5, 17, 5, 17, 99, 5, 17]


@pytest.mark.parametrize("name,depths", [("tiny_mtp", (2, "auto")), ("tiny_dense", (3,))])
@pytest.mark.parametrize("settings", [dict(repeat_penalty=1.5), dict(frequency_penalty=0.8, presence_penalty=0.5,
                                                                     repeat_last_n=16)])
def test_penalized_greedy_is_lossless_and_matches_plain_steps(name, depths, settings):
    """Greedy with a penalty: the same tokens with drafts (MTP or n-gram) as without, and as a
    step-by-step loop that takes the argmax of the penalized logits."""
    m = model_init(DATA / name)
    prompt = _repeating_prompt()
    plain, _ = decode(m, prompt, 24, 0, **settings)
    for d in depths:
        assert decode(m, prompt, 24, d, **settings)[0] == plain
    unpenalized, _ = decode(m, prompt, 24, 0)
    s = _core.Sampler(m.cfg.vocab, 0.0, 1.0, **settings)
    ids = list(prompt)
    m.kv_alloc(len(ids) + 30)
    lg = m.step(ids, 0)
    for i in range(24):
        t = s.pick_tok(lg, history=ids)
        ids.append(t)
        lg = m.step([t], len(ids) - 1)
    assert ids[len(prompt):] == plain
    assert plain != unpenalized                  # the penalty did change something here


@pytest.mark.parametrize("settings", [dict(top_k=4), dict(repeat_penalty=1.3, top_k=8),
                                      dict(frequency_penalty=0.5, presence_penalty=0.2)])
def test_seeded_sampling_with_settings_equals_plain_sampling(settings):
    """Sampled output keys each position's draw to (seed, position): with top-k and penalties the
    text equals plain sampling with the same seed, whatever the drafts."""
    m = model_init(DATA / "tiny_mtp")
    prompt = _repeating_prompt()
    for seed in (1, 2):
        plain, _ = decode(m, prompt, 32, 0, temperature=0.9, seed=seed, **settings)
        assert decode(m, prompt, 32, 3, temperature=0.9, seed=seed, **settings)[0] == plain
        assert decode(m, prompt, 32, "auto", temperature=0.9, seed=seed, **settings)[0] == plain
