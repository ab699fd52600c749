"""Expert tiers end to end: every cache, pin, prefetch and I/O setting computes exactly the same
tokens; pins, autopin, the RAM budget and the stats do what they say."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri import model_init, tiers, usage
from colibri.convert import ConvertOptions, convert
from conftest import DATA, greedy_steps

ROOT = DATA.parent.parent


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    """tiny_dsa in the int4 container (experts read with one pread each)."""
    dst = tmp_path_factory.mktemp("dsa_int4")
    convert(DATA / "tiny_dsa", dst, ConvertOptions(expert_bits=4, dense_bits=4, io_bits=8), verbose=False)
    return dst


def decode(path, n=20, keep=None, **kw):
    """Prefill 12 tokens, then n greedy steps: (tokens, logits of every step, model). keep: the
    size of the cache's kept tier (default: model_init's)."""
    m = model_init(path, **kw)
    if keep is not None:
        m.cache.set_keep_bytes(keep)
    out, logits = greedy_steps(m, json.loads((DATA / "tiny_dsa" / "ref.json").read_text())["prompt_ids"], n)
    m.cache.wait_prefetch()
    return out, logits, m


def colibri(*args, env=None):
    e = dict(os.environ, OMP_NUM_THREADS="2", **(env or {}))
    p = subprocess.run([sys.executable, "-m", "colibri", *map(str, args)], capture_output=True, text=True,
                       env=e, timeout=300, cwd=ROOT)
    return p


SETTINGS = {
    "all cached": dict(),
    "1 cached, prefetch": dict(cache_experts=1),
    "2 cached, no prefetch": dict(cache_experts=2, prefetch=False),
    "1 cached, 1 reader": dict(cache_experts=1, io_threads=1),
    "3 cached, 8 readers": dict(cache_experts=3, io_threads=8),
}


def test_every_tier_setting_is_bit_identical(int4):
    base_tokens, base_logits, _ = decode(int4)
    for name, kw in SETTINGS.items():
        tokens, logits, m = decode(int4, **kw)
        assert tokens == base_tokens, name
        assert np.array_equal(logits, base_logits), name
        if kw.get("cache_experts"):
            assert m.expert_misses > 0 and m.bytes_read > 0, name


@pytest.mark.parametrize("idot", [1, 2])
def test_experts_read_at_start_are_own_laid_out_and_exact(int4, idot):
    """Every expert fits: configure reads them all (warm) into memory of their own, rows laid out
    for the tiles where the integer kernels read them so (AVX-512 VNNI), never file views; the
    logits equal those of experts used in place from the mapping, read on first use."""
    from colibri import _core
    m = model_init(int4, idot=idot)
    t = tiers.configure(m, 64, autopin=False)
    cfg = m.cfg
    moe = [layer for layer in range(cfg.n_layers) if cfg.sparse[layer]]
    assert t.warmed == len(moe) * cfg.n_experts and t.warmed_bytes > 0 and t.warm_s >= 0
    assert all(m.cache.tier(layer, e) == "lru" for layer in moe for e in range(cfg.n_experts))
    E = m.cache.get(moe[0], [0])[0]
    assert getattr(E, "mapped", None) is None
    assert E.gate.interleaved == (_core.isa_active() == "avx512vnni")
    # each matrix starts on a cache line (a 64-byte load of a row never straddles two), and so do
    # the resident matrices read from the container
    for W in (E.gate, E.up, E.down, m.layers[0].q_a, m.layers[0].o_proj, m.lm_head):
        assert W.data.ctypes.data % 64 == 0
    # ... carved out of a few large chunks (advised to the kernel for transparent huge pages)
    def root(a):
        while a.base is not None and isinstance(a.base, np.ndarray):
            a = a.base
        return a
    experts = [m.cache.get(layer, [e])[0] for layer in moe for e in range(cfg.n_experts)]
    roots = {id(root(X.gate.data)): root(X.gate.data) for X in experts}
    assert len(roots) < len(experts) and all(r.nbytes >= 4 << 20 for r in roots.values())
    m.reset_stats()
    ref = json.loads((DATA / "tiny_dsa" / "ref.json").read_text())
    ids = list(ref["prompt_ids"])
    m.kv_alloc(len(ids) + 9)
    warm = [m.step(ids, 0)] + [m.step([5 + i], len(ids) + i) for i in range(8)]
    assert m.expert_misses == 0
    lazy = model_init(int4, idot=idot)
    tiers.configure(lazy, 64, autopin=False, warm=False)
    lazy.kv_alloc(len(ids) + 9)
    plain = [lazy.step(ids, 0)] + [lazy.step([5 + i], len(ids) + i) for i in range(8)]
    assert lazy.expert_misses > 0
    assert np.array_equal(np.stack(warm), np.stack(plain))
    # a prompt past the prefill chunk (256 rows: experts read 8 at a time, chunked FFNs)
    long_ids = [(i * 37) % (cfg.vocab - 2) + 2 for i in range(300)]
    for mm in (m, lazy):
        mm.kv_alloc(301)
    assert np.array_equal(m.step_all(long_ids, 0), lazy.step_all(long_ids, 0))


def test_present_experts_are_multiplied_during_reads_exactly(int4, monkeypatch):
    """With experts streaming, an MoE call multiplies the experts already present (and the shared
    one) while the others are read, then sums in the plain order: bit-identical to the plain call
    (COLIBRI_OVERLAP=0) and to the all-cached model."""
    base_tokens, base_logits, _ = decode(int4)
    tokens, logits, m = decode(int4, cache_experts=1, io_threads=2)
    assert m.overlapped_calls > 0
    monkeypatch.setenv("COLIBRI_OVERLAP", "0")
    plain_tokens, plain_logits, p = decode(int4, cache_experts=1, io_threads=2)
    assert p.overlapped_calls == 0
    assert tokens == plain_tokens == base_tokens
    assert np.array_equal(logits, plain_logits) and np.array_equal(logits, base_logits)


@pytest.mark.parametrize("kw", [dict(cache_experts=1, io_threads=2), dict(cache_experts=1, direct=True),
                                dict(cache_experts=1, io_threads=2, read=True)])
def test_shard_that_shrinks_while_decoding_is_a_clear_error(int4, tmp_path, monkeypatch, kw):
    """The container is cut short while a model streams its experts from it: the next call that
    must read a lost expert raises an error naming the file (from the overlapped MoE path, the
    prefetch thread or a plain read), without a hang or a crash, and the model can be closed."""
    import shutil
    from colibri.st import ContainerError
    model = tmp_path / "m"
    shutil.copytree(int4, model)
    kw = dict(kw)
    if kw.pop("read", False):
        monkeypatch.setenv("COLIBRI_MMAP", "0")     # experts read with pread (else mapped, unless direct)
    try:
        m = model_init(model, **kw)
    except ContainerError as e:                     # O_DIRECT unsupported here: said clearly
        assert "O_DIRECT" in str(e)
        return
    ref = json.loads((DATA / "tiny_dsa" / "ref.json").read_text())
    ids = list(ref["prompt_ids"])
    m.kv_alloc(len(ids) + 40)
    logits = m.step(ids, 0)
    shard = next(p for p in model.iterdir() if p.suffix == ".safetensors")
    os.truncate(shard, os.path.getsize(shard) // 3)
    with pytest.raises(Exception) as ei:
        for i in range(30):                         # some step must miss an expert that is gone
            logits = m.step([int(np.argmax(logits))], len(ids) + i)
    assert shard.name in str(ei.value) and "short read" in str(ei.value), repr(ei.value)
    m.cache.close()


def test_evicted_expert_buffers_are_reused_exactly(int4, monkeypatch):
    """Loads reuse the payload buffers of evicted experts once nothing references them (experts
    read with pread: COLIBRI_MMAP=0); the outputs stay bit-identical to a cache that never evicts."""
    base_tokens, base_logits, _ = decode(int4)
    monkeypatch.setenv("COLIBRI_MMAP", "0")
    tokens, logits, m = decode(int4, cache_experts=1, prefetch=False)
    assert tokens == base_tokens and np.array_equal(logits, base_logits)
    assert m.io_stats()["buffers_reused"] > 0


@pytest.mark.parametrize("mapped", [True, False])
def test_prefetch_loads_into_the_cache_and_counts_recall(int4, monkeypatch, mapped):
    monkeypatch.setenv("COLIBRI_MMAP", "1" if mapped else "0")
    _, _, m = decode(int4, cache_experts=2, keep=0)        # no kept tier: the prefetch has work to do
    assert m.mapped == mapped
    s = m.cache.stats
    assert m.pilot and s["prefetch_issued"] > 0 and s["prefetch_loaded"] > 0
    assert 0.0 < s["prefetch_recall"] <= 1.0 and s["lookahead_true"] > 0
    assert s["prefetch_loaded"] == s["prefetch_used"] + s["prefetch_dropped"] + s["prefetch_wasted"] + s["prefetch_unused"]
    _, _, off = decode(int4, cache_experts=2, prefetch=False)
    assert not off.pilot and off.cache.stats["prefetch_issued"] == 0
    # every expert cached: nothing to prefetch, the lookahead does not run
    _, _, full = decode(int4)
    assert not full.pilot and full.cache.stats["prefetch_issued"] == 0


def test_direct_reads_are_exact_or_refused_clearly(int4):
    base_tokens, base_logits, _ = decode(int4, n=6)
    try:
        tokens, logits, m = decode(int4, n=6, cache_experts=1, direct=True)
    except Exception as e:               # a filesystem without O_DIRECT (tmpfs): a clear error
        assert "O_DIRECT" in str(e) and "--direct" in str(e)
        return
    assert tokens == base_tokens and np.array_equal(logits, base_logits)
    assert m.bytes_read > 0


def test_pins_are_hits_and_exact(int4, tmp_path):
    c = json.loads((DATA / "tiny_dsa" / "config.json").read_text())
    moe = [i for i in range(c["num_hidden_layers"]) if i >= c.get("first_k_dense_replace", 0)]
    stats = tmp_path / "stats.txt"
    stats.write_text("".join(f"{layer} {e} {100 - e}\n" for layer in moe for e in range(4)))
    m = model_init(int4, cache_experts=1)
    t = tiers.configure(m, 64, requested=1, pin=str(stats), pin_gb=1.0, autopin=False)
    assert t.pinned == 4 * len(moe) and t.pinned_bytes > 0
    assert sorted(m.cache.pinned(moe[0])) == [0, 1, 2, 3]
    base_tokens, _, _ = decode(int4)
    m.kv_alloc(40)
    ref = json.loads((DATA / "tiny_dsa" / "ref.json").read_text())
    ids = list(ref["prompt_ids"])
    logits = m.step(ids, 0)
    out = []
    for i in range(20):
        out.append(int(np.argmax(logits)))
        logits = m.step([out[-1]], len(ids) + i)
    assert out == base_tokens
    assert m.cache.stats["hits_pin"] > 0


def test_ram_budget_sizes_the_cache_and_refuses_what_cannot_fit(int4):
    m = model_init(int4)
    big = tiers.configure(m, 64, requested=2, ram_gb=100, autopin=False)
    assert big.plan.capacity == 2 and m.cache.capacity == 2
    assert big.plan.projected_peak_bytes == sum(big.plan.components().values())
    # auto sizing: every expert when they fit (lowering under a tight budget is covered by
    # test_usage_budget's plan_ram tests)
    full = tiers.configure(model_init(int4), 64, requested=0, ram_gb=100, autopin=False, runtime=0)
    assert full.plan.capacity == full.plan.n_experts and full.plan.projected_peak_bytes <= full.plan.budget_bytes
    with pytest.raises(ValueError, match="not enough RAM"):
        tiers.configure(model_init(int4), 64, ram_gb=1e-6, autopin=False)


def test_history_is_saved_and_autopins(int4, tmp_path):
    env = {"COLIBRI_USAGE_DIR": str(tmp_path / "hist")}
    ref = json.loads((DATA / "tiny_dsa" / "ref.json").read_text())
    prompt = ",".join(map(str, ref["prompt_ids"]))
    s1, s2 = tmp_path / "s1.json", tmp_path / "s2.json"
    p = colibri("run", "--model", int4, "--prompt-ids", prompt, "-n", 16, "-t", 0, "--cache-experts", 2,
                "--stats-json", s1, env=env)
    assert p.returncode == 0, p.stderr
    files = list((tmp_path / "hist").iterdir())
    assert len(files) == 1
    c = json.loads((DATA / "tiny_dsa" / "config.json").read_text())
    counts, _ = usage.load_counts(files[0], c["num_hidden_layers"] + 1, c["n_routed_experts"])
    assert counts.sum() > 0
    # enough history for autopin (>= 5000 selections): the next run pins its hottest experts
    usage.save_counts(files[0], counts * 1000)
    p = colibri("run", "--model", int4, "--prompt-ids", prompt, "-n", 16, "-t", 0, "--cache-experts", 2,
                "--stats-json", s2, env=env)
    assert p.returncode == 0, p.stderr
    a, b = json.loads(s1.read_text()), json.loads(s2.read_text())
    assert b["pinned_experts"] > 0 and b["hits_pin"] > 0 and "[PIN]" in p.stderr
    assert a["tokens"] == b["tokens"]
    p = colibri("run", "--model", int4, "--prompt-ids", prompt, "-n", 4, "-t", 0, "--cache-experts", 2,
                "--no-autopin", "--stats-json", s2, env=env)
    assert p.returncode == 0 and json.loads(s2.read_text())["pinned_experts"] == 0


def test_stats_json_reports_tiers_disk_and_time(int4, tmp_path):
    ref = json.loads((DATA / "tiny_dsa" / "ref.json").read_text())
    stats = tmp_path / "s.json"
    p = colibri("run", "--model", int4, "--prompt-ids", ",".join(map(str, ref["prompt_ids"])), "-n", 12, "-t", 0,
                "--cache-experts", 1, "--stats-json", stats)
    assert p.returncode == 0, p.stderr
    s = json.loads(stats.read_text())
    for key in ("read_gb_s", "prefetch_recall", "hit_rate", "hits_pin", "hits_lru", "misses", "prefetch_wasted",
                "time_disk_wait_s", "time_expert_matmul_s", "time_attention_s", "time_other_s",
                "ram_budget_bytes", "projected_peak_bytes", "cache_experts"):
        assert key in s, key
    assert s["read_gb_s"] > 0 and 0 <= s["hit_rate"] <= 1 and 0 <= s["prefetch_recall"] <= 1
    assert s["cache_experts"] == 1 and s["bytes_read"] > 0
    assert "prefetch recall" in p.stderr and "disk wait" in p.stderr and "[RAM]" in p.stderr


@pytest.mark.parametrize("cached,env", [("0", {}), ("1", {}), ("1", {"COLIBRI_MMAP": "1"}),
                                        ("1", {"COLIBRI_MMAP": "0"})])
def test_peak_rss_stays_under_the_budget(int4, tmp_path, cached, env):
    """Every expert cached, or 1 per layer with the others mapped in place or read (kept within
    the page-cache reserve; by default as the ISA decides): the peak RSS fits a budget 5% above
    the plan's projection."""
    ref = json.loads((DATA / "tiny_dsa" / "ref.json").read_text())
    stats = tmp_path / "s.json"
    args = ["run", "--model", int4, "--prompt-ids", ",".join(map(str, ref["prompt_ids"])), "-n", 12, "-t", 0,
            "--cache-experts", cached, "--stats-json", stats]
    p = colibri(*args, "--ram", 100, env=env)
    plan_peak = json.loads(stats.read_text())["projected_peak_bytes"]
    budget = plan_peak * 1.05
    p = colibri(*args, "--ram", budget / 1e9, env=env)
    assert p.returncode == 0, p.stderr
    s = json.loads(stats.read_text())
    assert s["peak_rss_bytes"] <= s["ram_budget_bytes"], (s["peak_rss_bytes"], s["ram_budget_bytes"])
    if env:
        assert s["experts_mapped"] == (env["COLIBRI_MMAP"] == "1")


