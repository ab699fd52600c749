"""Container experts used in place in a read-only mapping of their file (Model.mapped): no copy, the
same tokens as experts read with pread, pages dropped from the RSS when the cache lets an expert go,
and evicted experts kept mapped within the RAM plan's page-cache reserve (COLIBRI_MMAP=1 here)."""
import json

import numpy as np
import pytest

from colibri import model_init, tiers
from colibri.convert import ConvertOptions, convert
from colibri.models import default_model_dir
from conftest import DATA, fat_twin, greedy_steps


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    dst = tmp_path_factory.mktemp("mapped_int4")
    convert(DATA / "tiny_dsa", dst, ConvertOptions(expert_bits=4, dense_bits=4, io_bits=8), verbose=False)
    return dst


@pytest.fixture(autouse=True)
def in_place(monkeypatch):
    """These tests are about the mapping: COLIBRI_MMAP=1 maps experts on every ISA (by default a
    model that lays rows out for the tiles reads its experts into buffers instead)."""
    monkeypatch.setenv("COLIBRI_MMAP", "1")


def decode(path, n=16, keep=None, **kw):
    """Prefill the reference prompt, then n greedy steps: (tokens, logits of every step, model)."""
    m = model_init(path, **kw)
    if keep is not None:
        m.cache.set_keep_bytes(keep)
    out, logits = greedy_steps(m, json.loads((DATA / "tiny_dsa" / "ref.json").read_text())["prompt_ids"], n)
    m.cache.wait_prefetch()
    return out, logits, m


