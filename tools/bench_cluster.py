#!/usr/bin/env python3
"""Expert workers across network namespaces: tok/s of ``run --cluster`` against the single-machine
engine with the same experts in RAM, the network time per token, and a projection to GLM-5.2.

The tool makes its own network (root needed): a namespace per machine (cb_h: the Ray head and the
coordinator; cb_w1..cb_wN: one expert worker each), joined by veth pairs to a bridge in a
namespace of its own (cb_sw), addresses 10.77.0.0/24, each machine's link shaped with ``tc tbf``
(--rate, e.g. 1gbit or 10gbit; none: unshaped). Nothing listens outside these namespaces. The runs
(fresh ``python -m colibri run`` processes, greedy, interleaved, --rounds each) go through the
real multi-machine path: ``ray start`` per namespace, ``--cluster 10.77.0.1:PORT``.

    sudo python tools/bench_cluster.py --model /tmp/bench_model_int4 --workers 2 --rate 1gbit --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PORT = 6390
SUBNET = "10.77.0"
RESOURCE = "colibri_expert_worker"


def sh(cmd, check=True, **kw):
    return subprocess.run(cmd, shell=isinstance(cmd, str), check=check, capture_output=True, text=True, **kw)


def ns_names(n):
    return ["cb_h"] + [f"cb_w{k}" for k in range(1, n + 1)]


def make_network(n, rate):
    """The namespaces, bridge and shaped links; returns the addresses by namespace."""
    teardown(n)
    sh("ip netns add cb_sw")
    sh("ip netns exec cb_sw ip link add cbbr type bridge")
    sh("ip netns exec cb_sw ip link set cbbr up")
    addr = {}
    for i, ns in enumerate(ns_names(n)):
        sh(f"ip netns add {ns}")
        sh(f"ip link add {ns}e type veth peer name {ns}p")
        sh(f"ip link set {ns}e netns {ns}")
        sh(f"ip link set {ns}p netns cb_sw")
        sh(f"ip netns exec cb_sw ip link set {ns}p master cbbr up")
        a = f"{SUBNET}.{i + 1}"
        sh(f"ip netns exec {ns} ip addr add {a}/24 dev {ns}e")
        sh(f"ip netns exec {ns} ip link set {ns}e up")
        sh(f"ip netns exec {ns} ip link set lo up")
        if rate:
            sh(f"ip netns exec {ns} tc qdisc add dev {ns}e root tbf rate {rate} burst 512kb latency 50ms")
        addr[ns] = a
    return addr


def teardown(n):
    for ns in ns_names(n) + ["cb_sw"]:
        sh(f"ip netns pids {ns} 2>/dev/null | xargs -r kill -9", check=False)
        sh(f"ip netns del {ns}", check=False)


def ray_bin():
    return shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")


#: every Ray process of the bench shares one token (RAY_AUTH_MODE=token), as on real machines
ENV = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.urandom(16).hex())


def start_ray(n, addr, tmp):
    ray = ray_bin()
    env = ENV
    sh(f"ip netns exec cb_h {ray} start --head --port={PORT} --node-ip-address={addr['cb_h']} --num-cpus=1 "
       f"--include-dashboard=false --temp-dir={tmp}/h --resources='{{\"{RESOURCE}\": 0}}'", env=env)
    for k in range(1, n + 1):
        ns = f"cb_w{k}"
        sh(f"ip netns exec {ns} {ray} start --address={addr['cb_h']}:{PORT} --node-ip-address={addr[ns]} "
           f"--num-cpus=1 --resources='{{\"{RESOURCE}\": 1}}'", env=env)


def one_run(model, ids, n_tok, cluster, addr, tmp, threads):
    out = os.path.join(tmp, "stats.json")
    cmd = ["ip", "netns", "exec", "cb_h", sys.executable, "-m", "colibri", "run", "--model", model,
           "--prompt-ids", ids, "-n", str(n_tok), "--temperature", "0", "--ignore-eos", "--draft", "0",
           "--threads", str(threads), "--stats-json", out, "-q"]
    if cluster:
        cmd += ["--cluster", f"{addr['cb_h']}:{PORT}", "--cluster-threads", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                       env=dict(ENV, COLIBRI_USAGE_DIR=tmp))
    if r.returncode != 0:
        raise SystemExit(f"run failed:\n{r.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def projection(lat_s, D=6144, topk=8, n_moe=75, machines=(4, 8), gbe=(1, 10)):
    """Network seconds per decoded token for GLM-5.2 (hidden 6144, top-8 of 256, 75 MoE layers,
    no drafts): colibri.cluster_wire.token_bytes (the formula plan --cluster uses) through the
    coordinator's link, plus one measured round trip (lat_s) per MoE layer."""
    from colibri.cluster_wire import token_bytes
    out = {}
    for m in machines:
        b = token_bytes(D, topk, m, n_moe)
        for g in gbe:
            out[f"{m} machines, {g} GbE"] = {"bytes_per_token": b,
                                             "network_s_per_token": n_moe * lat_s + b / (g * 1e9 / 8)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="container directory (every namespace reads the same path)")
    ap.add_argument("--workers", type=int, default=2, help="expert machines (default 2)")
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate per link (default 1gbit; 'none': unshaped)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved runs each (default 3)")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per run (default 48)")
    ap.add_argument("--threads", type=int, default=1, help="the coordinator's threads (default 1)")
    ap.add_argument("--json", default=None, help="write the results as JSON")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench_cluster makes network namespaces: run it as root")
    ids = "5,17,230,99,4,61,8,150,33,2"
    tmp = tempfile.mkdtemp(prefix="cb_")
    res = {"model": a.model, "workers": a.workers, "rate": a.rate, "rounds": a.rounds, "tokens": a.tokens,
           "local": [], "cluster": []}
    try:
        addr = make_network(a.workers, None if a.rate == "none" else a.rate)
        start_ray(a.workers, addr, tmp)
        tokens = {}
        for r in range(a.rounds):
            for kind in ("local", "cluster"):
                s = one_run(a.model, ids, a.tokens, kind == "cluster", addr, tmp, a.threads)
                tokens.setdefault(kind, s["tokens"])
                if s["tokens"] != tokens[kind]:
                    raise SystemExit(f"{kind}: tokens differ between rounds")
                row = {"decode_tok_s": s["decode_tok_s"], "prefill_s": s["prefill_s"]}
                if kind == "cluster":
                    ws = s["cluster"]["workers"]
                    n = max(len(s["tokens"]), 1)
                    row.update(network_ms_per_token=1e3 * sum(w["network_s"] for w in ws) / n,
                               remote_compute_ms_per_token=1e3 * sum(w["remote_compute_s"] for w in ws) / n,
                               bytes_per_token=sum(w["bytes_sent"] + w["bytes_received"] for w in ws) / n,
                               layer_rtt_ms=statistics.median(s["cluster"]["layer_rtt_ms"].values()))
                res[kind].append(row)
                print(kind, row, flush=True)
        res["bit_identical"] = tokens["local"] == tokens["cluster"]
        med = {k: statistics.median(x["decode_tok_s"] for x in res[k]) for k in ("local", "cluster")}
        res["median_tok_s"] = med
        res["ratio"] = med["cluster"] / med["local"]
        rtt = statistics.median(x["layer_rtt_ms"] for x in res["cluster"]) / 1e3
        res["projection_glm52"] = projection(rtt)
        print(json.dumps({k: res[k] for k in ("bit_identical", "median_tok_s", "ratio")}, indent=1))
    finally:
        for ns in ns_names(a.workers):
            sh(f"ip netns exec {ns} {ray_bin()} stop --force", check=False, env=ENV)
        teardown(a.workers)
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
