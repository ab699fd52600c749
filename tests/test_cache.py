"""colibri/cache.py: the expert store (pinned hot-store, per-layer LRU, parallel loads, prefetch).

Loaders are fakes that record every call, can be held at a gate, delayed, or made to fail (the
engine is not involved).
"""
import collections
import concurrent.futures
import random
import threading
import time

import numpy as np
import pytest


from colibri import cache as cache_mod
ExpertCache = cache_mod.ExpertCache
T = 10          # seconds: any wait longer than this is a hang


class DiskError(ValueError):
    pass


class Obj:
    def __init__(self, layer, eid, nbytes):
        self.layer, self.eid, self.nbytes = layer, eid, nbytes


class Loader:
    """Fake loader: records calls, tracks concurrency, optional gates / delays / failures."""

    def __init__(self, nbytes=100, delay=0.0, jitter=0.0, seed=0):
        self.lock = threading.Lock()
        self.calls = []
        self.made = {}                      # (layer, eid) -> list of objects made
        self.active = collections.Counter()
        self.n_active = 0
        self.max_active = 0
        self.same_key_overlap = False
        self.gates = {}                     # key -> Event the load waits for
        self.started = collections.defaultdict(threading.Event)
        self.fail = collections.Counter()   # key -> failures left
        self.barrier = None
        self.rng = random.Random(seed)
        self.nbytes, self.delay, self.jitter = nbytes, delay, jitter

    def __call__(self, layer, eid):
        key = (layer, eid)
        with self.lock:
            if self.active[key]:
                self.same_key_overlap = True
            self.active[key] += 1
            self.n_active += 1
            self.max_active = max(self.max_active, self.n_active)
            self.calls.append(key)
            d = self.delay + self.rng.random() * self.jitter
            started = self.started[key]
        started.set()
        try:
            gate = self.gates.get(key)
            if gate is not None:
                assert gate.wait(T)
            if self.barrier is not None:
                self.barrier.wait()
            if d:
                time.sleep(d)
            with self.lock:
                if self.fail[key] > 0:
                    self.fail[key] -= 1
                    raise DiskError(f"short read in shard 3 for {key}")
                obj = Obj(layer, eid, self.nbytes)
                self.made.setdefault(key, []).append(obj)
            return obj
        finally:
            with self.lock:
                self.active[key] -= 1
                self.n_active -= 1

    def count(self, key):
        with self.lock:
            return self.calls.count(key)


def make(capacity=2, n_rows=3, n_experts=16, io_threads=4, prefetch=True, **kw):
    loader = Loader(**kw)
    return ExpertCache(loader, n_rows, capacity, io_threads, prefetch, n_experts=n_experts), loader


def in_thread(fn, *args):
    ex = concurrent.futures.ThreadPoolExecutor(1)
    fut = ex.submit(fn, *args)
    ex.shutdown(wait=False)
    return fut


def wait_for_waiter(c, key):
    """Block until a get() is registered as waiting for the in-flight load of key (reads the
    cache's private in-flight table: the only way to order the test threads without sleeps)."""
    deadline = time.monotonic() + T
    while time.monotonic() < deadline:
        with c._lock:
            p = c._inflight.get(key)
            if p is not None and p.waiters > 0:
                return
        time.sleep(0.001)
    raise AssertionError(f"no get() waiting for {key}")


def check_prefetch_balance(s):
    assert s["prefetch_loaded"] == (s["prefetch_used"] + s["prefetch_dropped"] + s["prefetch_wasted"]
                                    + s["prefetch_unused"])


def check_request_partition(s):
    assert s["requests"] == (s["hits_pin"] + s["hits_lru"] + s["hits_kept"] + s["prefetch_waits"]
                             + s["inflight_waits"] + s["misses"])


# -- get(): order, identity, LRU ------------------------------------------------------------------

