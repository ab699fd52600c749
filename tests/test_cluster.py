"""Routed experts on expert workers (colibri.cluster): the tokens are the single-machine ones bit
for bit (greedy and seeded sampling, with drafts, prefill and decode), whatever the number of
workers; a killed worker's share is computed here (same tokens) and Ray brings it back; a worker
that stops answering is found within its deadline. Ray runs on 127.0.0.1 only (local:N)."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from colibri import cluster_wire as wire
from colibri.cluster_worker import ExpertWorker
from colibri.models import default_model_dir
from colibri.options import OptionError, Options

from conftest import DATA, decode

PROMPT = [5, 17, 230, 99, 4, 61, 8, 150, 33, 2]
LONG_PROMPT = [(7 * i + 3) % 200 + 10 for i in range(40)]      # prefill past the fused batch size


# -- placement and wire format (no Ray) ---------------------------------------------------------

def test_placement_is_deterministic_weighted_and_moves_only_a_lost_share():
    sparse = list(range(1, 9))
    a = wire.placement(10, 64, sparse, {"w0": 1.0, "w1": 1.0, "w2": 2.0})
    b = wire.placement(10, 64, sparse, {"w2": 2.0, "w0": 1.0, "w1": 1.0})
    assert np.array_equal(a, b)
    assert (a[0] == -1).all() and (a[9] == -1).all() and (a[1:9] >= 0).all()
    share = np.bincount(a[1:9].ravel(), minlength=3) / a[1:9].size
    assert abs(share[2] - 0.5) < 0.08 and abs(share[0] - 0.25) < 0.08
    c = wire.placement(10, 64, sparse, {"w0": 1.0, "w2": 2.0})          # w1 gone
    kept = a[1:9] != 1
    names_a, names_c = ["w0", "w1", "w2"], ["w0", "w2"]
    same = [names_a[x] == names_c[y] for x, y in zip(a[1:9][kept], c[1:9][kept])]
    assert all(same)                  # only w1's experts moved
    with pytest.raises(ValueError, match="w0"):
        wire.placement(2, 4, [1], {"w0": 0.0})


def test_call_round_trips_and_a_short_body_is_refused():
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    h, body = wire.pack_call(7, 2, x, [4, 9], np.array([0, 2, 3]), np.array([0, 2, 1]))
    layer, x2, ids, starts, rows = wire.unpack_call(h, body, 8)
    assert layer == 2 and np.array_equal(x, x2) and list(ids) == [4, 9]
    assert list(starts) == [0, 2, 3] and list(rows) == [0, 2, 1]
    x2[0, 0] = 1.0                    # writable copies (the engine writes into its inputs' views)
    with pytest.raises(wire.WireError, match="2 experts, 3 pairs and 3 rows"):
        wire.unpack_call(h, body[:-4], 8)


def test_worker_part_maps_a_share_of_the_union():
    ustart = np.array([0, 2, 3, 5], np.int32)
    urow = np.array([0, 3, 3, 1, 3], np.int32)
    used, starts, rows = wire.worker_part([0, 2], ustart, urow)
    assert list(used) == [0, 1, 3] and list(starts) == [0, 2, 4] and list(rows) == [0, 2, 1, 2]


def test_cluster_option_is_checked_before_anything_starts():
    for bad in ("local:0", "local:x", "", "local:65"):
        with pytest.raises(OptionError, match="cluster"):
            Options(cluster=bad)
    with pytest.raises(OptionError, match="cluster_timeout"):
        Options(cluster="local:2", cluster_timeout=0)
    assert Options(cluster="10.0.0.1:6379").cluster == "10.0.0.1:6379"


# -- the engine's remote path, workers in this process (no Ray) ---------------------------------

class InProcess:
    """Model.set_remote's protocol over ExpertWorker objects in this process: the wire format
    and the workers' compute exactly as over gloo; `broken` workers fail every call."""

    def __init__(self, path, cfg, n, settings, broken=()):
        names = {f"w{i}": 1.0 for i in range(n)}
        sparse = [l for l in range(cfg.n_layers) if cfg.sparse[l]] + [cfg.n_layers]
        self.owner = wire.placement(cfg.n_layers + 1, cfg.n_experts, sparse, names)
        self.workers = [ExpertWorker(f"w{i}", path, wire.owned_by(self.owner, i), settings) for i in range(n)]
        self.broken, self.calls = set(broken), 0

    def submit(self, layer, n, S, ids, ustart, urow):
        return _Handle(self, layer, n, ids, ustart, urow)


