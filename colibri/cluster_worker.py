"""An expert worker of colibri.cluster: a process (a Ray actor, one per machine) that holds only
routed experts, loaded from its own copy of the container into RAM, and answers the
coordinator's MoE calls over a gloo pair group (rank 0 the coordinator, rank 1 this worker).

Ray carries membership, placement, restarts and the control calls (ready, connect, stats); the
per-layer traffic goes over gloo (torch.distributed's ProcessGroupGloo), one pair group per
worker, so a lost worker breaks only its own link and a restarted one gets a new group.
"""
from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Dict, List, Optional

import numpy as np

from . import cluster_wire as wire

#: a worker's gloo timeout: it waits for the coordinator's next call however long the pause
IDLE_WAIT_S = 30 * 86400.0
#: how long connecting a pair group may take, whatever the calls' deadline
SETUP_TIMEOUT_S = 60.0


def pair_group(store_host: str, port: int, rank: int, device_host: str, timeout_s: float, prefix: str,
               store=None):
    """One side of a two-rank gloo group: rank 0 serves the TCP store (pass it as store), rank 1
    connects to store_host:port; gloo's sockets bind to device_host only (127.0.0.1 in tests)."""
    import torch.distributed as dist
    td = datetime.timedelta(seconds=timeout_s)
    # the group's setup (the store rendezvous) may take longer than a call's deadline on a busy
    # host: it gets SETUP_TIMEOUT_S, and the deadline bounds the calls once the pair is connected
    setup = datetime.timedelta(seconds=max(timeout_s, SETUP_TIMEOUT_S))
    if store is None:
        store = dist.TCPStore(store_host, port, 2, False, timeout=setup)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=device_host)]
    opts._timeout = setup
    pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, opts)
    pg._set_default_timeout(td)
    return pg


class ExpertWorker:
    """The worker's state (wrapped as a Ray actor by colibri.cluster). Ray re-runs __init__ with
    the same arguments after a restart, so a restarted worker loads the same share again."""

    def __init__(self, name: str, path: str, owned: Dict[int, List[int]], settings: dict):
        from ._core import experts_init
        self.name = name
        t0 = time.perf_counter()
        settings = dict(settings)
        ram_gb = settings.pop("ram_gb", None)
        self.model = experts_init(path, **settings)
        cap = self._capacity(owned, ram_gb)
        self.model.cache.set_capacity(cap)
        self.n_experts = sum(len(e) for e in owned.values())
        self.resident = 0
        for layer, eids in sorted(owned.items()):
            if eids:            # what the budget holds stays in RAM; the rest comes from disk on use
                self.model.cache.fetch(int(layer), [int(e) for e in eids[:cap]]).wait()
                self.resident += min(len(eids), cap)
        self.model.cache.reset_stats()      # the hit rate counts the calls' lookups, not this load
        self.load_s = time.perf_counter() - t0
        self.D = self.model.cfg.hidden
        self.lock = threading.Lock()        # one call computes at a time (the model's scratch)
        self.gen = -1
        self.calls = self.pairs = 0
        self.compute_s = 0.0
        self.error = ""                     # the last call it could not compute

    def _capacity(self, owned: Dict[int, List[int]], ram_gb: Optional[float]) -> int:
        """Experts per layer its cache keeps: every one (no budget), else what ram_gb holds of its
        share spread evenly over its layers (at least top-k: one call's experts)."""
        c = self.model.cfg
        if not ram_gb:
            return c.n_experts
        rows = max(sum(1 for e in owned.values() if e), 1)
        per_expert = 3 * c.moe_inter * c.hidden * (4 if self.model.expert_bits >= 16 else
                                                    max(self.model.expert_bits, 4) / 8)
        return int(max(c.topk, min(c.n_experts, ram_gb * 1e9 / per_expert // rows)))

    def ready(self) -> dict:
        return {"name": self.name, "pid": os.getpid(), "experts": self.n_experts, "resident": self.resident,
                "load_s": self.load_s}

    def stats(self) -> dict:
        cs = self.model.cache.stats
        return {"name": self.name, "pid": os.getpid(), "calls": self.calls, "pairs": self.pairs,
                "compute_s": self.compute_s, "experts": self.n_experts, "resident": self.resident,
                "hit_rate": cs["hit_rate"], "misses": cs["misses"], "error": self.error}

    def connect(self, store_host: str, port: int, gen: int, device_host: str, timeout_s: float) -> bool:
        """Join the coordinator's new pair group (generation gen) and serve it on a thread of its
        own; a thread still serving an older group ends at its next error."""
        pg = pair_group(store_host, port, 1, device_host, max(timeout_s, IDLE_WAIT_S), f"g{gen}/")
        self.gen = gen
        threading.Thread(target=self._serve, args=(pg, gen), name=f"colibri-{self.name}-g{gen}",
                         daemon=True).start()
        return True

    def _serve(self, pg, gen: int) -> None:
        import torch
        header = torch.zeros(wire.HEADER, dtype=torch.int64)
        while gen == self.gen:
            try:
                pg.recv([header], 0, 0).wait()
            except RuntimeError:
                return          # the coordinator closed this group (or went away)
            h = header.numpy().copy()
            if h[0] == wire.STOP:
                return
            try:
                body = torch.empty(int(h[6]), dtype=torch.uint8)
                pg.recv([body], 0, 0).wait()
                with self.lock:
                    if gen != self.gen:
                        return
                    try:
                        reply = self._compute(h, body.numpy())
                    except Exception as e:          # a bad call: say why, and keep serving
                        self.error = f"{type(e).__name__}: {e}"
                        reply = np.full(1 + self.D * int(h[5]), np.nan, np.float32)
                        reply[-1] = -1.0
                pg.send([torch.from_numpy(reply)], 0, 0).wait()
            except RuntimeError:
                return          # the link broke mid-call: the coordinator computes this call itself

    def _compute(self, h: np.ndarray, body: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        layer, x, ids, starts, rows = wire.unpack_call(h, body, self.D)
        reply = np.empty(rows.shape[0] * self.D + 1, np.float32)
        y = reply[:-1].reshape(rows.shape[0], self.D)
        if rows.shape[0]:
            self.model.expert_outputs(layer, x, [int(e) for e in ids], starts, rows, y)
        dt = time.perf_counter() - t0
        reply[-1] = dt
        self.calls += 1
        self.pairs += int(rows.shape[0])
        self.compute_s += dt
        return reply