def test_get_returns_the_loader_objects_in_call_order():
    c, ld = make(capacity=8)
    out = c.get(1, [5, 2, 5, 9])
    assert [(o.layer, o.eid) for o in out] == [(1, 5), (1, 2), (1, 5), (1, 9)]
    assert out[0] is out[2] is ld.made[(1, 5)][0]
    assert out[1] is ld.made[(1, 2)][0] and out[3] is ld.made[(1, 9)][0]
    again = c.get(1, [9, 2])
    assert again[0] is out[3] and again[1] is out[1]          # cache hits: same objects, no reload
    assert sorted(ld.calls) == [(1, 2), (1, 5), (1, 9)]
    s = c.stats
    assert (s["requests"], s["misses"], s["hits_lru"], s["loads"], s["bytes_read"]) == (5, 3, 2, 3, 300)
    assert c.get(1, []) == []
    c.close()


def test_lru_eviction_hand_worked():
    # capacity 2 on layer 0: 0 miss, 1 miss, 0 hit (order [1, 0]), 2 miss evicts 1 -> [0, 2],
    # 1 miss evicts 0 -> [2, 1], 2 hit -> [1, 2].
    c, ld = make(capacity=2)
    for e in (0, 1, 0, 2, 1, 2):
        c.get(0, [e])
    assert ld.calls == [(0, 0), (0, 1), (0, 2), (0, 1)]
    assert c.lru_order(0) == [1, 2]
    s = c.stats
    assert (s["misses"], s["hits_lru"], s["evictions"], s["lru_experts"]) == (4, 2, 2, 2)
    assert c.hit_rate() == pytest.approx(2 / 6) == s["hit_rate"]
    assert c.lru_order(1) == [] and c.tier(0, 0) is None and c.tier(0, 2) == "lru"
    c.close()


def test_call_experts_become_most_recent_in_ascending_order():
    c, ld = make(capacity=3)
    for e in (5, 6, 7):
        c.get(0, [e])
    # call [9, 5]: 5 hit, 9 miss; stamped 5 then 9 -> [6, 7, 5, 9] -> trimmed: 6 evicted
    c.get(0, [9, 5])
    assert c.lru_order(0) == [7, 5, 9]
    c.get(0, [7, 3])      # [5, 9, 3, 7] -> 5 evicted
    assert c.lru_order(0) == [9, 3, 7]
    c.close()


def test_call_larger_than_capacity_returns_everything_and_trims_after():
    c, ld = make(capacity=2)
    c.get(0, [0])
    c.get(0, [1])
    out = c.get(0, [3, 1, 2, 0])         # 0 and 1 are hits and are not evicted during the call
    assert [o.eid for o in out] == [3, 1, 2, 0]
    assert sorted(ld.calls) == [(0, 0), (0, 1), (0, 2), (0, 3)]     # 0 and 1 read only once
    assert c.lru_order(0) == [2, 3]     # the call's experts in ascending order, the last two kept
    s = c.stats
    assert (s["hits_lru"], s["misses"], s["lru_experts"]) == (2, 4, 2)
    c.close()


def test_capacity_at_least_n_experts_keeps_everything():
    c, ld = make(capacity=16, n_experts=16)
    for _ in range(2):
        for e in range(16):
            c.get(2, [e])
    assert len(ld.calls) == 16 and c.stats["evictions"] == 0 and c.stats["lru_experts"] == 16
    c.close()


def reference_lru(calls, capacity, n_rows):
    """The eviction rule written out naively: per call, load the missing experts, then make the
    call's experts the most recent in ascending order and drop the oldest beyond capacity."""
    rows = [[] for _ in range(n_rows)]
    loads = []
    for layer, eids in calls:
        row = rows[layer]
        loads.append(sorted({(layer, e) for e in eids if e not in row}))
        for e in sorted(set(eids)):
            if e in row:
                row.remove(e)
            row.append(e)
        del row[:max(0, len(row) - capacity)]
    return loads, rows


def test_loads_and_evictions_do_not_depend_on_thread_timing():
    rng = random.Random(7)
    calls = [(rng.randrange(3), [rng.randrange(12) for _ in range(rng.randint(1, 6))]) for _ in range(120)]
    want_loads, want_rows = reference_lru(calls, 4, 3)
    for seed in (1, 2):
        c, ld = make(capacity=4, n_experts=12, io_threads=4, jitter=0.002, seed=seed)
        for (layer, eids), want in zip(calls, want_loads):
            before = len(ld.calls)
            out = c.get(layer, eids)
            assert [(o.layer, o.eid) for o in out] == [(layer, e) for e in eids]
            assert sorted(ld.calls[before:]) == want
        assert [c.lru_order(r) for r in range(3)] == want_rows
        check_request_partition(c.stats)
        c.close()


