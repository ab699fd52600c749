"""Long forwards run attention and the FFNs in row chunks (bounded scratch, each routed expert
still read once per layer): bit-identical to one batch, and the scratch is what the RAM plan counts."""
import numpy as np
import pytest

from colibri import model_init
from colibri import _core, tiers
from colibri.convert import convert
from conftest import DATA


def _prompt(n, vocab):
    return [(i * 37 + 11) % vocab for i in range(n)]


def _forward(path, chunk, ids, **kw):
    m = model_init(path, **kw)
    m.prefill_chunk = chunk
    m.kv_alloc(len(ids) + 8)
    m.record_routing()
    logits = m.step_all(ids, 0)
    # every routed expert the prompt needs was read once per layer (the cache holds fewer)
    assert m.expert_misses == sum(len(e) for _, layer, _, e in m.routing if layer < m.cfg.n_layers)
    after = m.step([ids[0]], len(ids))          # decode on the KV the chunks wrote
    return m, logits, after


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    out = tmp_path_factory.mktemp("int4") / "c"
    convert(DATA / "tiny_dsa", out, verbose=False)
    return out


@pytest.mark.parametrize("absorb", [-1, 0, 1])
@pytest.mark.parametrize("model", ["tiny_dsa", "tiny_mtp", "int4"])
def test_chunked_forward_is_bit_identical(model, absorb, int4):
    path = int4 if model == "int4" else DATA / model
    ids = _prompt(100, 256)                     # past tiny_dsa's index_topk (8): DSA selects, shared layers reuse
    a, la, da = _forward(path, 100000, ids, absorb=absorb, cache_experts=3)
    b, lb, db = _forward(path, 32, ids, absorb=absorb, cache_experts=3)
    assert b._work(len(ids), len(ids)).C == 32 and a._work(len(ids), len(ids)).C == len(ids)
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_array_equal(da, db)
    for i in range(len(a.Lc)):
        np.testing.assert_array_equal(a.Lc[i], b.Lc[i])


def test_plan_counts_the_scratch_the_engine_allocates():
    m = model_init(DATA / "tiny_dsa")
    ctx = 300
    m.kv_alloc(ctx)
    m.step(_prompt(ctx, 256), 0)
    ws = m._work(1, 1)
    held = sum(np.asarray(getattr(ws, k)).nbytes for k in _core.work_shapes(m.cfg, 1, 1, True, 1, 1))
    assert held == _core.work_bytes(m.cfg, ctx, ctx, True, _core.expanded_key_rows(m.cfg, ctx, -1),
                                    _core.max_threads())
    assert tiers.work_bytes_estimate(m, ctx) >= held


def test_long_prompt_scratch_is_bounded_by_the_chunk():
    """At GLM-5's widths a 6000-token prompt's scratch stays near 1 GB with chunks of 256 rows
    and the expanded path's kv_b rows capped (one batch on the expanded path would need several GB)."""
    from types import SimpleNamespace
    from colibri.config import parse_config
    cfg = parse_config(dict(vocab_size=154880, hidden_size=6144, num_hidden_layers=78, num_attention_heads=64,
                            n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                            intermediate_size=12288, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
                            qk_rope_head_dim=64, v_head_dim=256, n_shared_experts=1, index_topk=2048,
                            index_head_dim=128, index_n_heads=32, first_k_dense_replace=3))
    kvb = _core.expanded_key_rows(cfg, 6000, -1)
    assert kvb < 200                            # past ~146 keys GLM-5's prefill attends in the latent space
    chunked = _core.work_bytes(cfg, 6000, 6000, True, kvb, 2, 256)
    whole = _core.work_bytes(cfg, 6000, 6000, True, 6000, 2, 6000)
    assert chunked < 0.8e9 < 4 * chunked < whole
    assert tiers.work_bytes_estimate(SimpleNamespace(cfg=cfg, has_dsa=True), 6000) < 2.0e9


def test_long_batch_holds_few_experts_at_once(tmp_path):
    """A prefill whose batch needs every expert of a layer reads them a group at a time: the
    experts a call protects never exceed two groups (the RAM plan allows 2 x STREAM_GROUP)."""
    from colibri.budget import EXTRA_CALL_EXPERTS
    from colibri.cache import ExpertCache
    from colibri.models import default_model_dir
    m = model_init(default_model_dir(), cache_experts=1, prefetch=False)      # 16 experts per layer
    m.stream_group = 3
    cache = m.cache
    seen = []
    orig = ExpertCache.fetch

    def fetch(layer, eids, inline=False):
        f = orig(cache, layer, eids, inline)
        seen.append(len(cache._busy[layer]))
        return f

    cache.fetch = fetch
    ids = _prompt(200, m.cfg.vocab)
    m.kv_alloc(len(ids))
    m.record_routing()
    m.step(ids, 0)
    union = max(len(e) for _, _, _, e in m.routing)
    assert union == m.cfg.n_experts > 2 * m.stream_group      # the batch needs every expert ...
    assert 0 < max(seen) <= 2 * m.stream_group                # ... but holds at most two groups
    assert 2 * _core.STREAM_GROUP <= EXTRA_CALL_EXPERTS


