"""The routed-expert store: pinned hot-store, per-layer LRU, parallel loads and background prefetch.

Spec §7.1 describes the storage hierarchy of the reference engine. This module is the part of it
that lives in memory:

1. the **pinned hot-store** (``pin``): experts loaded once (startup pins, spec §7.2/§7.3) and never
   evicted;
2. the **per-layer LRU** of ``capacity`` experts (the same capacity for every row);
3. the **call working set**: while one ``get()`` call is in progress its experts are protected,
   and the LRU may hold up to ``capacity`` + (experts of the call) entries; it is trimmed back when
   the call returns;
4. the **kept tier** (``keep_bytes``, 0 = none): experts evicted from the LRU that the loader can
   hand back without reading them again (the engine's experts mapped in place from the page cache),
   kept, least recently evicted first, up to ``keep_bytes`` of their ``nbytes`` in all rows; an
   expert found there is a ``hits_kept`` and goes back into its row's LRU, and one pushed out of it
   is released (``on_evict``);
5. below it, implicitly, the OS page cache under the loader, and the disk.

Only the standard library, numpy and ``colibri.st`` (for ``BUFFER_ALIGN``) are used; the engine
(``colibri._core``) supplies the loader. ``SlabPool`` (the reuse of evicted experts' buffers) and
``IoClock`` (the wall time of expert reads) are the engine's bookkeeping around the cache.

Loader contract
---------------
``loader(layer, eid)`` returns an object with an integer attribute ``nbytes`` (the bytes it read
from disk). It is called from several threads at once (``io_threads`` pool workers for ``get()``
and ``pin()``, plus one prefetch thread), never twice concurrently for the same ``(layer, eid)``,
and it should release the GIL while it reads (``os.preadv`` does). The cache never touches the
objects it is given: ``get()`` returns exactly the objects the loader made. An exception raised by
the loader reaches the caller of ``get()``/``pin()`` re-raised with the layer and expert in front of
its message (same exception type when that type can be built from one message string, else
``RuntimeError``; the original is chained as ``__cause__``).

``on_evict(obj)`` is called once for each object the cache lets go of: evicted from the LRU (or
from the kept tier, when there is one), or dropped after a prefetch could not place it.

Determinism
-----------
Which experts ``get()`` loads and which it evicts depends only on the sequence of calls (and of
``prefetch()`` results), never on the order in which parallel loads complete: each call classifies
its experts up front, and inserts/evicts only once all of its loads are done, in ascending expert
order.

Prefetch accounting
-------------------
Every successful prefetch load (``prefetch_loaded``) ends in exactly one of these counters:

- ``prefetch_used``: a ``get()`` used it, either by waiting for the in-flight load
  (``prefetch_waits`` counts those) or by its first hit in the LRU (later hits do not count again).
  An unused prefetched expert adopted by ``pin()`` also counts as used (its read was not wasted);
- ``prefetch_dropped``: it could not be inserted (every LRU entry was protected or in use, or it was
  pinned meanwhile) and was discarded (let go into the kept tier, when there is one and the cache
  does not hold it already);
- ``prefetch_wasted``: it was evicted from the LRU before any ``get()`` used it; ``close()`` adds
  the prefetched experts still unused at that moment;
- ``prefetch_unused``: it sits in the LRU, not used yet (a snapshot; 0 after ``close()``).

So ``prefetch_loaded == prefetch_used + prefetch_dropped + prefetch_wasted + prefetch_unused``.
``prefetch_issued`` counts experts queued by ``prefetch()``; a queued expert that another path has
loaded by the time the worker reaches it, or that is still queued when a ``get()`` of its row starts
(too late to help), is skipped (``prefetch_skipped``), one that the bounded
queue pushed out is counted in ``prefetch_overflow``, one whose load raised in ``prefetch_errors``.
"""
from __future__ import annotations

import collections
import concurrent.futures
import operator
import threading
import time

import numpy as np

from . import st as _st

__all__ = ["ExpertCache", "Fetch", "IoClock", "PREFETCH_QUEUE_MAX", "SlabPool"]

PREFETCH_QUEUE_MAX = 4096           # pending prefetch entries; the oldest are dropped beyond this

_COUNTERS = ("requests", "hits_pin", "hits_lru", "hits_kept", "prefetch_waits", "inflight_waits", "misses",
             "loads", "load_errors", "bytes_read", "load_s", "wait_s", "evictions",
             "prefetch_issued", "prefetch_loaded", "prefetch_used", "prefetch_wasted",
             "prefetch_dropped", "prefetch_errors", "prefetch_skipped", "prefetch_overflow",
             "lookahead_true", "lookahead_hit", "kept", "released")
_FLOAT_COUNTERS = ("load_s", "wait_s")


class _Pending:
    """One load in progress: who started it, and its outcome once ``event`` is set."""
    __slots__ = ("layer", "eid", "kind", "protect", "event", "obj", "error", "waiters", "loader")

    def __init__(self, layer, eid, kind, protect=frozenset(), loader=None):
        self.layer = layer
        self.eid = eid
        self.kind = kind                # "get", "pin", "warm" or "prefetch"
        self.protect = protect          # prefetch only: experts its insertion must not evict
        self.event = threading.Event()
        self.obj = None
        self.error = None
        self.waiters = 0                # get() calls waiting for this load
        self.loader = loader            # None: the cache's loader