def test_misses_of_one_call_are_read_concurrently():
    c, ld = make(capacity=8, io_threads=4)
    ld.barrier = threading.Barrier(4, timeout=T)    # passes only if 4 loads run at the same time
    out = c.get(0, [0, 1, 2, 3])
    assert [o.eid for o in out] == [0, 1, 2, 3]
    assert ld.max_active == 4
    assert c.stats["wait_s"] > 0 and c.stats["load_s"] > 0
    c.close()


def test_fetch_hands_out_present_experts_while_misses_load():
    """fetch(): the present experts at once (ready), the rest read on the pool meanwhile; wait()
    returns what get() returns and ends the call (LRU order, trim) exactly as get() does."""
    c, ld = make(capacity=4, io_threads=2)
    c.get(0, [1, 2])
    ld.gates[(0, 5)] = threading.Event()            # the read of 5 waits until released
    f = c.fetch(0, [5, 2, 1, 5])
    assert f.pending and sorted(f.ready) == [1, 2]
    assert c.get(1, [9])[0].eid == 9                # other calls go on meanwhile
    assert ld.started[(0, 5)].wait(T)
    assert not f._finished
    ld.gates[(0, 5)].set()
    out = f.wait()
    assert [o.eid for o in out] == [5, 2, 1, 5] and out[1] is f.ready[2]
    assert f.wait() is out and not f.pending
    assert c.lru_order(0) == [1, 2, 5]
    check_request_partition(c.stats)
    c.close()


def test_fetch_protects_its_experts_until_waited_and_reports_errors_once():
    c, ld = make(capacity=1, io_threads=2)
    c.get(0, [3])
    ld.fail[(0, 4)] = 1
    f = c.fetch(0, [3, 4])
    assert sorted(f.ready) == [3]
    c.prefetch(0, [6])                              # may not evict 3 while the fetch holds it
    c.wait_prefetch()
    assert c.tier(0, 3) == "lru"
    with pytest.raises(DiskError, match=r"expert 4 of layer 0"):
        f.wait()
    with pytest.raises(RuntimeError, match="failed"):
        f.wait()
    assert c.get(0, [4])[0].eid == 4                # consistent afterwards; 4 is read again
    c.close()


# -- pins ------------------------------------------------------------------------------------------

def test_pins_are_hits_never_evicted_and_adopt_lru_entries():
    c, ld = make(capacity=1, nbytes=1000)
    first = c.get(0, [4])[0]                        # in the LRU
    seen = []
    nb = c.pin([(0, 4), (0, 5), (1, 6), (0, 5)], progress=lambda d, t: seen.append((d, t)))
    assert nb == 3000
    assert ld.count((0, 4)) == 1                    # adopted from the LRU, not read again
    assert seen[-1] == (2, 2) and len(seen) == 2
    assert c.pinned(0) == [4, 5] and c.pinned(1) == [6] and c.tier(0, 4) == "pin"
    assert c.lru_order(0) == []
    for e in (7, 8, 9):                             # LRU churn never touches the pins
        c.get(0, [e, 4, 5])
    assert c.get(0, [4])[0] is first
    assert c.pin([(0, 4)]) == 0
    s = c.stats
    assert (s["pinned_experts"], s["pinned_bytes"], s["lru_experts"]) == (3, 3000, 1)
    assert s["hits_pin"] == 7 and ld.count((0, 5)) == 1
    check_request_partition(s)
    c.close()


def test_pin_load_error_names_layer_and_expert():
    c, ld = make()
    ld.fail[(2, 3)] = 1
    with pytest.raises(DiskError, match=r"expert 3 of layer 2: short read in shard 3"):
        c.pin([(0, 1), (2, 3)])
    assert c.pinned(0) == [1] and c.pinned(2) == []
    c.close()


