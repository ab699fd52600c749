"""``python -m colibri cluster head|worker|status|stop``: start the Ray processes of a cluster whose
expert workers hold the routed experts (colibri.cluster). A thin layer over ``ray start``: the
head runs on the machine that runs ``serve --cluster`` (or run / chat); every expert machine runs
``cluster worker``, which offers Ray the resource the coordinator places its workers by."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import List

from .cluster import RESOURCE

EXAMPLES = """examples:
  # on the coordinator (it keeps attention, KV, dense layers and the API):
  python -m colibri cluster head --host 10.0.0.1
  # on each expert machine (with its own copy of the container at the same path):
  python -m colibri cluster worker --address 10.0.0.1:6379 --host 10.0.0.2
  # then, on the coordinator:
  python -m colibri serve -m /data/glm52-int4 --cluster auto
  python -m colibri cluster status
"""


def _ray() -> List[str]:
    exe = shutil.which("ray")
    return [exe] if exe else [sys.executable, "-m", "ray.scripts.scripts"]


def head_command(a) -> List[str]:
    cmd = _ray() + ["start", "--head", f"--port={a.port}", "--include-dashboard=false", "--disable-usage-stats",
                    f"--resources={json.dumps({RESOURCE: a.workers})}"]
    if a.host:
        cmd.append(f"--node-ip-address={a.host}")
    return cmd


def worker_command(a) -> List[str]:
    cmd = _ray() + ["start", f"--address={a.address}", "--disable-usage-stats",
                    f"--resources={json.dumps({RESOURCE: a.workers})}"]
    if a.host:
        cmd.append(f"--node-ip-address={a.host}")
    return cmd


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EXAMPLES
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    h = sub.add_parser("head", help="start the Ray head on the coordinator machine")
    h.add_argument("--port", type=int, default=6379, help="the head's port (default 6379)")
    h.add_argument("--host", default=None, help="this machine's address on the cluster's network")
    h.add_argument("--workers", type=int, default=0, metavar="N",
                   help="expert workers on the head machine itself (default 0)")
    w = sub.add_parser("worker", help="join a head as an expert machine")
    w.add_argument("--address", required=True, help="the head's HOST:PORT")
    w.add_argument("--host", default=None, help="this machine's address on the cluster's network")
    w.add_argument("--workers", type=int, default=1, metavar="N",
                   help="expert workers on this machine (default 1: one per machine holds its RAM)")
    s = sub.add_parser("status", help="the machines offering expert workers")
    s.add_argument("--address", default="auto", help="the head's HOST:PORT (default: the local head)")
    sub.add_parser("stop", help="stop this machine's Ray processes")


def run(a: argparse.Namespace) -> int:
    if a.action in ("head", "worker") and a.workers < (0 if a.action == "head" else 1):
        raise ValueError(f"--workers must be >= {0 if a.action == 'head' else 1}, got {a.workers}")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("the cluster commands need the cluster extra: pip install 'colibri[cluster]'") from None
    if a.action == "head":
        return subprocess.call(head_command(a))
    if a.action == "worker":
        return subprocess.call(worker_command(a))
    if a.action == "stop":
        return subprocess.call(_ray() + ["stop"])
    import ray
    ray.init(address=a.address, log_to_driver=False)
    rows = [n for n in ray.nodes() if n.get("Alive")]
    for n in rows:
        r = n.get("Resources", {})
        print(f"{n['NodeManagerAddress']:>15}  expert workers {int(r.get(RESOURCE, 0))}  "
              f"memory {r.get('memory', 0) / 2**30:.1f} GiB  cpus {int(r.get('CPU', 0))}")
    print(f"{sum(int(n.get('Resources', {}).get(RESOURCE, 0)) for n in rows)} expert workers on {len(rows)} machines")
    return 0
