"""Routed experts held in the RAM of several machines: the coordinator's side.

The coordinator (this process) keeps everything but the routed experts: embeddings, attention and
KV, routers, shared experts, dense layers, the MTP head's dense part, lm_head, sampling and the
API. Expert workers (colibri.cluster_worker, Ray actors, one per machine or ``local:N`` of them
on this one) hold the routed experts, placed by a weighted hash of (layer, expert)
(cluster_wire.placement). Per MoE call the engine (Model.set_remote) hands the batch union to
:meth:`Cluster.submit`: every involved worker gets one message with its experts, their rows and
the rows' inputs; meanwhile the engine computes what no live worker holds; then each worker's
reply (unweighted outputs per (expert, row) pair) goes into the call's pair buffer and the engine
adds them in its own order, so the tokens are the single-machine ones bit for bit.

Faults: a worker that breaks its link or misses the deadline is reported by name (stderr and
stats); its share of the call, and of every call until it is back, is computed here from this
machine's copy of the container. Ray restarts a killed worker (which loads its share again), and
a thread here takes it back between calls.

Why gloo pair groups rather than ray.util.collective: that library's gloo groups all live in one
torch default process group (a lost worker breaks every group, and a new one needs the whole
world again), its timeout covers only the rendezvous, and it must be called from inside an actor.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import cluster_wire as wire

#: the custom Ray resource a node offers per expert worker it hosts (``ray start --resources``)
RESOURCE = "colibri_expert_worker"
NAMESPACE = "colibri"
#: seconds a worker may take to load its share and answer ready()
LOAD_TIMEOUT_S = 600.0
#: how often the reviver looks for a lost worker that is back
REVIVE_EVERY_S = 0.5


class ClusterError(RuntimeError):
    """A cluster that cannot start, or a call no machine could compute (names the worker)."""


def parse_cluster(spec: str) -> Tuple[str, object]:
    """'local:N' -> ('local', N); 'auto' or HOST:PORT or ray://... -> ('address', spec)."""
    problem = wire.check_cluster_spec(spec)
    if problem:
        raise ValueError(f"--cluster {problem}")
    spec = spec.strip()
    if spec.startswith("local:"):
        return "local", int(spec[len("local:"):])
    return "address", spec


def _need_extra():
    try:
        import ray
        if not hasattr(ray, "init"):        # a folder named ray/ in the working directory, not Ray
            raise ImportError(name="ray")
        import torch.distributed  # noqa: F401
    except ImportError as e:
        raise ClusterError(f"--cluster needs the cluster extra ({e.name} is missing): "
                           "pip install 'colibri[cluster]'") from None


class _Link:
    """The coordinator's end of one worker's gloo pair group."""

    def __init__(self, pg, store):
        self.pg, self.store = pg, store         # the store serves the group's rendezvous: kept alive


class _Worker:
    def __init__(self, name: str, node: str, weight: float, address: str):
        self.name, self.node, self.weight, self.address = name, node, weight, address
        self.actor = None
        self.link: Optional[_Link] = None
        self.pid = -1
        self.gen = 0
        self.lost: Optional[str] = None         # why it is out (None: live)
        self.calls = self.pairs = 0
        self.bytes_sent = self.bytes_received = 0
        self.rtt_s = self.compute_s = 0.0
        self.losses = 0
        self.fallback_units = 0


class CallHandle:
    """One MoE call in flight: ``local`` (units no live worker took), ``wait(Y)``."""

    def __init__(self, cluster: "Cluster", layer: int, ids, ustart, local: List[int], parts, t0: float):
        self.cluster, self.layer, self.local, self.parts, self.t0 = cluster, layer, local, parts, t0
        self.ids, self.ustart = ids, ustart

    def wait(self, Y: np.ndarray) -> List[int]:
        """Fill Y's rows of the units the workers computed; returns the units to compute here."""
        return self.cluster._collect(self, Y)


