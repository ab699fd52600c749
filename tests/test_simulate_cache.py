"""tools/simulate_cache.py: the expert-cache policy simulator and its GLM-5.2 projection.

Hand-worked traces fix the hit counts of lru, lfu and belady; naive reference implementations,
written straight from the policy definitions, check the fast ones on random traces; then the
pinned policy, the projection arithmetic, trace validation and the command line.
"""
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import simulate_cache as sc  # noqa: E402

TOOL = Path(__file__).resolve().parent.parent / "tools" / "simulate_cache.py"
MB = 1_000_000


def header(n_experts=4, moe_layers=(1,), n_layers=2, expert_bytes=MB, **over):
    h = {"format": "colibri-routing-trace", "version": 1, "model": "test", "n_layers": n_layers,
         "n_experts": n_experts, "topk": 2, "moe_layers": list(moe_layers),
         "expert_bytes": (expert_bytes if isinstance(expert_bytes, dict) else
                          {str(layer): expert_bytes for layer in moe_layers})}
    h.update(over)
    return h


def write_trace(path, calls, **hdr):
    """calls: (f, layer, s, experts) tuples -> a trace file at path."""
    lines = [json.dumps(header(**hdr))]
    lines += [json.dumps({"f": f, "l": layer, "s": s, "e": list(e)}) for f, layer, s, e in calls]
    path.write_text("\n".join(lines) + "\n")
    return path


def seq_trace(tmp_path, seq, n_experts=4, layer=1):
    """One decode call per expert of seq, all on one layer, one forward each."""
    calls = [(i, layer, 1, [x]) for i, x in enumerate(seq)]
    return sc.load_trace(write_trace(tmp_path / "seq.jsonl", calls, n_experts=n_experts,
                                     moe_layers=(layer,)))


def hits(trace, policy, capacity, **kw):
    return sc.simulate(trace, policy, capacity, **kw)["total"]["hits"]


# -- hand-worked traces --------------------------------------------------------------------------

def test_lru_beats_lfu_hand_worked(tmp_path):
    # N = 2, requests 0 0 0 1 2 1 2 1 2 (t = 0..8).
    # lru:    0 miss, 0 hit, 0 hit, 1 miss {0,1}, 2 miss evicts 0 (last used t2) -> {1,2},
    #         then 1 2 1 2 all hit: 6 hits.
    # lfu:    counts 0:3 after t2. 1 miss {0,1}; 2 miss evicts 1 (count 1 < 3) -> {0,2};
    #         1 miss (count 2) evicts 2 (count 1) -> {0,1}; 2 miss (2) evicts 1 (2 < 3);
    #         1 miss (3) evicts 2 (2 < 3); 2 miss (3): 0 and 1 both count 3, 0 is less
    #         recently used (t2 vs t7) -> evicts 0. Hits only at t1, t2: 2 hits.
    # belady: at t4 (2 missing), 0 is never used again, 1 at t5 -> evicts 0; the rest hit: 6.
    tr = seq_trace(tmp_path, [0, 0, 0, 1, 2, 1, 2, 1, 2])
    assert hits(tr, "lru", 2) == 6
    assert hits(tr, "lfu", 2) == 2
    assert hits(tr, "belady", 2) == 6