class _Entry:
    """An LRU entry: the expert, and whether it arrived by prefetch and has not been used yet."""
    __slots__ = ("obj", "prefetched")

    def __init__(self, obj, prefetched=False):
        self.obj = obj
        self.prefetched = prefetched


class Fetch:
    """One get() in progress (ExpertCache.fetch). ``ready``: eid -> expert for the call's experts
    that were pinned or cached when it started; ``wait()``: the call's experts in eids order (what
    get() returns; loader errors are raised here). Waiting twice returns the same list."""
    __slots__ = ("cache", "layer", "eids", "distinct", "found", "ready", "_waits", "_misses",
                 "_futures", "_t_wait", "_result", "_finished")

    def __init__(self, cache, layer, eids):
        self.cache = cache
        self.layer = layer
        self.eids = eids
        self.distinct = list(dict.fromkeys(eids))
        self.found = {}
        self.ready = {}
        self._waits = self._misses = self._futures = ()
        self._t_wait = 0.0
        self._result = None
        self._finished = False

    @property
    def pending(self) -> bool:
        """Some of the call's experts were not present when it started."""
        return self._result is None and len(self.ready) < len(self.distinct)

    def wait(self) -> list:
        if self._result is None:
            if self._finished:
                raise RuntimeError(f"the expert loads of layer {self.layer} failed (see the first error)")
            self._finished = True
            self._result = self.cache._finish(self)
        return self._result


def _with_context(exc, layer, eid):
    """exc re-made with the layer and expert in front of its message (same type when possible)."""
    msg = f"expert {eid} of layer {layer}: {exc}"
    try:
        new = type(exc)(msg)
        if str(new) != msg:
            raise TypeError
    except Exception:
        new = RuntimeError(msg)
    new.__cause__ = exc
    return new


