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