def test_three_policies_differ_hand_worked(tmp_path):
    # Two layers, N = 2, one expert per call.
    # Layer 1: 0 0 1 2 0 1 0 (t = 0..6)
    #   lru:    0 m, 0 h, 1 m {0,1}; 2 m evicts 0 (t1 < t2) {1,2}; 0 m evicts 1 {2,0};
    #           1 m evicts 2 {0,1}; 0 h -> 2 hits.
    #   lfu:    0 count 2; 1 m {0,1}; 2 m evicts 1 (count 1 < 2) {0,2}; 0 h (count 3);
    #           1 m evicts 2 (1 < 3) {0,1}; 0 h -> 3 hits.
    #   belady: 2 m at t3: next use 0 at t4, 1 at t5 -> evicts 1 {0,2}; 0 h;
    #           1 m: 2 never used again -> evicts 2 {0,1}; 0 h -> 3 hits.
    # Layer 2: 0 1 2 0 1 2 (cyclic, t = 0..5)
    #   lru:    every request misses -> 0 hits.
    #   lfu:    2 m: 0 and 1 both count 1, 0 less recent -> evicts 0 {1,2}; 0 m (2) evicts 1
    #           (count 1, older than 2); 1 m evicts 2 (count 1 < 2); 2 m: 0 and 1 count 2,
    #           0 older -> evicts 0. 0 hits.
    #   belady: 2 m: 0 next at t3, 1 at t4 -> evicts 1 {0,2}; 0 h; 1 m: 0 never again,
    #           2 at t5 -> evicts 0 {2,1}; 2 h -> 2 hits.
    # Totals: lru 2, lfu 3, belady 5 (13 requests).
    calls = [(t, 1, 1, [x]) for t, x in enumerate([0, 0, 1, 2, 0, 1, 0])]
    calls += [(100 + t, 2, 1, [x]) for t, x in enumerate([0, 1, 2, 0, 1, 2])]
    tr = sc.load_trace(write_trace(tmp_path / "t.jsonl", calls, moe_layers=(1, 2), n_layers=3))
    res = {p: sc.simulate(tr, p, 2) for p in ("lru", "lfu", "belady")}
    assert {p: r["total"]["hits"] for p, r in res.items()} == {"lru": 2, "lfu": 3, "belady": 5}
    assert {p: (r["layers"][1]["hits"], r["layers"][2]["hits"]) for p, r in res.items()} == \
        {"lru": (2, 0), "lfu": (3, 0), "belady": (3, 2)}
    for r in res.values():
        assert r["total"]["requests"] == 13
        assert r["total"]["misses"] == 13 - r["total"]["hits"]
        assert r["total"]["bytes"] == r["total"]["misses"] * MB
        assert r["layers"][1]["requests"] == 7 and r["layers"][2]["requests"] == 6


def test_lru_evicts_within_one_call(tmp_path):
    # N = 2, calls [0,1,2] then [0,1,2]. Within a call the experts are requested in ascending
    # order: 0 m, 1 m, 2 m evicts 0 (loaded by this very call) -> {1,2}; second call: 0 m evicts 1,
    # 1 m evicts 2, 2 m evicts 0: 6 misses, 0 hits. N = 3 holds the whole call: 3 hits.
    # belady at N = 2: 2 m evicts 1 (next use t4, 0's is t3) {0,2}; 0 h; 1 m evicts 0 (never
    # again) {2,1}; 2 h -> 2 hits.
    calls = [(0, 1, 1, [0, 1, 2]), (1, 1, 1, [0, 1, 2])]
    tr = sc.load_trace(write_trace(tmp_path / "t.jsonl", calls))
    assert hits(tr, "lru", 2) == 0
    assert hits(tr, "lru", 3) == 3
    assert hits(tr, "belady", 2) == 2
    # After [0,1,2] with N = 2 the cache holds {1,2}: 2 hits, 0 misses.
    tail = [(0, 1, 1, [0, 1, 2]), (1, 1, 1, [2]), (2, 1, 1, [0])]
    tr2 = sc.load_trace(write_trace(tmp_path / "t2.jsonl", tail))
    r = sc.simulate(tr2, "lru", 2)
    assert (r["total"]["hits"], r["total"]["misses"]) == (1, 4)


