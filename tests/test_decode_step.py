"""Decode and verify forwards in C (layers_step: each layer's attention half in one parallel
region, attend_step, with the DSA selection when it runs; then the fused MLP with resident
experts used in place): the same values, bit for bit, as the call-by-call path (Model.attention,
kv_write, _dsa_select, the router, moe through the cache), for every model kind, weight format
and option that reaches it; forwards it cannot take (expanded attention, float matrices) fall
back to the call-by-call path."""
import numpy as np
import pytest

from colibri import _core, model_init
from colibri.convert import ConvertOptions, convert
from conftest import DATA
from test_no_indexer import _strip


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    root = tmp_path_factory.mktemp("step")
    out = {}
    for name, src, opts in [("int4", "tiny_dsa", ConvertOptions()),
                            ("int8", "tiny_dsa", ConvertOptions(expert_bits=8, dense_bits=8)),
                            ("int4_groups", "tiny_dsa", ConvertOptions(group_size=64)),
                            ("mtp_int4", "tiny_mtp", ConvertOptions())]:
        convert(DATA / src, root / name, opts, verbose=False)
        out[name] = root / name
    out["no_indexer"] = _strip(out["int4"], root / "bare", lambda k: ".indexer." in k)
    return out


def _run(m, stepped):
    """Prompt of 6 (within tiny_dsa's index_topk of 8), decode across index_topk, a verify batch:
    every logit row and the KV caches after."""
    m.stepped = stepped
    m.kv_alloc(24)
    m.reset_stats()
    logits = [m.step_all([(i * 37 + 11) % 256 for i in range(6)], 0)]
    tok = int(np.argmax(logits[0][-1]))
    for pos in range(6, 12):
        logits.append(m.step([tok], pos))
        tok = int(np.argmax(logits[-1]))
    logits.append(m.step_all([tok, 3, 5], 12))
    if m.has_mtp:
        logits.append(m.mtp_draft(tok, 15, 2))
    caches = [np.array(c) for c in list(m.Lc) + list(m.Rc) + (list(m.Ic) if m.Ic is not None else [])]
    return logits, caches, m.stepped_calls


CASES = [("int4", {}), ("int4", {"idot": 1}), ("int4", {"act_block": 64}), ("int8", {}),
         ("int4_groups", {}), ("mtp_int4", {}), ("no_indexer", {}), ("int4", {"cache_experts": 2}),
         ("tiny_dsa", {"dense_bits": 8, "expert_bits": 4}), ("tiny_dsa", {}), ("int4", {"dsa": False}),
         ("int4", {"absorb": 1}), ("int4", {"absorb": 0}), ("int4", {"dsa_force": True})]


@pytest.mark.parametrize("name,kw", CASES)
def test_one_region_equals_call_by_call(containers, name, kw):
    path = containers.get(name, DATA / name)
    m = model_init(path, **kw)
    off, caches_off, n_off = _run(m, False)
    on, caches_on, n_on = _run(m, True)
    assert n_off == 0
    for a, b in zip(off, on):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(caches_off, caches_on):
        np.testing.assert_array_equal(a, b)
    L = m.cfg.n_layers
    if (name == "tiny_dsa" and not kw) or kw.get("absorb") == 0:
        assert n_on == 0                      # f32 matrices / expanded attention: call by call
    else:
        # the prompt, 6 decodes (across index_topk: the indexer selects in the region), the
        # verify batch; the MTP layer's forwards come on top
        assert n_on == 8 * L if not m.has_mtp else n_on > 8 * L


def _cache_view(m, prefetch):
    """The cache's counters and LRU order; with prefetch on, only what does not depend on when
    the prefetch thread's loads finish."""
    st = m.cache.stats
    keys = ("requests", "lookahead_true", "lookahead_hit")
    if prefetch == "off":
        keys += ("hits_pin", "hits_lru", "hits_kept", "misses", "loads", "evictions", "released",
                 "prefetch_issued")
    lru = [m.cache.lru_order(l) for l in range(m.cfg.n_layers)] if prefetch == "off" else None
    return {k: st[k] for k in keys}, lru, m.cache.usage.tolist()