def test_warm_fills_rows_up_to_capacity_without_counting_requests():
    c, ld = make(capacity=3, nbytes=100)
    c.pin([(0, 1)])
    c.get(1, [2])
    c.reset_stats()
    c.reset_usage()
    seen = []
    n, nb = c.warm([(0, e) for e in range(6)] + [(1, 2), (1, 3)], progress=lambda d, t: seen.append((d, t)))
    assert (n, nb) == (4, 400)                      # row 0: 3 of 0, 2, 3, 4, 5 (1 is pinned); row 1: 3
    assert c.lru_order(0) == [0, 2, 3] and c.lru_order(1) == [2, 3] and c.pinned(0) == [1]
    assert seen[-1] == (4, 4) and ld.count((1, 2)) == 1
    s = c.stats
    assert s["loads"] == 4 and s["misses"] == 0 and s["hits_lru"] == 0 and not c.usage.any()
    c.get(0, [0, 2, 3])
    assert c.stats["hits_lru"] == 3 and c.stats["misses"] == 0
    assert c.warm([(0, 4)]) == (0, 0)               # the row is full
    c.close()


def test_warm_load_error_names_the_expert_and_keeps_the_others():
    c, ld = make(capacity=4)
    ld.fail[(0, 2)] = 1
    with pytest.raises(DiskError, match=r"expert 2 of layer 0"):
        c.warm([(0, 1), (0, 2), (0, 3)])
    assert sorted(c.lru_order(0)) == [1, 3]
    assert c.get(0, [2])[0].eid == 2                # read on demand afterwards
    c.close()


# -- errors ----------------------------------------------------------------------------------------

def test_loader_error_in_get_propagates_with_layer_and_expert():
    c, ld = make(capacity=4)
    ld.fail[(1, 7)] = 1
    with pytest.raises(DiskError, match=r"expert 7 of layer 1: short read in shard 3") as ei:
        c.get(1, [2, 7, 3])
    assert isinstance(ei.value.__cause__, DiskError)
    assert c.tier(1, 7) is None and c.tier(1, 2) == "lru" and c.tier(1, 3) == "lru"
    out = c.get(1, [7, 2])                          # the cache is consistent; 7 is read again
    assert [o.eid for o in out] == [7, 2] and ld.count((1, 7)) == 2 and ld.count((1, 2)) == 1
    assert c.stats["load_errors"] == 1
    c.close()


def test_error_type_that_cannot_take_a_message_becomes_runtime_error():
    def loader(layer, eid):
        raise KeyError("x")
    c = ExpertCache(loader, 1, 2, n_experts=4)
    with pytest.raises(RuntimeError, match="expert 1 of layer 0"):
        c.get(0, [1])
    c.close()


def test_bad_arguments():
    with pytest.raises(ValueError):
        ExpertCache(Loader(), 2, 0, n_experts=4)
    c, _ = make(n_rows=2, n_experts=4)
    with pytest.raises(IndexError):
        c.get(2, [0])
    with pytest.raises(IndexError):
        c.get(0, [4])
    with pytest.raises(IndexError):
        c.prefetch(0, [-1])
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.get(0, [1])
    c.prefetch(0, [1])                              # a no-op after close
    c.close()                                       # idempotent


# -- prefetch --------------------------------------------------------------------------------------

def test_prefetched_expert_is_a_hit_counted_once():
    c, ld = make(capacity=4)
    c.prefetch(0, [3, 3, 4])
    c.wait_prefetch()
    s = c.stats
    assert (s["prefetch_issued"], s["prefetch_loaded"], s["prefetch_unused"]) == (2, 2, 2)
    c.prefetch(0, [3])                              # cached now: not issued again
    assert c.stats["prefetch_issued"] == 2
    obj = c.get(0, [3])[0]
    assert obj is ld.made[(0, 3)][0]
    c.get(0, [3])
    s = c.stats
    assert (s["hits_lru"], s["misses"], s["prefetch_used"], s["prefetch_unused"]) == (2, 0, 1, 1)
    check_prefetch_balance(s)
    c.close()
    s = c.stats
    assert (s["prefetch_wasted"], s["prefetch_unused"]) == (1, 0)     # 4 was never used
    check_prefetch_balance(s)