class _Handle:
    def __init__(self, r, layer, n, ids, ustart, urow):
        self.r, self.layer, self.ids, self.ustart = r, layer, ids, ustart
        self.by = {}
        self.local = []
        for u, e in enumerate(ids):
            self.by.setdefault(int(r.owner[layer][e]), []).append(u)
        self.msgs = {}
        for w, units in self.by.items():
            used, starts, rows = wire.worker_part(units, ustart, urow)
            self.msgs[w] = (units, starts, wire.pack_call(1, layer, n[used], [ids[u] for u in units], starts, rows))

    def wait(self, Y):
        failed = []
        for w, (units, starts, (h, body)) in self.msgs.items():
            if w in self.r.broken:
                failed += units
                continue
            y = self.r.workers[w]._compute(h, body)[:-1].reshape(-1, Y.shape[1])
            self.r.calls += 1
            for k, u in enumerate(units):
                Y[self.ustart[u]:self.ustart[u + 1]] = y[starts[k]:starts[k + 1]]
        return failed


def _runs(m, prompt):
    """greedy at depths 0 and auto, seeded sampling with drafts, and a long prefill's next tokens."""
    return [decode(m, prompt, 16, 0)[0], decode(m, prompt, 16, "auto")[0],
            decode(m, prompt, 16, 2, temperature=0.8, seed=11)[0], decode(m, LONG_PROMPT, 4, 1)[0]]


@pytest.mark.parametrize("path", [default_model_dir(), str(DATA / "tiny_mtp")], ids=["int4-container", "hf-f32"])
def test_remote_experts_give_the_local_tokens_bit_for_bit(path):
    from colibri._core import isa_active, model_init
    m = model_init(path, threads=1)
    try:
        want = _runs(m, PROMPT)
        for n, broken, ram in ((1, (), None), (3, (), None), (2, (1,), None), (2, (), 1e-6)):
            # ram: a budget smaller than one layer's share: the workers stream from their disk
            r = InProcess(path, m.cfg, n, dict(threads=1, isa=isa_active(), ram_gb=ram), broken)
            m.set_remote(r)
            assert _runs(m, PROMPT) == want, (n, broken, ram)
            assert r.calls > 0
            if ram:
                assert all(w.resident < w.n_experts and w.model.cache.stats["misses"] > 0 for w in r.workers)
            m.set_remote(None)
    finally:
        m.close()


def test_expert_outputs_refuse_inconsistent_calls():
    from colibri._core import EngineError, experts_init
    wm = experts_init(default_model_dir(), threads=1)
    D = wm.cfg.hidden
    x = np.zeros((2, D), np.float32)
    y = np.zeros((2, D), np.float32)
    with pytest.raises(EngineError, match="row 5"):
        wm.expert_outputs(1, x, [0], np.array([0, 2], np.int32), np.array([0, 5], np.int32), y)
    with pytest.raises(EngineError, match="expert 999"):
        wm.expert_outputs(1, x, [999], np.array([0, 2], np.int32), np.array([0, 1], np.int32), y)
    with pytest.raises(EngineError, match="inconsistent"):
        wm.expert_outputs(1, x, [0], np.array([0, 3], np.int32), np.array([0, 1], np.int32), y)


# -- Ray on 127.0.0.1 ---------------------------------------------------------------------------

MODELS = {"int4-container": default_model_dir(), "hf-f32": str(DATA / "tiny_mtp")}


@pytest.fixture(scope="module")
def references():
    from colibri._core import model_init
    out = {}
    for name, path in MODELS.items():
        m = model_init(path, threads=1)
        out[name] = _runs(m, PROMPT)
        m.close()
    return out


@pytest.fixture(scope="module")
def reference(references):
    return references["int4-container"]


def _cluster_model(n, timeout=30.0, path=None):
    from colibri._core import model_init
    from colibri.cluster import attach
    path = path or default_model_dir()
    m = model_init(path, threads=1)
    cl = attach(m, path, Options(cluster=f"local:{n}", cluster_timeout=timeout, cluster_threads=1))
    cl.quiet = True
    return m, cl


