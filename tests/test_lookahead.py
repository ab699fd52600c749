"""The router-lookahead prefetch runs only while it pays (colibri.lookahead.PrefetchPolicy), and
whatever it decides the tokens are the same."""
import json
import os
import subprocess
import sys

import pytest

from colibri import model_init
from colibri.lookahead import PrefetchPolicy, parse_prefetch
from conftest import DATA, decode


def _drive(policy, cost_on, cost_off, iterations):
    """Feed the policy iterations costing cost_on / cost_off seconds (one token each)."""
    chosen = []
    for _ in range(iterations):
        on = policy.enabled()
        chosen.append(on)
        policy.record(cost_on if on else cost_off, 1)
    return chosen


@pytest.mark.parametrize("on_wins", [True, False])
def test_auto_keeps_the_faster_setting_and_probes_the_other_less_and_less(on_wins):
    p = PrefetchPolicy("auto", window=4)
    chosen = _drive(p, 0.010 if on_wins else 0.013, 0.013 if on_wins else 0.010, 400)
    late = chosen[100:]
    share = sum(late) / len(late) if on_wins else 1 - sum(late) / len(late)
    assert share > 0.85                                    # mostly the faster setting ...
    assert 0 < sum(1 for c in late if c != on_wins)        # ... the other still probed now and then
    assert p.probe_gap > 4                                 # and less often each time it loses
    s = p.stats()
    assert s["prefetch_on_iterations"] + s["prefetch_off_iterations"] == 400
    assert (s["prefetch_on_s_per_token"] < s["prefetch_off_s_per_token"]) == on_wins


def test_auto_follows_a_change():
    """A setting that starts to win (the disk got slower, the cache colder) takes over."""
    p = PrefetchPolicy("auto", window=4)
    _drive(p, 0.013, 0.010, 200)                           # off wins
    chosen = _drive(p, 0.008, 0.010, 600)                  # now on wins
    assert sum(chosen[-200:]) / 200 > 0.85


def test_fixed_modes_and_parsing():
    for mode, want in (("on", True), ("off", False)):
        p = PrefetchPolicy(mode, window=2)
        assert set(_drive(p, 1.0, 0.0, 20)) == {want}
    assert parse_prefetch(True) == "auto" and parse_prefetch(False) == "off" and parse_prefetch("ON") == "on"
    with pytest.raises(ValueError, match="prefetch must be one of auto, on, off"):
        parse_prefetch("sometimes")


def test_tokens_do_not_depend_on_the_prefetch_setting(monkeypatch):
    """auto (both settings tried within one generation), on and off decode the same tokens."""
    prompt = [3, 14, 15, 92, 65]
    got = {}
    for mode in ("on", "off", "auto"):
        m = model_init(DATA / "tiny_dsa", cache_experts=1, prefetch=mode)
        m.lookahead = PrefetchPolicy(mode, window=2)        # short windows: several switches
        got[mode], _ = decode(m, prompt, 40, 0)
        s = m.lookahead.stats()
        if mode == "auto":
            assert s["prefetch_on_iterations"] > 0 and s["prefetch_off_iterations"] > 0
        m.close()
    assert got["on"] == got["off"] == got["auto"]


def test_run_reports_the_prefetch_decision(tmp_path):
    stats = tmp_path / "s.json"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    p = subprocess.run([sys.executable, "-m", "colibri", "run", "--model", str(DATA / "tiny_dsa"), "--prompt-ids",
                        "3,14,15", "--max-tokens", "40", "--temperature", "0", "--cache-experts", "1",
                        "--stats-json", str(stats), "--quiet"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    s = json.loads(stats.read_text())
    assert s["prefetch_mode"] == "auto"
    assert s["prefetch_on_iterations"] + s["prefetch_off_iterations"] == s["decode_forwards"]


class FakeReads:
    """ExpertCache.stats-like prefetch counters that grow by (loaded, used, wasted) per iteration
    with the prefetch on."""

    def __init__(self, loaded, used, wasted):
        self.per_iteration = (loaded, used, wasted)
        self.s = dict(prefetch_loaded=0, prefetch_used=0, prefetch_wasted=0, prefetch_dropped=0)

    def __call__(self):
        return dict(self.s)

    def step(self, on):
        if on:
            for k, v in zip(("prefetch_loaded", "prefetch_used", "prefetch_wasted"), self.per_iteration):
                self.s[k] += v


def _drive_reads(policy, reads, cost_on, cost_off, iterations):
    chosen = []
    for _ in range(iterations):
        on = policy.enabled()
        chosen.append(on)
        reads.step(on)
        policy.record(cost_on if on else cost_off, 1)
    return chosen


@pytest.mark.parametrize("loaded,used,wasted", [(0, 0, 0), (4, 1, 3)])
def test_a_prefetch_that_reads_nothing_or_wastes_its_reads_is_turned_off(loaded, used, wasted):
    """Nothing to load (every predicted expert in memory), or more loads wasted than used: the
    prefetch has lost after its first window, even when its windows happen to run faster."""
    reads = FakeReads(loaded, used, wasted)
    p = PrefetchPolicy("auto", window=4, counters=reads)
    chosen = _drive_reads(p, reads, 0.009, 0.010, 400)
    assert chosen[:4] == [True] * 4 and chosen[4:8] == [False] * 4      # off right after one window
    assert sum(chosen) / len(chosen) < 0.1                              # only probes afterwards
    assert p.lost_on_reads == sum(1 for i in range(0, 400, 4) if chosen[i]) and p.probe_gap > 4
    assert p.stats()["prefetch_windows_lost_on_reads"] == p.lost_on_reads


def test_a_prefetch_that_pays_in_reads_is_judged_by_its_time():
    reads = FakeReads(4, 3, 1)
    p = PrefetchPolicy("auto", window=4, counters=reads)
    chosen = _drive_reads(p, reads, 0.009, 0.010, 400)
    assert sum(chosen[100:]) / 300 > 0.85 and p.lost_on_reads == 0
    p = PrefetchPolicy("auto", window=4, counters=reads)
    chosen = _drive_reads(p, reads, 0.011, 0.010, 400)
    assert sum(chosen[100:]) / 300 < 0.15


def test_the_engine_turns_off_a_prefetch_with_nothing_to_load():
    """Experts kept in memory once used (the kept tier): the lookahead soon finds nothing to read,
    so auto turns it off; the tokens are those of prefetch off. (96 tokens: the first windows measure
    both settings and their time may favour either; the probes after the first lost window then
    take fewer and fewer iterations, so only a longer decode shows them few.)"""
    from colibri.models import default_model_dir
    prompt = [3, 14, 15, 92, 65]
    m = model_init(default_model_dir(), cache_experts=1, prefetch="auto")
    m.lookahead = PrefetchPolicy("auto", window=2, counters=m.lookahead.counters)
    m.cache.set_keep_bytes(10 ** 9)
    auto, _ = decode(m, prompt, 96, 0)
    s = m.lookahead.stats()
    assert s["prefetch_windows_lost_on_reads"] >= 1
    assert s["prefetch_on_iterations"] < s["prefetch_off_iterations"] / 3
    off = model_init(default_model_dir(), cache_experts=1, prefetch="off")
    assert decode(off, prompt, 96, 0)[0] == auto
    m.close()
    off.close()