def test_get_waits_for_an_inflight_prefetch_without_a_second_read():
    c, ld = make(capacity=4)
    gate = ld.gates[(0, 5)] = threading.Event()
    c.prefetch(0, [5])
    assert ld.started[(0, 5)].wait(T)
    assert c.tier(0, 5) == "loading"
    fut = in_thread(c.get, 0, [5, 6])
    wait_for_waiter(c, (0, 5))
    assert ld.started[(0, 6)].wait(T)             # the other expert is read meanwhile
    time.sleep(0.02)
    assert not fut.done()
    gate.set()
    out = fut.result(T)
    assert out[0] is ld.made[(0, 5)][0] and ld.count((0, 5)) == 1
    s = c.stats
    assert (s["prefetch_waits"], s["misses"], s["prefetch_used"], s["loads"]) == (1, 1, 1, 2)
    assert s["hit_rate"] == 0.5
    assert c.lru_order(0) == [5, 6]
    check_prefetch_balance(s)
    check_request_partition(s)
    c.close()


def test_waited_prefetch_goes_to_the_get_even_when_it_could_not_be_placed():
    c, ld = make(capacity=1)
    c.get(0, [0])
    gate = ld.gates[(0, 5)] = threading.Event()
    c.prefetch(0, [5], protect=[0])                 # on its own it would be dropped (no victim)
    assert ld.started[(0, 5)].wait(T)
    fut = in_thread(c.get, 0, [5])
    wait_for_waiter(c, (0, 5))
    gate.set()
    assert fut.result(T)[0] is ld.made[(0, 5)][0]
    s = c.stats
    assert (s["prefetch_used"], s["prefetch_dropped"], s["prefetch_waits"]) == (1, 0, 1)
    assert c.lru_order(0) == [5] and ld.count((0, 5)) == 1
    check_prefetch_balance(s)
    c.close()


def test_get_is_never_queued_behind_prefetches():
    c, ld = make(capacity=8, n_experts=64)
    gate = ld.gates[(0, 0)] = threading.Event()
    c.prefetch(0, range(20))                        # the worker is stuck on expert 0
    assert ld.started[(0, 0)].wait(T)
    out = in_thread(c.get, 1, [1, 2, 3]).result(T)  # other experts: loaded at once on the pool
    assert [o.eid for o in out] == [1, 2, 3]
    assert c.prefetch_pending() == 19
    gate.set()
    c.wait_prefetch()
    assert c.prefetch_pending() == 0
    c.close()


def test_prefetch_eviction_respects_protect():
    c, ld = make(capacity=2)
    c.get(0, [0])
    c.get(0, [1])
    c.prefetch(0, [2], protect=[0, 1])              # no victim: loaded, then dropped
    c.wait_prefetch()
    assert c.lru_order(0) == [0, 1] and c.stats["prefetch_dropped"] == 1
    c.prefetch(0, [3], protect=[0])                 # evicts 1, the oldest unprotected
    c.wait_prefetch()
    assert c.lru_order(0) == [0, 3]
    assert c.get(0, [3])[0] is ld.made[(0, 3)][0]
    s = c.stats
    assert (s["prefetch_loaded"], s["prefetch_used"], s["prefetch_dropped"]) == (2, 1, 1)
    check_prefetch_balance(s)
    c.close()


def test_prefetch_never_evicts_an_expert_of_a_get_in_progress():
    c, ld = make(capacity=2)
    c.get(0, [0])
    c.get(0, [1])                                   # LRU [0, 1]
    gate = ld.gates[(0, 5)] = threading.Event()
    fut = in_thread(c.get, 0, [0, 5])               # 0 is in use until the call returns
    assert ld.started[(0, 5)].wait(T)
    c.prefetch(0, [3])
    c.wait_prefetch()
    assert c.lru_order(0) == [0, 3]                 # 1 evicted, not 0 (older, but busy)
    c.prefetch(0, [4], protect=[3])                 # 0 busy, 3 protected: dropped
    c.wait_prefetch()
    assert c.lru_order(0) == [0, 3] and c.stats["prefetch_dropped"] == 1
    gate.set()
    out = fut.result(T)
    assert [o.eid for o in out] == [0, 5]
    assert c.lru_order(0) == [0, 5]                 # [3, 0, 5] trimmed: the unused 3 is wasted
    s = c.stats
    assert (s["prefetch_wasted"], s["evictions"]) == (1, 2)
    check_prefetch_balance(s)
    c.close()