def _only_loopback(cl):
    import ray
    assert all(node["NodeManagerAddress"] == "127.0.0.1" for node in ray.nodes())
    assert all(w.address == "127.0.0.1" for w in cl.workers)


@pytest.mark.parametrize("n,model", [(1, "int4-container"), (2, "int4-container"), (3, "int4-container"),
                                     (2, "hf-f32")])
def test_workers_on_ray_give_the_local_tokens(references, n, model):
    from colibri.cluster import detach
    m, cl = _cluster_model(n, path=MODELS[model])
    try:
        _only_loopback(cl)
        assert _runs(m, PROMPT) == references[model]
        st = cl.stats()
        assert len(st["workers"]) == n and all(w["live"] and w["calls"] > 0 for w in st["workers"])
        assert sum(w["experts"] for w in st["workers"]) == int(np.sum(cl.owner >= 0))
        assert st["layer_rtt_ms"] and all(v > 0 for v in st["layer_rtt_ms"].values())
        assert all(w["hit_rate"] == 1.0 and w["resident_experts"] == w["experts"] for w in st["workers"])
    finally:
        detach(m, cl)
        m.close()


def _generate(m, prompt, n_new, on_text=None):
    from colibri.session import Session, positions_needed
    s = Session(m, Options(draft=2, ignore_eos=True), context=positions_needed(len(prompt), n_new, 2),
                configure=False)
    return s.generate(prompt, max_tokens=n_new, temperature=0.0, on_text=on_text).token_ids


def test_a_killed_worker_changes_no_token_and_comes_back(reference):
    from colibri.cluster import detach
    m, cl = _cluster_model(2)
    try:
        want = _generate(m, PROMPT, 24)
        victim = cl.workers[0]
        seen = []

        def kill_after_some(_text):
            seen.append(1)
            if len(seen) == 6:
                os.kill(victim.pid, signal.SIGKILL)
        assert _generate(m, PROMPT, 24, on_text=kill_after_some) == want
        st = cl.stats()["workers"][0]
        assert st["losses"] == 1 and st["fallback_units"] > 0 and "w0" in cl.events[0]
        assert cl.wait_live(120), cl.events           # Ray restarted it; the reviver took it back
        calls = victim.calls
        assert _generate(m, PROMPT, 24) == want       # the next request, with the worker back
        assert victim.calls > calls
    finally:
        detach(m, cl)
        m.close()


def test_a_worker_that_stops_answering_is_found_within_its_deadline():
    from colibri.cluster import detach
    m, cl = _cluster_model(2, timeout=1.5)
    try:
        want = _generate(m, PROMPT, 12)
        pid = cl.workers[1].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.time()
            assert _generate(m, PROMPT, 12) == want
            took = time.time() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert cl.workers[1].losses == 1 and "missed its deadline" in cl.events[0] and "w1" in cl.events[0]
        assert took < 1.5 + 10.0          # one deadline, then computed here without waiting again
        assert cl.wait_live(60), cl.events
        assert _generate(m, PROMPT, 12) == want
    finally:
        detach(m, cl)
        m.close()


def test_run_with_a_local_cluster_prints_the_same_text(tmp_path):
    base = [sys.executable, "-m", "colibri", "run", "def add(a, b):", "-n", "12", "--temperature", "0",
            "--threads", "1"]
    plain = subprocess.run(base + ["-q"], capture_output=True, text=True, timeout=300)
    stats = tmp_path / "s.json"
    clustered = subprocess.run(base + ["--cluster", "local:2", "--cluster-threads", "1", "--stats-json", str(stats)],
                               capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and clustered.returncode == 0, clustered.stderr[-2000:]
    assert clustered.stdout == plain.stdout
    assert "cluster: 2/2 workers live" in clustered.stderr
    st = json.loads(stats.read_text())["cluster"]
    assert [w["name"] for w in st["workers"]] == ["w0", "w1"]


def test_run_names_a_bad_cluster_option():
    r = subprocess.run([sys.executable, "-m", "colibri", "run", "x", "--cluster", "local:0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "cluster" in r.stderr and "Traceback" not in r.stderr