def test_per_forward_and_decode_split(tmp_path):
    # Forward 0: a 3-row prefill on layers 1 and 2; forwards 1, 2: decode. N = 4 (= E): every
    # first request misses. Layer 1 bytes 1 MB, layer 2 bytes 2 MB.
    calls = [(0, 1, 3, [0, 1, 2]), (0, 2, 3, [1, 3]),
             (1, 1, 1, [0, 3]), (1, 2, 1, [1, 2]),
             (2, 1, 1, [0, 3]), (2, 2, 1, [2, 3])]
    path = write_trace(tmp_path / "t.jsonl", calls, moe_layers=(1, 2), n_layers=3,
                       expert_bytes={"1": MB, "2": 2 * MB})
    r = sc.simulate(sc.load_trace(path), "lru", 4)
    # prefill: 5 requests, 5 misses = 3 x 1 MB + 2 x 2 MB
    assert r["prefill"]["requests"] == 5 and r["prefill"]["hits"] == 0
    assert r["prefill"]["bytes"] == 7 * MB and r["prefill"]["forwards"] == 1
    # decode: layer 1 [0,3] (0 hit, 3 miss), [0,3] (2 hits); layer 2 [1,2] (1 hit, 2 miss),
    # [2,3] (2 hits): 8 requests, 6 hits; misses: 3 on layer 1 (1 MB) + 2 on layer 2 (2 MB)
    assert (r["decode"]["requests"], r["decode"]["hits"]) == (8, 6)
    assert r["decode"]["bytes"] == 3 * MB and r["decode"]["forwards"] == 2
    assert r["decode"]["hit_rate"] == pytest.approx(0.75)
    assert r["total"]["forwards"] == 3 and r["total"]["misses"] == 7
    assert r["total"]["misses_per_forward"] == pytest.approx(7 / 3)
    assert r["total"]["mb_per_forward"] == pytest.approx(10 / 3)
    assert r["layers"][2] == {"requests": 6, "hits": 3, "misses": 3, "bytes": 6 * MB}


# -- naive references on random traces -----------------------------------------------------------

def naive(calls, policy, capacity):
    """Total hits, straight from the policy definitions (slow, for small traces)."""
    total = 0
    for layer in {c[1] for c in calls}:
        seq = [x for c in calls if c[1] == layer for x in c[3]]
        where = {}
        for u, y in enumerate(seq):
            where.setdefault(y, []).append(u)
        cache, last, count = set(), {}, {}
        for t, x in enumerate(seq):
            count[x] = count.get(x, 0) + 1
            if x in cache:
                total += 1
            else:
                if len(cache) >= capacity:
                    if policy == "lru":
                        victim = min(cache, key=lambda y: (last[y], y))
                    elif policy == "lfu":
                        victim = min(cache, key=lambda y: (count[y], last[y], y))
                    else:
                        def next_use(y):
                            later = [u for u in where[y] if u > t]
                            return later[0] if later else float("inf")
                        victim = max(cache, key=lambda y: (next_use(y), -y))
                    cache.remove(victim)
                cache.add(x)
            last[x] = t
    return total


def random_calls(rng, n_calls, n_experts, layers, max_k):
    calls = []
    for i in range(n_calls):
        k = rng.randint(1, max_k)
        # skewed popularity, as routing is
        ids = {min(int(rng.expovariate(0.35)), n_experts - 1) for _ in range(k)}
        calls.append((i // len(layers), layers[i % len(layers)], rng.choice((1, 1, 1, 4)),
                      sorted(ids)))
    return calls


@pytest.mark.parametrize("seed", range(12))
def test_fast_policies_match_naive_references(tmp_path, seed):
    rng = random.Random(seed)
    n_experts = rng.choice((6, 8, 12))
    calls = random_calls(rng, 120, n_experts, (0, 1), 4)
    tr = sc.load_trace(write_trace(tmp_path / "t.jsonl", calls, n_experts=n_experts,
                                   moe_layers=(0, 1)))
    for cap in (1, 2, 3, 5):
        for policy in ("lru", "lfu", "belady"):
            assert hits(tr, policy, cap) == naive(calls, policy, cap), (policy, cap)