class Cluster:
    """Expert workers on Ray, with gloo links; see the module docstring."""

    def __init__(self, spec: str, path: str, cfg, settings: dict, *, deadline_s: float = 30.0,
                 quiet: bool = False, mtp_moe: bool = True):
        kind, arg = parse_cluster(spec)
        if kind == "local":
            # Ray's loopback mode: node IP 127.0.0.1, every socket bound to it (read at import,
            # and by the worker processes from their environment)
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        _need_extra()
        import ray
        if kind == "local":
            import ray._private.ray_constants as rc
            rc.ENABLE_RAY_CLUSTER = False       # ray was imported before this call
        self.path, self.cfg, self.deadline_s, self.quiet = os.fspath(path), cfg, float(deadline_s), quiet
        if not self.deadline_s > 0:
            raise ValueError(f"--cluster-timeout must be > 0 seconds, got {deadline_s}")
        self._started = False
        term = signal.getsignal(signal.SIGTERM)     # ray.init installs its own (sys.exit with a traceback)
        try:
            self._init_ray(ray, kind, arg)
        finally:
            if threading.current_thread() is threading.main_thread() and term is not None:
                signal.signal(signal.SIGTERM, term)
        self.workers = self._find_workers(ray)
        names = {w.name: w.weight for w in self.workers}
        # rows with routed experts: the sparse layers, and the MTP layer's when the model has them
        sparse = [l for l in range(cfg.n_layers) if cfg.sparse[l]] + ([cfg.n_layers] if mtp_moe else [])
        self.owner = wire.placement(cfg.n_layers + 1, cfg.n_experts, sparse, names)
        self.settings = dict(settings)
        self.seq = 0
        self.layer_rtt = np.zeros(cfg.n_layers + 1)
        self.layer_calls = np.zeros(cfg.n_layers + 1, np.int64)
        self.events: List[str] = []
        self._closing = threading.Event()
        self._start_workers(ray)
        self._reviver = threading.Thread(target=self._revive_loop, name="colibri-cluster-revive", daemon=True)
        self._reviver.start()

    # -- start-up ---------------------------------------------------------------------------------

    def _init_ray(self, ray, kind, arg) -> None:
        if kind == "local":
            self.host = "127.0.0.1"
            if not ray.is_initialized():
                ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 1), resources={RESOURCE: arg},
                         include_dashboard=False, namespace=NAMESPACE,
                         object_store_memory=80 * 2 ** 20, log_to_driver=False, configure_logging=False,
                         _system_config={"metrics_report_interval_ms": 10 ** 8})
                self._started = True
        else:
            if not ray.is_initialized():
                try:
                    ray.init(address=arg, namespace=NAMESPACE, log_to_driver=False)
                except Exception as e:      # ConnectionError and Ray's own
                    raise ClusterError(f"--cluster {arg}: cannot join the Ray cluster: {e}") from None
            self.host = ray.util.get_node_ip_address()

    def _find_workers(self, ray) -> List[_Worker]:
        out = []
        nodes = sorted((n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(RESOURCE)),
                       key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
        for n in nodes:
            k = int(n["Resources"][RESOURCE])
            mem = float(n["Resources"].get("memory", 1.0)) or 1.0
            for _ in range(k):
                out.append(_Worker(f"w{len(out)}", n["NodeID"], mem / k, n["NodeManagerAddress"]))
        if not out:
            raise ClusterError(f"the Ray cluster has no node offering the {RESOURCE!r} resource: start "
                               "workers with 'python -m colibri cluster worker --address HEAD:PORT'")
        return out

    def _start_workers(self, ray):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        from .cluster_worker import ExpertWorker
        Actor = ray.remote(ExpertWorker)
        for i, w in enumerate(self.workers):
            w.actor = Actor.options(
                name=f"colibri-{w.name}-{os.getpid()}", num_cpus=0, resources={RESOURCE: 1},
                max_restarts=-1, max_task_retries=0, max_concurrency=4,
                scheduling_strategy=NodeAffinitySchedulingStrategy(w.node, soft=False),
            ).remote(w.name, self.path, wire.owned_by(self.owner, i), self.settings)
        for w in self.workers:
            try:
                info = ray.get(w.actor.ready.remote(), timeout=LOAD_TIMEOUT_S)
            except Exception as e:
                self.close()
                raise ClusterError(f"expert worker {w.name} on {w.address} did not start: "
                                   f"{_root_cause(e)}") from None
            w.pid = info["pid"]
            self._connect(ray, w)

    def _connect(self, ray, w: _Worker) -> None:
        """A new gloo pair group with worker w (its next generation)."""
        import torch.distributed as dist
        from .cluster_worker import pair_group
        import datetime
        w.gen += 1
        store = dist.TCPStore(self.host, 0, 2, True, timeout=datetime.timedelta(seconds=60),
                              wait_for_workers=False)
        device = "127.0.0.1" if self.host == "127.0.0.1" else w.address    # the worker's gloo socket
        ref = w.actor.connect.remote(self.host, store.port, w.gen, device, self.deadline_s)
        pg = pair_group(self.host, store.port, 0, self.host, self.deadline_s, f"g{w.gen}/", store=store)
        ray.get(ref, timeout=60)
        w.link = _Link(pg, store)
        w.lost = None

    # -- one MoE call -----------------------------------------------------------------------------

    def submit(self, layer: int, n: np.ndarray, S: int, ids: Sequence[int], ustart: np.ndarray,
               urow: np.ndarray) -> CallHandle:
        """Send each live worker its units of the call (batch union: expert ids[u] on rows
        urow[ustart[u]:ustart[u+1]] of n [S, D]); returns the handle (see CallHandle)."""
        import torch
        t0 = time.perf_counter()
        owner = self.owner[layer]
        by: Dict[int, List[int]] = {}
        local: List[int] = []
        for u, e in enumerate(ids):
            wi = int(owner[e])
            if wi >= 0 and self.workers[wi].lost is None:
                by.setdefault(wi, []).append(u)
            else:
                local.append(u)
        parts = []
        D = n.shape[1]
        self.seq += 1
        for wi, units in by.items():
            w = self.workers[wi]
            rows_used, starts, rows = wire.worker_part(units, ustart, urow)
            header, body = wire.pack_call(self.seq, layer, n[rows_used], [ids[u] for u in units], starts, rows)
            reply = torch.empty(rows.shape[0] * D + 1, dtype=torch.float32)
            try:
                sends = [w.link.pg.send([torch.from_numpy(header)], 1, 0),
                         w.link.pg.send([torch.from_numpy(body)], 1, 0)]
                recv = w.link.pg.recv([reply], 1, 0)
            except RuntimeError as e:
                self._lose(w, f"send failed: {_first_line(e)}")
                local.extend(units)
                continue
            w.bytes_sent += header.nbytes + body.nbytes
            parts.append((wi, units, starts, reply, sends, recv, (header, body)))
        return CallHandle(self, layer, ids, ustart, local, parts, t0)

    def _collect(self, h: CallHandle, Y: np.ndarray) -> List[int]:
        import datetime
        failed: List[int] = []
        D = Y.shape[1]
        for wi, units, starts, reply, sends, recv, _keep in h.parts:
            w = self.workers[wi]
            left = max(self.deadline_s - (time.perf_counter() - h.t0), 0.001)
            try:
                for s in sends:
                    s.wait(datetime.timedelta(seconds=left))
                recv.wait(datetime.timedelta(seconds=left))
            except RuntimeError as e:
                why = "missed its deadline" if "Timed out" in str(e) else "link broke"
                self._lose(w, f"{why} ({self.deadline_s:g} s) at layer {h.layer}: {_first_line(e)}")
                failed.extend(units)
                continue
            r = reply.numpy()
            if r[-1] < 0:                   # the worker could not compute it (see its stats)
                self._lose(w, f"could not compute layer {h.layer}: {self._worker_error(w)}")
                failed.extend(units)
                continue
            y = r[:-1].reshape(-1, D)
            # the reply holds the units' pairs back to back, in the order they were sent
            ustart = h.ustart
            for k, u in enumerate(units):
                a, b = int(starts[k]), int(starts[k + 1])
                Y[ustart[u]:ustart[u] + (b - a)] = y[a:b]
            w.calls += 1
            w.pairs += y.shape[0]
            w.bytes_received += reply.numel() * 4
            w.compute_s += float(r[-1])
            w.rtt_s += time.perf_counter() - h.t0
        for u in failed + h.local:
            wi = int(self.owner[h.layer][h.ids[u]])
            if wi >= 0:
                self.workers[wi].fallback_units += 1
        self.layer_rtt[h.layer] += time.perf_counter() - h.t0
        self.layer_calls[h.layer] += 1
        return failed

    # -- faults -----------------------------------------------------------------------------------

    def _lose(self, w: _Worker, why: str) -> None:
        """Worker w is out until the reviver takes it back: say so once, by name."""
        if w.lost is not None:
            return
        w.lost = why
        w.losses += 1
        link, w.link = w.link, None
        msg = (f"colibri: expert worker {w.name} (pid {w.pid} on {w.address}) {why}; its experts are "
               f"computed here from {self.path} until it is back")
        self.events.append(msg)
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)
        if link is not None:
            try:
                link.pg.abort()
            except Exception:
                pass

    def _worker_error(self, w: _Worker) -> str:
        import ray
        try:
            return ray.get(w.actor.stats.remote(), timeout=2.0)["error"] or "no reason given"
        except Exception as e:
            return f"no reason given ({_first_line(e)})"

    def _revive_loop(self) -> None:
        import ray
        while not self._closing.wait(REVIVE_EVERY_S):
            for w in self.workers:
                if w.lost is None or self._closing.is_set():
                    continue
                try:
                    info = ray.get(w.actor.ready.remote(), timeout=2.0)
                    w.pid = info["pid"]
                    self._connect(ray, w)
                    msg = f"colibri: expert worker {w.name} (pid {w.pid}) is back"
                    self.events.append(msg)
                    if not self.quiet:
                        print(msg, file=sys.stderr, flush=True)
                except Exception:
                    continue

    # -- the engine's view ------------------------------------------------------------------------

    def live(self) -> List[str]:
        return [w.name for w in self.workers if w.lost is None]

    def wait_live(self, timeout_s: float = 60.0) -> bool:
        """Block until every worker is live (tests, and a server that wants its workers back)."""
        end = time.time() + timeout_s
        while time.time() < end:
            if all(w.lost is None for w in self.workers):
                return True
            time.sleep(0.05)
        return False

    def stats(self) -> dict:
        """The coordinator's counters per worker (with each live worker's own: its cache's hit
        rate, misses and resident experts) and the mean round trip per layer."""
        import ray
        own = {}
        for w in self.workers:
            if w.lost is None:
                try:
                    own[w.name] = ray.get(w.actor.stats.remote(), timeout=5.0)
                except Exception:
                    pass
        calls = np.maximum(self.layer_calls, 1)
        return {
            "workers": [{"name": w.name, "pid": w.pid, "address": w.address, "live": w.lost is None,
                         "lost": w.lost, "losses": w.losses, "calls": w.calls, "pairs": w.pairs,
                         "bytes_sent": w.bytes_sent, "bytes_received": w.bytes_received,
                         "rtt_s": w.rtt_s, "remote_compute_s": w.compute_s,
                         "network_s": max(w.rtt_s - w.compute_s, 0.0),
                         "fallback_units": w.fallback_units,
                         "hit_rate": own.get(w.name, {}).get("hit_rate"),
                         "disk_misses": own.get(w.name, {}).get("misses"),
                         "resident_experts": own.get(w.name, {}).get("resident"),
                         "experts": int(np.sum(self.owner == i))} for i, w in enumerate(self.workers)],
            "layer_rtt_ms": {int(l): 1e3 * float(self.layer_rtt[l] / calls[l])
                             for l in np.flatnonzero(self.layer_calls)},
            "events": list(self.events),
        }

    def close(self) -> None:
        import ray
        self._closing.set()
        import torch
        for w in self.workers:
            if w.link is not None and w.lost is None:
                try:
                    w.link.pg.send([torch.from_numpy(wire.stop_header())], 1, 0).wait()
                except Exception:
                    pass
            if w.actor is not None:
                try:
                    ray.kill(w.actor, no_restart=True)
                except Exception:
                    pass
            w.link = None
        if self._started and ray.is_initialized():
            ray.shutdown()
            self._started = False