@pytest.mark.parametrize("model", ["tiny_mtp", "int4"])
def test_expanded_attention_blocks_are_bit_identical_to_rows(model, int4):
    """Expanded attention takes ATTN_BLOCK query rows of a head together (their common keys
    through the multi-query kernels, each row's later keys alone): one forward of the prompt equals
    forwards of pieces whose rows fall into other blocks, and rows one at a time (tiny_mtp: causal
    keys; int4 of tiny_dsa past index_topk: DSA selections, each row on its own)."""
    path = int4 if model == "int4" else DATA / model
    ids = _prompt(70, 256)
    whole = model_init(path, absorb=0)
    whole.kv_alloc(len(ids) + 1)
    ref = whole.step_all(ids, 0)
    parts = model_init(path, absorb=0)
    parts.kv_alloc(len(ids) + 1)
    got, pos = [], 0
    for n in [5, 7, 3, 1, 1, 30, 23]:
        got.append(parts.step_all(ids[pos:pos + n], pos))
        pos += n
    assert pos == len(ids)
    np.testing.assert_array_equal(np.concatenate(got), ref)


@pytest.mark.parametrize("model", ["tiny_mtp", "int4"])
@pytest.mark.parametrize("batch", [0, 1000, 40, 23])
def test_prefill_in_batches_is_bit_identical(model, batch, int4):
    """Model.prefill(batch=N) (run --batch N): the prompt in near-equal forwards of <= N rows,
    each on the whole prompt's attention path, gives the logits, the KV cache, the MTP head's KV
    and the residual rows of one forward; progress reports every layer of every piece."""
    path = int4 if model == "int4" else DATA / model
    ids = _prompt(100, 256)

    def run(batch, progress=None):
        m = model_init(path, cache_experts=3)
        m.kv_alloc(len(ids) + 8)
        logits = (m.step(ids, 0, absorb_mtp=True) if batch is None else
                  m.prefill(ids, 0, batch=batch, progress=progress, absorb_mtp=True))
        return m, logits, m.step([ids[0]], len(ids))

    a, la, da = run(None)
    seen = []
    b, lb, db = run(batch, lambda done, total: seen.append((done, total)))
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_array_equal(da, db)
    for i in range(len(a.Lc)):
        np.testing.assert_array_equal(a.Lc[i], b.Lc[i])
        np.testing.assert_array_equal(a.Rc[i], b.Rc[i])
    pieces = 1 if batch in (0, 1000) else -(-len(ids) // batch)
    assert len(seen) == pieces * len(b.layers) and seen[-1] == (len(ids), len(ids))
    assert all(d0 <= d1 for (d0, _), (d1, _) in zip(seen, seen[1:]))


def test_prefill_rejects_a_negative_batch():
    m = model_init(DATA / "tiny_mtp")
    m.kv_alloc(16)
    with pytest.raises(ValueError, match="batch must be >= 0"):
        m.prefill([1, 2, 3], 0, batch=-1)


def test_absorbed_attention_head_blocks_are_bit_identical_to_decode(int4):
    """Absorbed prompt attention takes ATTN_BLOCK heads of a row together (the row's keys read
    once for them, through the multi-query kernels, with the DSA selection's indices: the int4
    container of tiny_dsa, past index_topk): a 40-row forward in chunks of 32 (Model.attention)
    equals forwards of <= 17 rows, which attend one head at a time in the decode step."""
    ids = _prompt(40, 256)
    whole = model_init(int4, absorb=1)
    whole.prefill_chunk = 32
    whole.kv_alloc(len(ids) + 1)
    ref = whole.step_all(ids, 0)
    assert whole._work(len(ids), len(ids)).C == 32
    parts = model_init(int4, absorb=1)
    parts.kv_alloc(len(ids) + 1)
    got, pos = [], 0
    for n in [9, 17, 3, 11]:
        got.append(parts.step_all(ids[pos:pos + n], pos))
        pos += n
    assert pos == len(ids)
    np.testing.assert_array_equal(np.concatenate(got), ref)


def test_long_prefill_multiplies_streamed_experts_in_place(int4, monkeypatch):
    """With COLIBRI_MAP_STREAM=1 a prefill forward of MAP_STREAM_MIN_ROWS rows or more uses the
    experts it streams in place in the file mapping (no copy into buffers): the same logits and KV
    as reading them (the default), the same bytes counted, and decode afterwards unchanged."""
    monkeypatch.setattr(_core, "MAP_STREAM_MIN_ROWS", 64)
    ids = _prompt(100, 256)

    def run(env):
        monkeypatch.setenv("COLIBRI_MMAP", "0")      # auto maps every expert where the tiles' layout is off (no VNNI)
        monkeypatch.setenv("COLIBRI_MAP_STREAM", "0" if env == "0" else "1")
        m = model_init(int4, cache_experts=3, prefetch=False)
        m.kv_alloc(len(ids) + 8)
        logits = m.step(ids, 0)
        prefill_read = m.bytes_read
        after = [m.step([t], len(ids) + i) for i, t in enumerate(ids[:4])]
        return m, logits, prefill_read, after

    a, la, ra, da = run("0")
    b, lb, rb, db = run(None)
    assert not a.map_stream and not a.mapped_experts_used()
    assert b.map_stream and not b.mapped and b.mapped_experts_used()
    np.testing.assert_array_equal(la, lb)
    for x, y in zip(da, db):
        np.testing.assert_array_equal(x, y)
    for i in range(len(a.Lc)):
        np.testing.assert_array_equal(a.Lc[i], b.Lc[i])
    assert ra == rb > 0