def rss_file_kb():
    """File-backed resident pages of this process (the mapped experts among them), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


def test_a_mapped_expert_is_a_view_of_its_file_and_made_once(int4):
    m = model_init(int4, cache_experts=1)
    assert m.mapped
    layer = next(i for i in range(m.cfg.n_layers) if m.cfg.sparse[i])
    before = m.bytes_read
    E = m.expert_load(layer, 3)
    info = m.st.info(f"model.layers.{layer}.mlp.experts.3.gate_proj.weight")
    whole = m.st.map(info.file_index)
    for W in (E.gate, E.up, E.down):
        assert not W.data.flags.writeable and np.shares_memory(W.data, whole)
        assert np.shares_memory(W.scale, whole)              # F32 scales are used in place too
    assert np.array_equal(E.gate.data, m.st.read_raw(info.name))
    assert E.nbytes == tiers.expert_disk_bytes(m, layer, 3) and m.bytes_read - before == E.nbytes
    assert m.expert_load(layer, 3) is E                      # a later load faults the same pages in
    assert m.bytes_read - before == 2 * E.nbytes
    m.close()


@pytest.mark.parametrize("kw", [dict(cache_experts=1, keep=0), dict(cache_experts=1),
                                dict(cache_experts=2, prefetch="on", keep=0), dict(cache_experts=1, io_threads=1)])
def test_mapped_experts_decode_exactly_like_read_ones(int4, monkeypatch, kw):
    base_tokens, base_logits, full = decode(int4)
    tokens, logits, m = decode(int4, **kw)
    assert m.mapped and m.expert_misses > 0
    monkeypatch.setenv("COLIBRI_MMAP", "0")
    read_tokens, read_logits, r = decode(int4, **{k: v for k, v in kw.items() if k != "keep"})
    assert not r.mapped and r.cache.keep_bytes == 0
    assert tokens == read_tokens == base_tokens
    assert np.array_equal(logits, read_logits) and np.array_equal(logits, base_logits)


def test_released_experts_leave_the_rss_and_kept_ones_stay(tmp_path):
    """With no kept tier an evicted expert's pages leave the RSS at once (they stay in the page
    cache); with one, every expert of the layer stays mapped, and a later pass reads nothing.
    Measured on the embedded model's fat twin (tools/make_fat_twin.py, experts ~300 KB): the
    kernel's 64 KB fault-around maps a small expert's neighbours back in as soon as one is read."""
    fat = tmp_path / "fat"
    r = fat_twin(default_model_dir(), fat, 1024)
    assert r.returncode == 0, r.stderr
    layer_bytes = {}
    for keep in (0, 10 ** 9):
        m = model_init(fat, cache_experts=1, prefetch=False)
        m.cache.set_keep_bytes(keep)
        m.cache.get(2, [0])                          # everything imported, one layer's scales touched
        m.cache.get(1, [0])
        base = rss_file_kb()
        for e in range(m.cfg.n_experts):
            m.cache.get(1, [e])
        layer_bytes[keep] = 1024 * (rss_file_kb() - base)
        s = m.cache.stats
        if keep:
            assert s["released"] == 0 and s["kept_experts"] == m.cfg.n_experts - 1
            loads = s["loads"]
            for e in range(m.cfg.n_experts):
                m.cache.get(1, [e])
            assert m.cache.stats["loads"] == loads and m.cache.stats["hits_kept"] == m.cfg.n_experts
        else:
            assert s["released"] == m.cfg.n_experts - 1 and s["kept_experts"] == 0
        m.close()
    expert = tiers.expert_disk_bytes(m, 1)
    assert expert >= 4 * 65536
    # all but the first stay mapped; the kernel's RSS counters are batched per CPU and can lag by
    # hundreds of KB (a clean CI clone read 1 MiB for 15 experts of 99 KB), hence half of them
    assert layer_bytes[10 ** 9] >= (m.cfg.n_experts // 2 - 1) * expert
    assert layer_bytes[0] <= 2 * expert + 2 * 65536                   # the one held (+ fault-around)


def test_the_plan_sizes_the_kept_tier_and_direct_reads_do_not_map(int4):
    m = model_init(int4, cache_experts=1)
    t = tiers.configure(m, 64, requested=1, ram_gb=100, autopin=False)
    assert t.plan.streaming and t.plan.page_cache_reserve_bytes > 0
    assert m.cache.keep_bytes == t.plan.page_cache_reserve_bytes
    full = model_init(int4)
    tiers.configure(full, 64, requested=0, ram_gb=100, autopin=False)
    assert full.mapped and full.cache.keep_bytes == 0                  # every expert cached: nothing evicted
    try:
        d = model_init(int4, cache_experts=1, direct=True)
    except Exception as e:                       # a filesystem without O_DIRECT: said clearly
        assert "O_DIRECT" in str(e)
        return
    assert not d.mapped and d.cache.keep_bytes == 0
    tiers.configure(d, 64, requested=1, ram_gb=100, autopin=False)
    assert d.cache.keep_bytes == 0


def test_by_default_experts_are_mapped_unless_the_tiles_want_their_rows_interleaved(int4, monkeypatch):
    """COLIBRI_MMAP=auto: a model whose integer tiles read interleaved rows (AVX-512 VNNI) reads each
    expert into a buffer and interleaves it, the same bits as in place; the kept tier then holds
    read experts, and a second pass over a layer reads nothing."""
    monkeypatch.setenv("COLIBRI_MMAP", "auto")
    m = model_init(int4, cache_experts=1)
    assert m.mapped == (not m.lays_out())
    layer = next(i for i in range(m.cfg.n_layers) if m.cfg.sparse[i])
    E = m.expert_load(layer, 3)
    for W in (E.gate, E.up, E.down):
        assert W.interleaved == m.lays_out() and W.data.flags.writeable != m.mapped
    t = tiers.configure(m, 64, requested=1, ram_gb=100, autopin=False)
    assert m.keeps_evicted() and m.cache.keep_bytes == t.plan.page_cache_reserve_bytes > 0
    for e in range(m.cfg.n_experts):
        m.cache.get(layer, [e])
    loads = m.cache.stats["loads"]
    for e in range(m.cfg.n_experts):
        m.cache.get(layer, [e])
    assert m.cache.stats["loads"] == loads and m.cache.stats["hits_kept"] == m.cfg.n_experts
    m.close()
    auto_tokens, auto_logits, _ = decode(int4, cache_experts=1)
    for v in ("1", "0"):
        monkeypatch.setenv("COLIBRI_MMAP", v)
        tokens, logits, r = decode(int4, cache_experts=1)
        assert r.mapped == (v == "1") and tokens == auto_tokens and np.array_equal(logits, auto_logits)
    monkeypatch.setenv("COLIBRI_MMAP", "yes")
    with pytest.raises(ValueError, match="COLIBRI_MMAP"):
        model_init(int4, cache_experts=1)