def attach(model, path: str, options) -> Cluster:
    """Start (local:N) or join the cluster of options.cluster, its workers loaded with model's
    routed experts at the same settings, and route model's MoE calls through it."""
    from ._core import isa_active
    cluster = Cluster(options.cluster, path, model.cfg, dict(options.worker_kwargs(), isa=isa_active()),
                      deadline_s=options.cluster_timeout, mtp_moe=model.has_mtp and model.mtp.sparse)
    model.set_remote(cluster)
    return cluster


def detach(model, cluster: Optional[Cluster]) -> None:
    if cluster is not None:
        model.set_remote(None)
        cluster.close()


def summary_line(st: dict) -> str:
    """One line of a run's cluster stats (Cluster.stats)."""
    ws = st["workers"]
    rtt = list(st["layer_rtt_ms"].values())
    parts = [f"cluster: {sum(w['live'] for w in ws)}/{len(ws)} workers live",
             f"MoE round trip {np.mean(rtt):.2f} ms/layer" if rtt else "no MoE call",
             f"sent {sum(w['bytes_sent'] for w in ws) / 2**20:.1f} MiB, received "
             f"{sum(w['bytes_received'] for w in ws) / 2**20:.1f} MiB",
             "time: network {:.3f}s, remote compute {:.3f}s".format(sum(w["network_s"] for w in ws),
                                                                    sum(w["remote_compute_s"] for w in ws))]
    hits = [w["hit_rate"] for w in ws if w.get("hit_rate") is not None]
    if hits:
        parts.append("worker experts hit " + "/".join(f"{100 * h:.0f}%" for h in hits))
    lost = [f"{w['name']} ({w['losses']}x, {w['fallback_units']} units here)" for w in ws if w["losses"]]
    if lost:
        parts.append("lost: " + ", ".join(lost))
    return " | ".join(parts)


def _root_cause(e: BaseException) -> str:
    """The last line of a remote error's text (Ray puts the worker's traceback in it)."""
    lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
    return lines[-1][:500] if lines else type(e).__name__


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0][:300] if s else type(e).__name__