def test_long_trace_with_high_hit_rate(tmp_path):
    # Many hits between evictions grow the internal heaps of lfu and belady until they are
    # rebuilt; the results must not change.
    rng = random.Random(99)
    calls = [(i, 0, 1, sorted({min(int(rng.expovariate(0.6)), 9) for _ in range(2)}))
             for i in range(1500)]
    tr = sc.load_trace(write_trace(tmp_path / "t.jsonl", calls, n_experts=10, moe_layers=(0,)))
    for cap in (3, 5, 7):
        for policy in ("lru", "lfu", "belady"):
            assert hits(tr, policy, cap) == naive(calls, policy, cap), (policy, cap)


def test_belady_is_the_upper_bound(tmp_path):
    for seed in range(40):
        rng = random.Random(1000 + seed)
        n_experts = rng.choice((4, 8, 16))
        calls = random_calls(rng, 150, n_experts, (0, 2, 3), 5)
        tr = sc.load_trace(write_trace(tmp_path / f"t{seed}.jsonl", calls, n_experts=n_experts,
                                       moe_layers=(0, 2, 3), n_layers=4))
        for cap in (1, 2, 3, 4, 6):
            best = hits(tr, "belady", cap)
            assert best >= hits(tr, "lru", cap), (seed, cap)
            assert best >= hits(tr, "lfu", cap), (seed, cap)


def test_full_capacity_gives_only_compulsory_misses(tmp_path):
    for seed in range(10):
        rng = random.Random(seed)
        n_experts = 8
        calls = random_calls(rng, 200, n_experts, (1, 2), 4)
        tr = sc.load_trace(write_trace(tmp_path / f"t{seed}.jsonl", calls, n_experts=n_experts,
                                       moe_layers=(1, 2), n_layers=3))
        distinct = {layer: len({x for c in calls if c[1] == layer for x in c[3]})
                    for layer in (1, 2)}
        for policy in sc.POLICIES:
            for cap in (n_experts, n_experts + 3):
                r = sc.simulate(tr, policy, cap)
                assert {layer: r["layers"][layer]["misses"] for layer in (1, 2)} == distinct


# -- pinned+lru ----------------------------------------------------------------------------------

def test_choose_pins_ranking_and_ties(tmp_path):
    # layer 1: expert 3 x3, expert 0 x2; layer 2: expert 1 x2, expert 2 x1
    calls = [(0, 1, 1, [0, 3]), (0, 2, 1, [1, 2]), (1, 1, 1, [0, 3]), (1, 2, 1, [1]),
             (2, 1, 1, [3])]
    tr = sc.load_trace(write_trace(tmp_path / "t.jsonl", calls, moe_layers=(1, 2), n_layers=3))
    assert sc.choose_pins(tr, 1) == {(1, 3)}
    # count 2 tie between (1, 0) and (2, 1): the lower layer first
    assert sc.choose_pins(tr, 2) == {(1, 3), (1, 0)}
    assert sc.choose_pins(tr, 4) == {(1, 3), (1, 0), (2, 1), (2, 2)}
    # unrequested pairs fill the rest: lower layer, then lower id -> (1, 1)
    assert sc.choose_pins(tr, 5) == {(1, 3), (1, 0), (2, 1), (2, 2), (1, 1)}
    assert len(sc.choose_pins(tr, 100)) == 2 * 4
    assert sc.choose_pins(tr, 1, calls=tr.calls[1:2]) == {(2, 1)}
    assert sc.choose_pins(tr, 0) == set()


def test_all_pinned_is_all_hits_on_the_evaluated_half(tmp_path):
    rng = random.Random(7)
    calls = random_calls(rng, 300, 8, (0, 1), 4)
    tr = sc.load_trace(write_trace(tmp_path / "t.jsonl", calls, n_experts=8, moe_layers=(0, 1)))
    half = len(tr.calls) // 2
    pins = sc.choose_pins(tr, 2 * 8, calls=tr.calls[:half])
    second = tr.calls[half:]
    r = sc.simulate(tr, "pinned+lru", 1, pins=pins, calls=second)
    assert r["total"]["requests"] == sum(len(c.e) for c in second)
    assert r["total"]["hits"] == r["total"]["requests"] and r["total"]["bytes"] == 0
    assert r["pinned_experts"] == 16 and r["pinned_bytes"] == 16 * MB