class ExpertCache:
    """Per-layer expert cache with three tiers: a pinned hot-store (never evicted), a per-layer LRU
    of ``capacity`` experts, and (implicitly) the OS page cache under the loader.

    loader: ``loader(layer, eid) -> expert`` with an integer ``nbytes`` attribute; thread-safe (see
        the module docstring).
    n_rows: layer rows (main layers + the MTP row); ``layer`` arguments are row indices.
    capacity: experts kept per row in the LRU, >= 1 (>= n_experts keeps every expert).
    io_threads: workers that read the misses of one ``get()`` call (and ``pin()`` loads) in parallel.
    prefetch: False turns ``prefetch()`` into a no-op (no background thread is ever started).
    n_experts: routed experts per row (bounds the expert ids and sizes ``usage``).

    ``usage`` (numpy int64 [n_rows, n_experts], a snapshot) counts every requested expert: each element of the
    ``eids`` list of every ``get()`` call, duplicates included (pass every row's selection to count
    routed selections, or the batch union to count loads). It is not cleared by ``reset_stats()``
    (usage learning accumulates it), only by ``reset_usage()``.
    """

    def __init__(self, loader, n_rows: int, capacity: int, io_threads: int = 4, prefetch: bool = True,
                 *, n_experts: int):
        n_rows = operator.index(n_rows)
        n_experts = operator.index(n_experts)
        capacity = operator.index(capacity)
        io_threads = operator.index(io_threads)
        if n_rows < 1 or n_experts < 1:
            raise ValueError(f"ExpertCache needs n_rows >= 1 and n_experts >= 1, got {n_rows}, {n_experts}")
        if capacity < 1:
            raise ValueError(f"ExpertCache capacity must be >= 1, got {capacity}")
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.loader = loader
        self.n_rows = n_rows
        self.n_experts = n_experts
        self.capacity = capacity
        self.io_threads = io_threads
        self.prefetch_enabled = bool(prefetch)
        # Prefetched experts a row may hold beyond capacity when every older entry is protected
        # (the engine protects the predicted set, so one prediction's loads do not evict each
        # other); the next get() of the row trims it back.
        self.overshoot = 0
        # Called with each expert the cache lets go of (lock held, must be quick and must not call back).
        self.on_evict = None
        # Called as on_change(layer, eid, expert or None) whenever the expert held for (layer, eid)
        # changes: inserted into the LRU, the hot-store or the kept tier from none of them, or let go
        # (lock held, must be quick and must not call back). The engine mirrors the resident
        # experts (pinned, LRU and kept) in a table of its own.
        self.on_change = None
        # Bytes (sum of nbytes) of evicted experts kept for a read-free return (0: none kept).
        self.keep_bytes = 0
        # Called with the row at the start of every fetch(), outside the lock: raises to refuse the
        # call when the experts the cache holds can no longer be used (e.g. their file shrank).
        self.guard = None
        self._usage = [[0] * n_experts for _ in range(n_rows)]    # per-call increments stay in Python ints
        self._row_requests = [0] * n_rows     # distinct experts requested per row, and read (missed)
        self._row_misses = [0] * n_rows

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)     # prefetch queue / worker state
        self._pins = [dict() for _ in range(n_rows)]     # eid -> expert
        self._lru = [collections.OrderedDict() for _ in range(n_rows)]   # eid -> _Entry, LRU first
        self._busy = [dict() for _ in range(n_rows)]     # eid -> number of get() calls using it
        self._kept = collections.OrderedDict()           # (layer, eid) -> expert, oldest first
        self._kept_bytes = 0
        self._inflight = {}                              # (layer, eid) -> _Pending
        self._pred = {}                                  # layer -> frozenset of predicted eids
        self._queue = collections.deque()                # (layer, eid, protect)
        self._queued = set()                             # (layer, eid) in _queue
        self._pf_active = False                          # the worker is handling an entry
        self._worker = None
        self._closed = False
        self._pinned_bytes = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=io_threads,
                                                           thread_name_prefix="colibri-io")
        self._st = {}
        self.reset_stats()

    # -- helpers ----------------------------------------------------------------------------------

    def _check(self, layer, eid):
        layer = operator.index(layer)
        eid = operator.index(eid)
        if not 0 <= layer < self.n_rows:
            raise IndexError(f"layer row {layer} is outside [0, {self.n_rows})")
        if not 0 <= eid < self.n_experts:
            raise IndexError(f"expert {eid} is outside [0, {self.n_experts}) (layer {layer})")
        return layer, eid

    def _check_layer(self, layer):
        layer = operator.index(layer)
        if not 0 <= layer < self.n_rows:
            raise IndexError(f"layer row {layer} is outside [0, {self.n_rows})")
        return layer

    def _check_eids(self, layer, eids):
        out = []
        for e in eids:
            e = operator.index(e)
            if not 0 <= e < self.n_experts:
                raise IndexError(f"expert {e} is outside [0, {self.n_experts}) (layer {layer})")
            out.append(e)
        return out

    def _run_load(self, p):
        """Run the loader for pending load p and publish the outcome; never raises an Exception."""
        t0 = time.perf_counter()
        obj = err = None
        try:
            obj = (p.loader or self.loader)(p.layer, p.eid)
            nbytes = int(obj.nbytes)
        except BaseException as e:          # published to the waiters; re-raised below if fatal
            err = e
            nbytes = 0
        dt = time.perf_counter() - t0
        with self._lock:
            st = self._st
            st["load_s"] += dt
            if self._inflight.get((p.layer, p.eid)) is p:     # pin() loads are not registered
                del self._inflight[(p.layer, p.eid)]
            if err is not None:
                st["load_errors"] += 1
                if p.kind == "prefetch":
                    st["prefetch_errors"] += 1
            else:
                st["loads"] += 1
                st["bytes_read"] += nbytes
                if p.kind == "prefetch":
                    st["prefetch_loaded"] += 1
                    if p.waiters:
                        st["prefetch_used"] += 1      # handed straight to the waiting get()
                    else:
                        self._place_prefetched(p.layer, p.eid, obj, p.protect)
            p.obj = obj
            p.error = err
            p.event.set()
        if err is not None and not isinstance(err, Exception):
            raise err

    def _victims(self, layer, n, protect):
        """The n least recently used entries of layer that are neither protected nor in use, or
        None if there are fewer than n."""
        busy = self._busy[layer]
        out = []
        if n <= 0:
            return out
        for e in self._lru[layer]:
            if e in protect or busy.get(e):
                continue
            out.append(e)
            if len(out) == n:
                return out
        return None

    def _changed(self, layer, eid, obj):
        if self.on_change is not None:
            self.on_change(layer, eid, obj)

    def _evict(self, layer, e):
        ent = self._lru[layer].pop(e)
        self._st["evictions"] += 1
        if ent.prefetched:
            self._st["prefetch_wasted"] += 1
        obj = ent.obj
        del ent
        self._let_go(layer, e, obj, True)

    def _let_go(self, layer, e, obj, resident):
        """obj (expert e of layer; resident: it was in the LRU) leaves the LRU or is not placed in
        it: into the kept tier when there is one, pushing its oldest entries out beyond
        keep_bytes; whatever leaves the cache goes to on_evict."""
        if self.keep_bytes > 0:
            self._kept[(layer, e)] = obj
            self._kept_bytes += int(obj.nbytes)
            self._st["kept"] += 1
            if not resident:
                self._changed(layer, e, obj)
            self._trim_kept(self.keep_bytes)
            return
        self._release_obj(layer, e, obj, resident)

    def _trim_kept(self, nbytes):
        while self._kept and self._kept_bytes > nbytes:
            (layer, e), old = self._kept.popitem(last=False)
            self._kept_bytes -= int(old.nbytes)
            self._release_obj(layer, e, old, True)

    def _release_obj(self, layer, e, obj, resident):
        """The cache lets go of obj (expert e of layer; resident: the engine's mirror holds it)."""
        self._st["released"] += 1
        if resident:
            self._changed(layer, e, None)
        if self.on_evict is not None:
            self.on_evict(obj)          # e.g. recycle its buffer, or unmap its pages

    def _take_kept(self, layer, e):
        """The kept expert e of layer, removed from the kept tier, or None (lock held)."""
        obj = self._kept.pop((layer, e), None) if self._kept else None
        if obj is not None:
            self._kept_bytes -= int(obj.nbytes)
        return obj

    def _place_prefetched(self, layer, eid, obj, protect):
        """Insert a prefetched expert as the most recent entry of layer's LRU (lock held)."""
        lru = self._lru[layer]
        if eid in self._pins[layer] or eid in lru:
            self._st["prefetch_dropped"] += 1
            return
        victims = self._victims(layer, len(lru) - self.capacity + 1, protect)
        if victims is None:
            if len(lru) >= self.capacity + self.overshoot:
                self._st["prefetch_dropped"] += 1
                self._let_go(layer, eid, obj, False)
                return
            victims = []            # every entry is protected: hold it beyond capacity until a get() trims
        for v in victims:
            self._evict(layer, v)
        lru[eid] = _Entry(obj, prefetched=True)
        self._changed(layer, eid, obj)

    def _trim(self, layer):
        """Evict least recently used entries not in use until the row fits its capacity."""
        lru = self._lru[layer]
        extra = len(lru) - self.capacity
        if extra > 0:
            busy = self._busy[layer]
            victims = [e for e in lru if not busy.get(e)][:extra]
            for v in victims:
                self._evict(layer, v)

    # -- the three tiers ----------------------------------------------------------------------------

    def pin(self, items, progress=None) -> int:
        """Load (layer, eid) pairs into the pinned hot-store, in parallel on the I/O pool.

        Pairs already pinned are skipped; one found in the LRU moves to the hot-store without a new
        read. progress(done, total) is called in the calling thread after each pair. Returns the
        bytes newly pinned (sum of the experts' ``nbytes``). If loads fail, the others are still
        pinned and the first failure (in the order of items) is raised.
        """
        self._open()
        pairs = list(dict.fromkeys(self._check(layer, eid) for layer, eid in items))
        added = 0
        todo = []
        with self._lock:
            for layer, eid in pairs:
                if eid in self._pins[layer]:
                    continue
                ent = self._lru[layer].pop(eid, None)
                obj = ent.obj if ent is not None else self._take_kept(layer, eid)
                if obj is not None:
                    if ent is not None and ent.prefetched:
                        self._st["prefetch_used"] += 1
                    self._pins[layer][eid] = obj
                    nb = int(obj.nbytes)
                    self._pinned_bytes += nb
                    added += nb
                    continue
                todo.append(_Pending(layer, eid, "pin"))
        self._load_all(todo, progress)
        first_err = None
        with self._lock:
            for p in todo:
                if p.error is not None:
                    if first_err is None:
                        first_err = p
                    continue
                if p.eid in self._pins[p.layer]:
                    continue
                ent = self._lru[p.layer].pop(p.eid, None)
                if ent is not None and ent.prefetched:
                    self._st["prefetch_used"] += 1
                old = self._take_kept(p.layer, p.eid)
                if old is not None and old is not p.obj:
                    self._release_obj(p.layer, p.eid, old, False)     # replaced in the mirror below
                self._pins[p.layer][p.eid] = p.obj
                self._changed(p.layer, p.eid, p.obj)
                nb = int(p.obj.nbytes)
                self._pinned_bytes += nb
                added += nb
        if first_err is not None:
            raise _with_context(first_err.error, first_err.layer, first_err.eid) from first_err.error
        return added

    def warm(self, items, progress=None, loader=None) -> tuple:
        """Load (layer, eid) pairs into their rows' LRU before any call needs them (a model whose
        every expert fits in the budget is read once at start-up, as llama.cpp maps and populates
        its whole file): in parallel on the I/O pool, no usage or hit/miss counted (loads and bytes
        read are). Pairs already held (pinned, in the LRU or kept) are skipped, and a row is never
        filled beyond its capacity. progress(done, total) as pin()'s; loader (default: the cache's)
        reads them, with the same contract. Returns (experts placed, their bytes).
        Loads that fail leave their pairs to be read on demand; the first failure is raised."""
        self._open()
        pairs = list(dict.fromkeys(self._check(layer, eid) for layer, eid in items))
        todo = []
        with self._lock:
            room = [self.capacity - len(lru) for lru in self._lru]
            for layer, eid in pairs:
                if eid in self._pins[layer] or eid in self._lru[layer] or (layer, eid) in self._kept:
                    continue
                if room[layer] > 0:
                    room[layer] -= 1
                    todo.append(_Pending(layer, eid, "warm", loader=loader))
        self._load_all(todo, progress)
        placed = added = 0
        first_err = None
        with self._lock:
            for p in todo:
                if p.error is not None:
                    first_err = first_err or p
                    continue
                lru = self._lru[p.layer]
                if p.eid in self._pins[p.layer] or p.eid in lru or len(lru) >= self.capacity:
                    self._release_obj(p.layer, p.eid, p.obj, False)
                    continue
                lru[p.eid] = _Entry(p.obj)
                self._changed(p.layer, p.eid, p.obj)
                placed += 1
                added += int(p.obj.nbytes)
        if first_err is not None:
            raise _with_context(first_err.error, first_err.layer, first_err.eid) from first_err.error
        return placed, added

    def _load_all(self, todo, progress):
        """Run the loads of todo (_Pending, not registered in flight) on the I/O pool and wait for
        them all; progress(done, total) after each (and (0, 0) when there are none)."""
        total = len(todo)
        if progress is not None and total == 0:
            progress(0, 0)
        futures = [self._pool.submit(self._run_load, p) for p in todo]
        for done, f in enumerate(concurrent.futures.as_completed(futures), 1):
            f.result()
            if progress is not None:
                progress(done, total)

    def get(self, layer: int, eids) -> list:
        """The experts of one MoE call on row ``layer``, in the order of ``eids`` (duplicates allowed;
        each distinct expert is looked up, loaded and counted once per call).

        Pinned and cached experts are hits; an expert being loaded by a prefetch (or by another
        get()) is waited for, not read again; the remaining misses are read in parallel on the I/O
        pool. The call's experts are then the most recently used of the row (in ascending expert
        order) and the row is trimmed back to ``capacity``; experts used by another get() in
        progress are never evicted.
        """
        return self.fetch(layer, eids, inline=True).wait()

    def fetch(self, layer: int, eids, inline: bool = False) -> "Fetch":
        """get() in two steps: start the call and return at once with its ``Fetch``, whose
        ``ready`` holds the experts present now (pinned or cached) and whose ``wait()`` returns
        what get() returns, once the misses are read. The caller can multiply the ready experts
        while the I/O pool reads the others. Every Fetch must be waited for (its experts are
        protected from eviction until then). inline: a single miss is read on the calling thread
        (get(): nothing to overlap with)."""
        layer = self._check_layer(layer)
        eids = self._check_eids(layer, eids)
        f = Fetch(self, layer, eids)
        if not eids:
            f._result = []
            return f
        if self.guard is not None:
            self.guard(layer)
        busy = self._busy[layer]
        with self._lock:
            self._account_request(layer, eids, f.distinct)
            for e in f.distinct:
                busy[e] = busy.get(e, 0) + 1
        try:
            self._start_round(f, f.distinct, inline)
        except BaseException:
            self._release(f)
            raise
        f.ready = dict(f.found)
        return f

    def _account_request(self, layer, eids, distinct):
        """The counters of one call's request (lock held): usage, late prefetches of the row,
        the lookahead's recall, requests."""
        st = self._st
        if self._closed:
            raise RuntimeError("ExpertCache is closed")
        row = self._usage[layer]
        for e in eids:
            row[e] += 1
        self._row_requests[layer] += len(distinct)
        if self._queue:
            # prefetches of this row still queued are now late: this call reads what it needs,
            # and a later load would only displace experts (counted as skipped)
            stale = [q for q in self._queue if q[0] == layer]
            if stale:
                self._queue = collections.deque(q for q in self._queue if q[0] != layer)
                for q in stale:
                    self._queued.discard((q[0], q[1]))
                st["prefetch_skipped"] += len(stale)
                if not self._queue:
                    self._cond.notify_all()
        pred = self._pred.pop(layer, None)
        if pred is not None:
            st["lookahead_true"] += len(distinct)
            st["lookahead_hit"] += sum(1 for e in distinct if e in pred)
        st["requests"] += len(distinct)

    @property
    def usage(self) -> np.ndarray:
        """The routing counts (int64 [n_rows, n_experts], see the class docstring): a copy."""
        with self._lock:
            return np.array(self._usage, np.int64)

    def note_hits(self, layer: int, eids) -> None:
        """Account a call whose experts were all resident and used in place (the engine's C path
        looked them up in its mirror of the tiers, see on_change): the counters, the LRU order and
        the kept experts' return to the LRU (then trimmed to capacity) that a get() of the same
        experts makes. Raises KeyError if one is not resident."""
        self.note_hits_calls([(layer, eids)])

    def note_hits_calls(self, calls) -> None:
        """note_hits for each (layer, eids) of calls, in order, under one hold of the lock (the
        engine's C path accounts a whole token's layers at once)."""
        st = self._st
        with self._lock:
            for layer, eids in calls:
                distinct = sorted(set(eids))
                pins, lru = self._pins[layer], self._lru[layer]
                self._account_request(layer, eids, distinct)
                kept = False
                for e in distinct:
                    if e in pins:
                        st["hits_pin"] += 1
                        continue
                    ent = lru.get(e)
                    if ent is None:
                        obj = self._take_kept(layer, e)
                        if obj is None:
                            raise KeyError(f"expert {e} of layer {layer} is not resident")
                        st["hits_kept"] += 1
                        lru[e] = _Entry(obj)
                        kept = True
                        continue
                    st["hits_lru"] += 1
                    if ent.prefetched:
                        ent.prefetched = False
                        st["prefetch_used"] += 1
                    lru.move_to_end(e)
                if kept:
                    self._trim(layer)

    def prefetch_idle(self) -> bool:
        """No prefetch queued or being loaded: until prefetch() is called again, only the caller's
        own calls change what is resident."""
        with self._lock:
            return not self._queue and not self._pf_active

    def _start_round(self, f, remaining, inline):
        """Classify the experts `remaining` of fetch f: hits go to f.found; loads in flight are
        waited for; misses are registered and read (on the I/O pool, or inline when there is one
        and `inline`)."""
        layer = f.layer
        st = self._st
        pins, lru = self._pins[layer], self._lru[layer]
        waits, misses = [], []
        with self._lock:
            for e in remaining:
                obj = pins.get(e)
                if obj is not None:
                    st["hits_pin"] += 1
                    f.found[e] = obj
                    continue
                ent = lru.get(e)
                if ent is not None:
                    st["hits_lru"] += 1
                    if ent.prefetched:
                        ent.prefetched = False
                        st["prefetch_used"] += 1
                    f.found[e] = ent.obj
                    continue
                obj = self._take_kept(layer, e)
                if obj is not None:
                    st["hits_kept"] += 1
                    lru[e] = _Entry(obj)        # back in the LRU (protected: the call uses it)
                    f.found[e] = obj
                    continue
                p = self._inflight.get((layer, e))
                if p is not None:
                    p.waiters += 1
                    waits.append(p)
                    continue
                p = _Pending(layer, e, "get")
                self._inflight[(layer, e)] = p
                misses.append(p)
                st["misses"] += 1
                self._row_misses[layer] += 1
        f._waits, f._misses, f._futures = waits, misses, []
        if inline and len(misses) == 1:
            t0 = time.perf_counter()
            try:
                self._run_load(misses[0])
            finally:
                f._t_wait += time.perf_counter() - t0
            return
        for p in misses:
            try:
                f._futures.append(self._pool.submit(self._run_load, p))
            except RuntimeError:          # pool shut down by a concurrent close()
                self._run_load(p)

    def _finish(self, f) -> list:
        """Wait for fetch f's loads (a failed prefetch is read once more), then make its experts
        the row's most recent in ascending order, trim the row, and return them in eids order."""
        error = None                    # (eid, exception) of the first failure, in call order
        try:
            for round_ in range(2):
                t0 = time.perf_counter()
                try:
                    concurrent.futures.wait(f._futures)
                    for p in f._waits:
                        p.event.wait()
                finally:
                    f._t_wait += time.perf_counter() - t0
                retry = []
                with self._lock:
                    for p in f._misses:
                        if p.error is None:
                            f.found[p.eid] = p.obj
                    for p in f._waits:
                        if p.error is None:
                            f.found[p.eid] = p.obj
                            self._st["prefetch_waits" if p.kind == "prefetch" else "inflight_waits"] += 1
                        elif p.kind == "prefetch" and round_ == 0:
                            retry.append(p.eid)      # a failed prefetch is not our error: read it again
                failed = {p.eid: p.error for p in f._misses + f._waits
                          if p.error is not None and p.eid not in retry}
                if failed:
                    e = next(x for x in f.distinct if x in failed)
                    error = (e, failed[e])
                    break
                if not retry:
                    break
                self._start_round(f, retry, True)
        finally:
            self._release(f)
        if error is not None:
            raise _with_context(error[1], f.layer, error[0]) from error[1]
        return [f.found[e] for e in f.eids]

    def _release(self, f):
        """End fetch f: its experts are no longer in use; those it has become the row's most
        recently used, in ascending expert order; the row is trimmed to capacity."""
        layer = f.layer
        pins, lru, busy = self._pins[layer], self._lru[layer], self._busy[layer]
        with self._lock:
            self._st["wait_s"] += f._t_wait
            for e in sorted(f.distinct):
                busy[e] -= 1
                if not busy[e]:
                    del busy[e]
                obj = f.found.get(e)
                if obj is None or e in pins:
                    continue
                ent = lru.get(e)
                if ent is None:
                    lru[e] = _Entry(obj)
                    self._changed(layer, e, obj)
                else:
                    if ent.prefetched:
                        ent.prefetched = False
                        self._st["prefetch_used"] += 1
                    lru.move_to_end(e)
            self._trim(layer)

    def prefetch(self, layer: int, eids, protect=()) -> None:
        """Queue background loads of the experts of ``eids`` that are neither pinned, cached, loading
        nor already queued. A prefetched expert becomes the most recent entry of the row, evicting
        the least recently used entries that are not in ``protect`` and not used by a get() in
        progress; if there are none, it is dropped. Returns at once."""
        if not self.prefetch_enabled:
            return
        layer = self._check_layer(layer)
        eids = self._check_eids(layer, eids)
        protect = frozenset(operator.index(e) for e in protect)
        with self._cond:
            if self._closed:
                return
            pins, lru = self._pins[layer], self._lru[layer]
            added = False
            for e in dict.fromkeys(eids):
                key = (layer, e)
                if e in pins or e in lru or key in self._inflight or key in self._queued or key in self._kept:
                    continue
                self._queue.append((layer, e, protect))
                self._queued.add(key)
                self._st["prefetch_issued"] += 1
                added = True
                while len(self._queue) > PREFETCH_QUEUE_MAX:
                    old_layer, old_e, _ = self._queue.popleft()
                    self._queued.discard((old_layer, old_e))
                    self._st["prefetch_overflow"] += 1
            if added:
                if self._worker is None:
                    self._worker = threading.Thread(target=self._prefetch_loop, name="colibri-prefetch",
                                                    daemon=True)
                    self._worker.start()
                self._cond.notify_all()

    def _prefetch_loop(self):
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                layer, e, protect = self._queue.popleft()
                self._queued.discard((layer, e))
                key = (layer, e)
                if e in self._pins[layer] or e in self._lru[layer] or key in self._inflight or key in self._kept:
                    self._st["prefetch_skipped"] += 1
                    if not self._queue:
                        self._cond.notify_all()
                    continue
                p = _Pending(layer, e, "prefetch", protect)
                self._inflight[key] = p
                self._pf_active = True
            try:
                self._run_load(p)
            finally:
                with self._cond:
                    self._pf_active = False
                    self._cond.notify_all()

    def wait_prefetch(self) -> None:
        """Block until every queued prefetch has been handled (loaded, skipped, dropped or failed)."""
        with self._cond:
            while (self._queue or self._pf_active) and not self._closed and self._worker is not None:
                self._cond.wait()

    def prefetch_pending(self) -> int:
        """Experts queued for prefetch and not yet taken by the worker."""
        with self._lock:
            return len(self._queue)

    def record_prediction(self, layer: int, predicted_eids) -> None:
        """Store a router-lookahead prediction for the next get() of ``layer`` (consumed by it):
        that get() adds its distinct experts to ``lookahead_true`` and those predicted to
        ``lookahead_hit``; ``stats["prefetch_recall"]`` is their ratio."""
        layer = self._check_layer(layer)
        pred = frozenset(operator.index(e) for e in predicted_eids)
        with self._lock:
            self._pred[layer] = pred

    def set_capacity(self, capacity: int) -> None:
        """Change the LRU capacity of every row (trimming rows that are now too long)."""
        capacity = operator.index(capacity)
        if capacity < 1:
            raise ValueError(f"ExpertCache capacity must be >= 1, got {capacity}")
        with self._lock:
            self.capacity = capacity
            for layer in range(self.n_rows):
                self._trim(layer)

    def set_keep_bytes(self, nbytes: int) -> None:
        """Resize the kept tier (0: none; experts evicted from the LRU are released at once),
        releasing its oldest entries beyond the new size."""
        nbytes = operator.index(nbytes)
        if nbytes < 0:
            raise ValueError(f"keep_bytes must be >= 0, got {nbytes}")
        with self._lock:
            self.keep_bytes = nbytes
            self._trim_kept(nbytes)

    def close(self) -> None:
        """Stop the prefetch thread (pending requests are discarded, a load in progress finishes)
        and the I/O pool; unused prefetched experts still in the LRU are counted as wasted.
        Further get()/pin() calls raise RuntimeError; prefetch() becomes a no-op. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.clear()
            self._queued.clear()
            self._cond.notify_all()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join()
        self._pool.shutdown(wait=True)
        with self._lock:
            for lru in self._lru:
                for ent in lru.values():
                    if ent.prefetched:
                        ent.prefetched = False
                        self._st["prefetch_wasted"] += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _open(self):
        if self._closed:
            raise RuntimeError("ExpertCache is closed")

    # -- inspection -------------------------------------------------------------------------------

    def tier(self, layer: int, eid: int):
        """"pin", "lru", "kept", "loading" or None: where expert eid of layer is right now."""
        layer, eid = self._check(layer, eid)
        with self._lock:
            if eid in self._pins[layer]:
                return "pin"
            if eid in self._lru[layer]:
                return "lru"
            if (layer, eid) in self._kept:
                return "kept"
            if (layer, eid) in self._inflight:
                return "loading"
            return None

    def kept(self) -> list:
        """The (layer, eid) pairs of the kept tier, the next to be released first."""
        with self._lock:
            return list(self._kept)

    def lru_order(self, layer: int) -> list:
        """The experts in layer's LRU, least recently used first."""
        layer = self._check_layer(layer)
        with self._lock:
            return list(self._lru[layer])

    def pinned(self, layer: int) -> list:
        """The pinned experts of layer, ascending."""
        layer = self._check_layer(layer)
        with self._lock:
            return sorted(self._pins[layer])

    def reset_stats(self) -> None:
        """Zero the counters (not ``usage``, not the tier contents)."""
        with self._lock:
            for k in _COUNTERS:
                self._st[k] = 0.0 if k in _FLOAT_COUNTERS else 0
            self._row_requests = [0] * self.n_rows
            self._row_misses = [0] * self.n_rows

    def reset_usage(self) -> None:
        with self._lock:
            self._usage = [[0] * self.n_experts for _ in range(self.n_rows)]

    @property
    def stats(self) -> dict:
        """A snapshot of the counters (see the module docstring for the prefetch ones) plus
        ``pinned_experts``, ``pinned_bytes``, ``lru_experts``, ``kept_experts``, ``kept_bytes``,
        ``prefetch_unused``, ``hit_rate``, ``lru_hit_rate`` (the same without the kept tier's hits:
        what a cache of copies with this capacity would have found) and ``prefetch_recall``
        (lookahead_hit / lookahead_true, 0.0 without predictions).

        requests = hits_pin + hits_lru + hits_kept + prefetch_waits + inflight_waits + misses
        (distinct experts per call), as long as no get() failed; ``kept`` counts the experts that
        entered the kept tier, ``released`` those the cache let go of (``on_evict``)."""
        with self._lock:
            s = dict(self._st)
            s["pinned_experts"] = sum(len(p) for p in self._pins)
            s["pinned_bytes"] = self._pinned_bytes
            s["lru_experts"] = sum(len(r) for r in self._lru)
            s["kept_experts"] = len(self._kept)
            s["kept_bytes"] = self._kept_bytes
            s["prefetch_unused"] = sum(1 for r in self._lru for ent in r.values() if ent.prefetched)
        s["hit_rate"] = self._hit_rate(s)
        s["lru_hit_rate"] = self._hit_rate(s, kept=False)
        s["prefetch_recall"] = (s["lookahead_hit"] / s["lookahead_true"]) if s["lookahead_true"] else 0.0
        return s

    @staticmethod
    def _hit_rate(s, kept=True):
        hits = s["hits_pin"] + s["hits_lru"] + s["prefetch_waits"] + s["inflight_waits"]
        if kept:
            hits += s["hits_kept"]
        return hits / s["requests"] if s["requests"] else 0.0

    def miss_count(self) -> int:
        """Experts read because a call found them nowhere (the ``misses`` counter, without the
        copy of every counter that ``stats`` makes)."""
        return self._st["misses"]

    def row_hit_rate(self, layer: int):
        """Share of the distinct experts requested from cache row ``layer`` that were not read
        (found in a tier or in flight); None before any request."""
        with self._lock:
            n = self._row_requests[layer]
            return 1.0 - self._row_misses[layer] / n if n else None

    def hit_rate(self) -> float:
        """(hits_pin + hits_lru + hits_kept + prefetch_waits + inflight_waits) / requests (0.0 before
        any): the share of requested experts found in memory, not read."""
        with self._lock:
            return self._hit_rate(self._st)