def test_prefetch_does_not_change_what_get_returns():
    rng = random.Random(3)
    calls = [(rng.randrange(2), [rng.randrange(10) for _ in range(rng.randint(1, 4))]) for _ in range(80)]
    for use_prefetch in (False, True):
        c, ld = make(capacity=3, n_rows=2, n_experts=10, jitter=0.0005, seed=5)
        for i, (layer, eids) in enumerate(calls):
            if use_prefetch and i + 1 < len(calls):
                nl, ne = calls[i + 1]
                c.prefetch(nl, ne[:2] + [rng.randrange(10)], protect=eids)
            out = c.get(layer, eids)
            assert [(o.layer, o.eid) for o in out] == [(layer, e) for e in eids]
            assert all(any(o is m for m in ld.made[(o.layer, o.eid)]) for o in out)
        c.wait_prefetch()
        s = c.stats
        check_request_partition(s)
        check_prefetch_balance(s)
        assert not ld.same_key_overlap
        if use_prefetch:
            assert s["prefetch_loaded"] > 0 and s["prefetch_used"] > 0
        c.close()


def test_failed_prefetch_is_counted_and_read_again_by_get():
    c, ld = make(capacity=4)
    ld.fail[(0, 2)] = 1
    c.prefetch(0, [2])
    c.wait_prefetch()
    assert c.stats["prefetch_errors"] == 1 and c.tier(0, 2) is None
    out = c.get(0, [2])                             # no error: loads it again
    assert out[0] is ld.made[(0, 2)][0] and ld.count((0, 2)) == 2
    ld.fail[(0, 3)] = 2                             # fails in the prefetch and again in get()
    c.prefetch(0, [3])
    c.wait_prefetch()
    with pytest.raises(DiskError, match="expert 3 of layer 0"):
        c.get(0, [3])
    assert c.stats["prefetch_errors"] == 2
    c.close()


def test_get_waiting_on_a_prefetch_that_fails_reads_it_itself():
    c, ld = make(capacity=4)
    ld.fail[(1, 4)] = 1
    gate = ld.gates[(1, 4)] = threading.Event()
    c.prefetch(1, [4])
    assert ld.started[(1, 4)].wait(T)
    fut = in_thread(c.get, 1, [4])
    wait_for_waiter(c, (1, 4))
    gate.set()
    out = fut.result(T)
    assert out[0] is ld.made[(1, 4)][0] and ld.count((1, 4)) == 2
    s = c.stats
    assert (s["prefetch_errors"], s["prefetch_waits"], s["misses"]) == (1, 0, 1)
    check_request_partition(s)
    c.close()


def test_prefetch_queue_is_bounded_oldest_dropped():
    c, ld = make(capacity=8, n_rows=2, n_experts=4096)
    gate = ld.gates[(0, 0)] = threading.Event()
    c.prefetch(0, [0])
    assert ld.started[(0, 0)].wait(T)
    c.prefetch(1, range(4096))
    c.prefetch(0, range(1, 101))
    s = c.stats
    assert s["prefetch_issued"] == 1 + 4096 + 100
    assert s["prefetch_overflow"] == 100 and c.prefetch_pending() == cache_mod.PREFETCH_QUEUE_MAX
    ld.gates[(1, 100)] = threading.Event()          # the oldest entry left: (1, 100)
    gate.set()
    assert ld.started[(1, 100)].wait(T)
    assert not ld.started[(1, 0)].is_set()
    ld.gates[(1, 100)].set()
    c.close()
    assert c.prefetch_pending() == 0


def test_prefetch_disabled_is_a_noop():
    c, ld = make(prefetch=False)
    c.prefetch(0, [1, 2])
    c.wait_prefetch()
    assert ld.calls == [] and c.stats["prefetch_issued"] == 0
    c.close()