@pytest.mark.parametrize("prefetch", ["off", "on"])
@pytest.mark.parametrize("pins", [0, 3])
@pytest.mark.parametrize("keep", [None, 0, 1])
@pytest.mark.parametrize("mmap", ["1", "0"])
def test_experts_in_place_keep_the_cache_exact(containers, prefetch, pins, keep, mmap, monkeypatch):
    """Resident experts used in place by the C layers account in the cache as a get() would
    (hits, LRU order, usage, lookahead recall), and the engine's table mirrors the cache's
    tiers through evictions and pins (and the kept tier: model_init's, none, or one expert's
    worth that keeps releasing), experts mapped or read into buffers."""
    monkeypatch.setenv("COLIBRI_MMAP", mmap)
    views = []
    for stepped in (False, True):
        m = model_init(containers["int4"], cache_experts=2, prefetch=prefetch, dsa=False)
        assert m.mapped == (mmap == "1")
        if keep is not None:
            m.cache.set_keep_bytes(keep * m.expert_load(m.cfg.first_dense, 0).nbytes)
        if pins:
            m.cache.pin([(l, e) for l in range(m.cfg.first_dense, m.cfg.n_layers) for e in range(pins)])
        logits, _, n = _run(m, stepped)
        views.append((logits, _cache_view(m, prefetch)))
        m.cache.wait_prefetch()
        for l in range(m.cfg.n_layers + 1):
            held = sorted(m.cache.lru_order(l) + m.cache.pinned(l) + [e for r, e in m.cache.kept() if r == l])
            assert m.table_resident(l) == held
        m.close()
    (la, va), (lb, vb) = views
    for a, b in zip(la, lb):
        np.testing.assert_array_equal(a, b)
    assert va == vb


@pytest.mark.parametrize("threads", [1, 2])
def test_selection_over_many_key_blocks(containers, threads):
    """Past DSA_KEY_BLOCK keys the indexer's scores of a row are shared out among the threads in
    blocks; the selection and the output stay bit-identical to the call-by-call path."""
    before = _core.max_threads()
    m = model_init(containers["int4"], threads=threads)
    runs = []
    try:
        for stepped in (False, True):
            m.stepped = stepped
            m.kv_alloc(600)
            out = [m.step([(i * 37 + 11) % 256 for i in range(530)], 0)]
            tok = int(np.argmax(out[0]))
            for pos in range(530, 534):
                out.append(m.step([tok], pos))
                tok = int(np.argmax(out[-1]))
            out.append(m.step_all([tok, 7, 9], 534))
            runs.append(out + [np.array(a) for a in m.Ic if a is not None])
    finally:
        _core.set_threads(before)
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    assert m.stepped_calls >= 5 * m.cfg.n_layers


def _pick_reference(scores, topk):
    order = sorted(range(len(scores)), key=lambda t: (-float(scores[t]), t))
    return sorted(order[:topk])


@pytest.mark.parametrize("kind", ["random", "ties", "zeros", "ascending", "descending", "few"])
def test_dsa_pick_is_the_sorted_selection(kind):
    """dsa_pick (quickselect) keeps exactly the keys a full sort by (score desc, position asc)
    keeps, for score patterns that defeat naive pivots or rely on the tie rule."""
    rng = np.random.default_rng(7)
    n = 5000
    scores = {"random": rng.standard_normal(n), "ties": rng.integers(0, 4, n).astype(np.float32),
              "zeros": np.where(rng.random(n) < 0.9, 0.0, rng.random(n)), "ascending": np.arange(n),
              "descending": -np.arange(n), "few": rng.standard_normal(12)}[kind].astype(np.float32)
    for topk in (1, 7, 2048, len(scores) - 1, len(scores), len(scores) + 5):
        got = _core.dsa_pick_ids(scores, topk)
        assert got.tolist() == _pick_reference(scores, topk)