# -- the engine's bookkeeping of its expert buffers and reads ----------------------------------


class SlabPool:
    """Expert payload buffers of evicted experts, reused by the next loads of the same size. New
    buffers come CHUNK bytes of one size at a time, advised for transparent huge pages (a token's
    expert reads then walk one TLB entry per 2 MiB, as the resident matrices' do: 4 experts per
    layer over the page cache, bench fixture, 1.04x); the pool keeps every buffer it ever handed
    out, so their number is the most experts of one size held at once (pinned, LRU, kept and in
    calls: the RAM plan's bound), and the RSS exceeds the bytes handed out by at most the huge page
    the buffers of one size are being carved from (_core.BUFFER_SLACK_BYTES). An evicted expert is often
    still in use (a call needing more experts than the LRU holds computes with experts the cache
    has already let go; a long batch multiplies one group of experts while the next group is read
    into buffers), so the pool keeps only weak references to an evicted expert and its three
    matrices (their payloads are views of the buffer) and takes the buffer back once all four are
    gone: liveness itself, not a reference count (whose value for one object depends on how the
    code that inspects it was compiled: under Cython a threshold tuned for Python let buffers of
    experts still being multiplied be read over).

    ``fresh(nbytes)``: a new BUFFER_ALIGN-aligned uint8 buffer advised for transparent huge pages
    (the engine supplies its allocator, ``colibri._core._Arena._fresh``)."""
    CHUNK = 64 << 20

    def __init__(self, fresh):
        self._fresh = fresh
        self._free = {}
        self._waiting = []              # (weak refs to the expert and its matrices, its buffer)
        self._lock = threading.Lock()
        self.reused = 0

    def recycle(self, E):
        """on_evict hook of the expert cache."""
        import weakref
        slab = getattr(E, "slab", None)
        if slab is None:                # float experts (mapped ones never come here)
            return
        refs = tuple(weakref.ref(o) for o in (E, E.gate, E.up, E.down))
        with self._lock:
            self._waiting.append((refs, slab))

    def take(self, nbytes):
        with self._lock:
            keep = []
            for refs, slab in self._waiting:
                if all(r() is None for r in refs):
                    self._free.setdefault(slab.nbytes, []).append(slab)
                else:
                    keep.append((refs, slab))
            self._waiting = keep
            lst = self._free.setdefault(nbytes, [])
            if lst:
                self.reused += 1
            else:
                # k buffers of this size in one advised allocation, each BUFFER_ALIGN-aligned
                step = -(-nbytes // _st.BUFFER_ALIGN) * _st.BUFFER_ALIGN
                k = max(1, self.CHUNK // step)
                chunk = self._fresh(step * k)
                lst.extend(chunk[i * step:i * step + nbytes] for i in range(k - 1, -1, -1))
            return lst.pop()


class IoClock:
    """Wall seconds during which at least one expert read is in flight (reads overlap on the I/O
    pool and the prefetch thread, so the sum of their durations would overstate the disk time)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self):
        with self._lock:
            self._n, self._t0, self._busy = 0, 0.0, 0.0

    def start(self):
        with self._lock:
            if self._n == 0:
                self._t0 = time.perf_counter()
            self._n += 1

    def stop(self):
        with self._lock:
            self._n -= 1
            if self._n == 0:
                self._busy += time.perf_counter() - self._t0

    def busy_s(self):
        with self._lock:
            return self._busy + ((time.perf_counter() - self._t0) if self._n else 0.0)