def test_prefetch_recall_from_recorded_predictions():
    c, ld = make(capacity=8)
    c.record_prediction(0, [1, 2, 3])
    c.get(0, [2, 3, 4, 5])                         # 2 of 4 true experts predicted
    c.get(0, [1])                                  # no prediction left: not counted
    c.record_prediction(1, [7])
    c.get(1, [7, 7])                               # 1 of 1
    s = c.stats
    assert (s["lookahead_true"], s["lookahead_hit"]) == (5, 3)
    assert s["prefetch_recall"] == pytest.approx(0.6)
    c.close()


# -- stats and usage -------------------------------------------------------------------------------

def test_usage_counts_every_requested_expert():
    c, ld = make(capacity=2, n_rows=3, n_experts=6)
    c.get(0, [1, 1, 2])
    c.get(2, [5])
    c.get(0, [1])
    assert c.usage.dtype == np.int64 and c.usage.shape == (3, 6)
    want = np.zeros((3, 6), np.int64)
    want[0, 1], want[0, 2], want[2, 5] = 3, 1, 1
    assert np.array_equal(c.usage, want)
    c.reset_stats()
    assert np.array_equal(c.usage, want)            # usage survives reset_stats
    s = c.stats
    assert s["requests"] == 0 and s["lru_experts"] == 3
    c.reset_usage()
    assert not c.usage.any()
    c.close()


def test_stats_keys():
    c, _ = make()
    s = c.stats
    for k in ("hits_pin", "hits_lru", "misses", "loads", "bytes_read", "load_s", "wait_s",
              "prefetch_issued", "prefetch_loaded", "prefetch_used", "prefetch_wasted",
              "prefetch_dropped", "prefetch_errors", "pinned_experts", "pinned_bytes", "lru_experts",
              "prefetch_recall", "hit_rate", "requests", "prefetch_waits"):
        assert k in s
    assert c.hit_rate() == 0.0 and s["prefetch_recall"] == 0.0
    c.close()


def test_set_capacity_trims_rows():
    c, ld = make(capacity=4)
    for e in range(4):
        c.get(0, [e])
    c.set_capacity(2)
    assert c.lru_order(0) == [2, 3]
    c.close()


# -- the kept tier ----------------------------------------------------------------------------------

def test_kept_tier_hands_evicted_experts_back_without_a_read():
    c, ld = make(capacity=1, nbytes=100)
    c.set_keep_bytes(1000)
    released = []
    c.on_evict = released.append
    a = c.get(0, [1])[0]
    c.get(0, [2])                                   # evicts 1 into the kept tier
    assert c.tier(0, 1) == "kept" and c.kept() == [(0, 1)] and released == []
    assert c.get(0, [1])[0] is a                    # the same object, no second load
    assert ld.calls == [(0, 1), (0, 2)] and c.tier(0, 1) == "lru" and c.kept() == [(0, 2)]
    s = c.stats
    assert (s["hits_kept"], s["misses"], s["loads"], s["kept"], s["released"]) == (1, 2, 2, 2, 0)
    assert (s["kept_experts"], s["kept_bytes"]) == (1, 100)
    assert s["hit_rate"] == 1 / 3 and s["lru_hit_rate"] == 0.0
    check_request_partition(s)
    c.close()


def test_kept_tier_releases_its_oldest_beyond_keep_bytes():
    c, ld = make(capacity=1, nbytes=100)
    c.set_keep_bytes(250)                           # two experts of 100 bytes
    released = []
    c.on_evict = released.append
    for e in range(5):
        c.get(0, [e])
    # LRU [4]; evicted 0, 1, 2, 3 in that order: 0 and 1 released, 2 and 3 kept
    assert c.kept() == [(0, 2), (0, 3)] and released == [ld.made[(0, 0)][0], ld.made[(0, 1)][0]]
    c.get(1, [7])
    c.get(1, [8])                                   # another row's eviction pushes out row 0's oldest
    assert c.kept() == [(0, 3), (1, 7)] and released[2] is ld.made[(0, 2)][0]
    c.set_keep_bytes(100)
    assert c.kept() == [(1, 7)] and released[3] is ld.made[(0, 3)][0]
    c.set_keep_bytes(0)
    assert c.kept() == [] and c.stats["released"] == 5
    c.get(2, [1])
    c.get(2, [2])                                   # no kept tier: released at eviction
    assert released[5] is ld.made[(2, 1)][0] and c.stats["kept_bytes"] == 0
    with pytest.raises(ValueError, match="keep_bytes"):
        c.set_keep_bytes(-1)
    c.close()