def test_tier_options_bad_input():
    p = colibri("run", "--model", DATA / "tiny_dsa", "--prompt-ids", "1,2", "--io-threads", 0)
    assert p.returncode != 0 and "--io-threads" in p.stderr
    p = colibri("run", "--model", DATA / "tiny_dsa", "--prompt-ids", "1,2", "--pin", "/nonexistent/stats")
    assert p.returncode != 0 and "/nonexistent/stats" in p.stderr


@pytest.fixture(scope="module")
def mtp_int4(tmp_path_factory):
    dst = tmp_path_factory.mktemp("mtp_int4")
    convert(DATA / "tiny_mtp", dst, ConvertOptions(expert_bits=4, dense_bits=4, io_bits=8), verbose=False)
    return dst


def test_mtp_tier_keeps_the_draft_experts_in_ram(mtp_int4, tmp_path):
    """With drafting on and room to spare, every expert of the MTP layer is pinned (the MTP tier):
    drafts never read; the plan counts the whole row; tokens are those of --draft 0. Without
    drafting, or in a budget too tight for it, the row is an LRU row like the others."""
    m = model_init(mtp_int4, cache_experts=1)
    NL, E = m.cfg.n_layers, m.cfg.n_experts
    t = tiers.configure(m, 64, requested=1, ram_gb=100, autopin=False, learn=False)
    assert t.plan.mtp_tier and t.mtp_tier_bytes > 0 and m.cache.pinned(NL) == list(range(E))
    assert t.plan.mtp_bytes == E * t.plan.mtp_expert_bytes and "MTP tier" in t.summary()
    off = model_init(mtp_int4, cache_experts=1)
    t = tiers.configure(off, 64, requested=1, ram_gb=100, autopin=False, learn=False, mtp_tier=False)
    assert not t.plan.mtp_tier and t.mtp_tier_bytes == 0 and off.cache.pinned(NL) == []
    # a budget that holds one expert per row but not the whole MTP row: no tier
    kw = dict(requested=1, autopin=False, learn=False, runtime=12345)
    p1 = tiers.configure(model_init(mtp_int4, cache_experts=1), 64, ram_gb=100, mtp_tier=False, **kw).plan
    tight = (p1.projected_peak_bytes + p1.mtp_expert_bytes) / 1e9
    assert not tiers.configure(model_init(mtp_int4, cache_experts=1), 64, ram_gb=tight, **kw).plan.mtp_tier
    stats = {}
    for draft in ("0", "3"):
        s = tmp_path / f"s{draft}.json"
        p = colibri("run", "--model", mtp_int4, "--prompt-ids", "3,14,159,26,53", "-n", 24, "-t", 0,
                    "--cache-experts", 1, "--draft", draft, "--stats-json", s)
        assert p.returncode == 0, p.stderr
        stats[draft] = json.loads(s.read_text())
    assert stats["0"]["tokens"] == stats["3"]["tokens"]
    assert stats["3"]["mtp_hit_rate"] == 1.0 and stats["3"]["mtp_tier_bytes"] > 0
    assert stats["0"]["mtp_tier_bytes"] == 0 and stats["3"]["drafts_proposed"] > 0
    assert "MTP tier" in p.stderr and "MTP experts hit 100.0%" in p.stderr


@pytest.mark.parametrize("direct", [False, True])
def test_long_prompt_with_more_experts_than_the_cache_is_exact(direct):
    """A prompt whose batch union needs far more experts than the LRU holds streams them in
    groups: one group is multiplied while the next is read into buffers of experts evicted
    meanwhile. A buffer must come back to the pool only once its expert is gone (not while the
    group still multiplies with it): the logits equal those of a model holding every expert."""
    from colibri.models import default_model_dir
    path = default_model_dir()
    ids = [int(t) for t in np.random.default_rng(5).integers(10, 4000, 40)]
    ref = model_init(path)
    ref.kv_alloc(48)
    want = ref.step_all(ids, 0)
    m = model_init(path, cache_experts=2, direct=direct, prefetch=False)
    m.kv_alloc(48)
    got = m.step_all(ids, 0)
    assert m.cfg.n_experts > 8 and m.cache.stats["evictions"] > 8
    np.testing.assert_array_equal(got, want)