def pin_trace(tmp_path):
    # 10 calls on layer 1, E = 4. First half [0] [0] [1] [1] [3]: pins (budget 1) = expert 0
    # (0 and 1 both twice, lower id). All calls: 2 and 3 three times each -> expert 2.
    # Second half [2] [3] [2] [3] [2] with N = 1:
    #   first-half pins (0): the LRU of 1 alternates 2/3 -> 0 hits of 5 requests.
    # All calls with pin 2, N = 1: 0 m, 0 h, 1 m, 1 h, 3 m, 2 p, 3 h, 2 p, 3 h, 2 p -> 7 of 10.
    seq = [0, 0, 1, 1, 3, 2, 3, 2, 3, 2]
    return write_trace(tmp_path / "pins.jsonl", [(i, 1, 1, [x]) for i, x in enumerate(seq)])


def test_first_half_pins_are_evaluated_on_the_second_half(tmp_path):
    tr = sc.load_trace(pin_trace(tmp_path))
    first, second = tr.calls[:5], tr.calls[5:]
    assert sc.choose_pins(tr, 1, calls=first) == {(1, 0)}
    assert sc.choose_pins(tr, 1) == {(1, 2)}
    r = sc.simulate(tr, "pinned+lru", 1, pins={(1, 0)}, calls=second)
    assert (r["total"]["requests"], r["total"]["hits"]) == (5, 0)
    r = sc.simulate(tr, "pinned+lru", 1, pins={(1, 2)})
    assert (r["total"]["requests"], r["total"]["hits"]) == (10, 7)