def test_kept_experts_are_not_prefetched_and_pins_adopt_them():
    c, ld = make(capacity=1)
    c.set_keep_bytes(10_000)
    c.get(0, [1])
    c.get(0, [2])
    c.prefetch(0, [1, 3])                          # 1 is kept: only 3 is read
    c.wait_prefetch()
    assert ld.count((0, 1)) == 1 and ld.count((0, 3)) == 1
    assert c.pin([(0, 1)]) == 100 and c.tier(0, 1) == "pin" and ld.count((0, 1)) == 1
    assert (0, 1) not in c.kept()
    c.close()


def test_a_prefetch_that_cannot_be_placed_goes_to_the_kept_tier():
    c, ld = make(capacity=1)
    c.set_keep_bytes(10_000)
    c.overshoot = 0
    c.get(0, [1])
    f = c.fetch(0, [1])                            # 1 in use: nothing may be evicted for a prefetch
    c.prefetch(0, [5])
    c.wait_prefetch()
    f.wait()
    s = c.stats
    assert s["prefetch_dropped"] == 1 and c.tier(0, 5) == "kept"
    assert c.get(0, [5])[0] is ld.made[(0, 5)][0] and ld.count((0, 5)) == 1
    c.close()


def test_guard_refuses_a_call_before_it_hands_out_experts():
    c, ld = make(capacity=2)
    c.get(0, [1])
    seen = []

    def guard(layer):
        seen.append(layer)
        if layer == 2:
            raise DiskError("shard 0 shrank")
    c.guard = guard
    assert c.get(0, [1])[0] is ld.made[(0, 1)][0]
    with pytest.raises(DiskError, match="shrank"):
        c.get(2, [1])
    assert seen == [0, 2] and ld.count((2, 1)) == 0 and c.tier(2, 1) is None
    assert c.get(1, []) == [] and seen == [0, 2]    # an empty call hands out nothing
    c.close()


@pytest.mark.parametrize("keep_bytes", [0, 350])
def test_concurrent_gets_and_prefetches_stay_consistent(keep_bytes):
    c, ld = make(capacity=3, n_rows=3, n_experts=10, io_threads=3, jitter=0.0005, seed=11)
    c.set_keep_bytes(keep_bytes)
    released = []
    c.on_evict = released.append
    errors = []
    distinct = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(40):
                layer = rng.randrange(3)
                eids = [rng.randrange(10) for _ in range(rng.randint(1, 4))]
                distinct.append(len(set(eids)))
                if rng.random() < 0.5:
                    c.prefetch(rng.randrange(3), [rng.randrange(10) for _ in range(3)],
                               protect=[rng.randrange(10)])
                out = c.get(layer, eids)
                assert [(o.layer, o.eid) for o in out] == [(layer, e) for e in eids]
        except Exception as e:          # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
        assert not t.is_alive()
    c.wait_prefetch()
    assert errors == []
    assert not ld.same_key_overlap
    s = c.stats
    check_request_partition(s)
    check_prefetch_balance(s)
    assert s["requests"] == sum(distinct) and s["loads"] == len(ld.calls)
    assert int(c.usage.sum()) >= sum(distinct)
    assert all(len(c.lru_order(r)) <= 3 for r in range(3))
    assert all(c.tier(r, e) != "loading" for r in range(3) for e in range(10))
    # every expert is in one tier at most; the kept tier stays within its bytes; released once each
    held = [(r, e) for r in range(3) for e in c.lru_order(r)] + c.kept()
    assert len(held) == len(set(held)) and s["kept_bytes"] <= keep_bytes
    assert len(released) == s["released"] and len(set(map(id, released))) == len(released)
    assert not any(o is h for o in released for h in c._kept.values())
    if keep_bytes:
        assert s["hits_kept"] > 0 and s["kept"] > 0
    else:
        assert s["hits_kept"] == 0 and s["kept_experts"] == 0
    c.close()