def test_main_pin_modes(tmp_path, capsys):
    path = pin_trace(tmp_path)
    out = tmp_path / "honest.json"
    assert sc.main([str(path), "--cache", "1", "--pin-experts", "1", "--json", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["results"] if r["policy"] == "pinned+lru"]
    assert len(rows) == 1 and "second half" in rows[0]["part"]
    assert (rows[0]["total"]["requests"], rows[0]["total"]["hits"]) == (5, 0)
    capsys.readouterr()
    out = tmp_path / "optimistic.json"
    assert sc.main([str(path), "--cache", "1", "--pin-experts", "1", "--pin-from", "all",
                    "--json", str(out)]) == 0
    assert "optimistic" in capsys.readouterr().out
    rows = [r for r in json.loads(out.read_text())["results"] if r["policy"] == "pinned+lru"]
    assert "optimistic" in rows[0]["part"]
    assert (rows[0]["total"]["requests"], rows[0]["total"]["hits"]) == (10, 7)
    assert rows[0]["pinned_bytes"] == MB


# -- GLM-5.2 projection --------------------------------------------------------------------------

def test_projection_arithmetic():
    p = sc.project_glm52(0.0)
    assert p["gb_per_token"] == pytest.approx(8 * 75 * 18.9 / 1000) == pytest.approx(11.34)
    assert p["tok_s_bound"] == pytest.approx(2.0 / 11.34)
    p = sc.project_glm52(0.75, disk_gbs=7.0)
    assert p["gb_per_token"] == pytest.approx(2.835)
    assert p["tok_s_bound"] == pytest.approx(7.0 / 2.835)
    p = sc.project_glm52(1.0)
    assert p["gb_per_token"] == 0 and p["tok_s_bound"] is None
    assert sc.project_glm52(None)["gb_per_token"] is None


def test_closest_capacity():
    assert sc.closest_capacity([1, 2, 4, 8], 16, 16) == (1, 1 / 16)
    assert sc.closest_capacity([2, 4, 8], 16, 16) == (2, 2 / 16)
    assert sc.closest_capacity([1, 2, 4, 8], 16, 64) == (4, 0.25)
    assert sc.closest_capacity([1, 3], 16, 32) == (1, 1 / 16)  # tie: the smaller
    assert sc.closest_capacity([4, 16, 40], 16, 256) == (16, 1.0)


# -- validation ----------------------------------------------------------------------------------

GOOD_CALL = '{"f": 0, "l": 1, "s": 1, "e": [0, 2]}'
BAD = [
    # (header overrides or a raw header line, call lines, bad line number, message fragment)
    ({"format": "other"}, [], 1, "not a routing trace"),
    ({"version": 2}, [], 1, "version 2"),
    ("[1, 2]", [], 1, "header must be a JSON object"),
    ({"n_experts": None}, [], 1, "'n_experts'"),
    ({"expert_bytes": {}}, [], 1, "expert_bytes"),
    ({"moe_layers": [1, 1]}, [], 1, "moe_layers"),
    ({}, ['{"f": 0, "l": 1,'], 2, "invalid JSON"),
    ({}, [GOOD_CALL, "[0, 1]"], 3, "expected a JSON object"),
    ({}, [GOOD_CALL, '"text"'], 3, "expected a JSON object"),
    ({}, ['{"f": 0, "l": 1, "s": 1}'], 2, "missing key 'e'"),
    ({}, ['{"l": 1, "s": 1, "e": [0]}'], 2, "missing key 'f'"),
    ({}, [GOOD_CALL, GOOD_CALL, '{"f": 1, "l": 1, "s": 1, "e": [0, 4]}'], 4, "expert id 4"),
    ({}, ['{"f": 0, "l": 1, "s": 1, "e": [-1, 2]}'], 2, "expert id -1"),
    ({}, ['{"f": 0, "l": 0, "s": 1, "e": [0]}'], 2, "layer 0 is not"),
    ({}, [GOOD_CALL, '{"f": 0, "l": 1, "s": 1, "e": [2, 1]}'], 3, "unique and ascending"),
    ({}, ['{"f": 0, "l": 1, "s": 1, "e": [1, 1]}'], 2, "unique and ascending"),
    ({}, ['{"f": 0, "l": 1, "s": 0, "e": [1]}'], 2, "'s'"),
    ({}, ['{"f": 0, "l": 1, "s": 1, "e": [1.0]}'], 2, "integer expert ids"),
]


def write_raw(path, hdr, lines):
    first = hdr if isinstance(hdr, str) else json.dumps(header(**hdr))
    path.write_text("\n".join([first] + lines) + "\n")
    return path


@pytest.mark.parametrize("hdr, lines, lineno, fragment", BAD)
def test_malformed_traces_name_file_and_line(tmp_path, hdr, lines, lineno, fragment):
    path = write_raw(tmp_path / "bad.jsonl", hdr, lines)
    with pytest.raises(ValueError) as exc:
        sc.load_trace(path)
    assert f"{path}:{lineno}:" in str(exc.value)
    assert fragment in str(exc.value)


def test_missing_header_keys(tmp_path):
    for key in ("model", "n_layers", "n_experts", "topk", "moe_layers", "expert_bytes"):
        h = header()
        del h[key]
        path = write_raw(tmp_path / "bad.jsonl", json.dumps(h), [GOOD_CALL])
        with pytest.raises(ValueError, match=rf":1: header is missing key '{key}'"):
            sc.load_trace(path)


def test_empty_file_and_empty_trace(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=":1: empty file"):
        sc.load_trace(empty)
    path = write_raw(tmp_path / "header_only.jsonl", {}, [])
    tr = sc.load_trace(path)
    assert tr.calls == []
    for policy in sc.POLICIES:
        r = sc.simulate(tr, policy, 2)
        assert r["total"]["requests"] == 0 and r["total"]["hit_rate"] is None
    assert sc.main([str(path)]) == 0
    assert "n/a" in capsys.readouterr().out


def test_simulate_rejects_bad_arguments(tmp_path):
    tr = sc.load_trace(write_raw(tmp_path / "t.jsonl", {}, [GOOD_CALL]))
    with pytest.raises(ValueError, match="unknown policy"):
        sc.simulate(tr, "fifo", 2)
    with pytest.raises(ValueError, match="capacity"):
        sc.simulate(tr, "lru", 0)
    with pytest.raises(ValueError, match="pin"):
        sc.simulate(tr, "pinned+lru", 2, pins={(0, 1)})


# -- command line --------------------------------------------------------------------------------

def test_main_help(capsys):
    assert sc.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage" in out and "--pin-from" in out and "--glm-cache" in out


def test_main_bad_input_is_an_error(tmp_path, capsys):
    bad = write_raw(tmp_path / "bad.jsonl", {}, ['{"f": 0, "l": 1, "s": 1, "e": [3, 2]}'])
    assert sc.main([str(bad)]) != 0
    assert f"{bad}:2:" in capsys.readouterr().err
    assert sc.main([str(tmp_path / "missing.jsonl")]) != 0
    good = write_raw(tmp_path / "good.jsonl", {}, [GOOD_CALL])
    assert sc.main([str(good), "--cache", "0"]) != 0
    assert sc.main([str(good), "--cache", "two"]) != 0
    assert sc.main([str(good), "--policies", "fifo"]) != 0
    assert sc.main([str(good), "--no-such-option"]) != 0
    assert "error" in capsys.readouterr().err


def test_main_prints_table_and_writes_json(tmp_path, capsys):
    rng = random.Random(3)
    # one 5-row prefill call, then 199 decode calls (s == 1), one forward each
    calls = [(0, 1, 5, [0, 1, 2, 3, 5])]
    calls += [(i, 1, 1, c[3]) for i, c in enumerate(random_calls(rng, 200, 16, (1,), 3)) if i]
    path = write_trace(tmp_path / "t.jsonl", calls, n_experts=16)
    out = tmp_path / "res.json"
    assert sc.main([str(path), "--cache", "1,2,4,all", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| policy" in text and "| belady" in text and "GLM-5.2" in text
    assert "a tiny model is not GLM-5.2" in text and "matched N = 1 of 16" in text
    doc = json.loads(out.read_text())
    assert doc["settings"]["cache"] == [1, 2, 4, 16]
    got = {(r["policy"], r["part"], r["capacity"]) for r in doc["results"]}
    for policy in ("lru", "lfu", "belady"):
        assert {(policy, "all", n) for n in (1, 2, 4, 16)} <= got
    assert len(doc["results"]) == 4 * 5  # lru, lfu, belady, lru and pinned+lru on the 2nd half
    pj = doc["glm52_projection"]
    assert pj["capacity"] == 1 and pj["matched_fraction"] == pytest.approx(1 / 16)
    assert "tiny model is not GLM-5.2" in pj["assumption"]
    lru1 = next(r for r in doc["results"] if (r["policy"], r["part"], r["capacity"]) ==
                ("lru", "all", 1))
    row = next(p for p in pj["policies"] if (p["policy"], p["part"]) == ("lru", "all"))
    assert row["hit_rate"] == lru1["decode"]["hit_rate"]
    assert row["gb_per_token"] == pytest.approx((1 - lru1["decode"]["hit_rate"]) * 11.34)
    assert lru1["prefill"]["requests"] == 5 and lru1["prefill"]["forwards"] == 1


def test_script_runs_standalone(tmp_path):
    path = write_raw(tmp_path / "t.jsonl", {}, [GOOD_CALL])
    proc = subprocess.run([sys.executable, str(TOOL), str(path), "--cache", "1,all"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "| lru" in proc.stdout
