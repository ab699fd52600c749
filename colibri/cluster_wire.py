"""What the coordinator and an expert worker say to each other per MoE call (colibri.cluster), and
where each routed expert lives. No Ray and no torch here: numpy only, so the placement and the
message format are tested (and used by ``plan --cluster``) without the cluster extra.

One MoE call to one worker is three gloo messages:
    header  int64 [HEADER]   command, sequence number, layer, rows R, experts U, pairs P, body bytes
    body    uint8 [bytes]    ids int32 [U], starts int32 [U + 1], rows int32 [P], x float32 [R, D]
    reply   float32 [P·D + 1] the unweighted output of expert ids[u] on row x[rows[p]] for the pairs
                             p in starts[u]..starts[u+1], then the worker's compute seconds
The coordinator weights and sums the rows itself, in its own order, so the tokens are the ones a
single machine computes, bit for bit.
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, List, Sequence, Tuple

import numpy as np

HEADER = 8
CALL, STOP = 1, 2


def check_cluster_spec(spec) -> "str | None":
    """None when spec names a cluster (local:N with 1 <= N <= 64, or an address), else the problem."""
    if not isinstance(spec, str) or not spec.strip():
        return f"must be local:N or the address of a Ray cluster (HOST:PORT, auto), got {spec!r}"
    spec = spec.strip()
    if spec.startswith("local:"):
        n = spec[len("local:"):]
        if not n.isdigit() or not 1 <= int(n) <= 64:
            return f"local:N needs N expert workers, 1 to 64, got {spec!r}"
    return None


class WireError(ValueError):
    """A message that does not hold together (names the field)."""


def pack_call(seq: int, layer: int, x: np.ndarray, ids: Sequence[int], starts: np.ndarray,
              rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(header int64 [HEADER], body uint8) of one call: x [R, D] float32, ids [U], starts [U + 1],
    rows [P] (indices into x)."""
    ids = np.asarray(ids, np.int32)
    starts = np.asarray(starts, np.int32)
    rows = np.asarray(rows, np.int32)
    x = np.ascontiguousarray(x, np.float32)
    body = np.concatenate([ids.view(np.uint8), starts.view(np.uint8), rows.view(np.uint8),
                           x.reshape(-1).view(np.uint8)])
    header = np.array([CALL, seq, layer, x.shape[0], ids.shape[0], rows.shape[0], body.nbytes, 0], np.int64)
    return header, body


def stop_header() -> np.ndarray:
    h = np.zeros(HEADER, np.int64)
    h[0] = STOP
    return h


def unpack_call(header: np.ndarray, body: np.ndarray, D: int):
    """(layer, x [R, D], ids, starts, rows) of a call, every count checked against the body."""
    _, _, layer, R, U, P, nbytes, _ = (int(v) for v in header)
    if min(R, U, P) < 0 or nbytes != body.nbytes or nbytes != 4 * (U + (U + 1) + P + R * D):
        raise WireError(f"call body of {body.nbytes} bytes does not hold {U} experts, {P} pairs "
                        f"and {R} rows of {D}")
    raw = np.ascontiguousarray(body, np.uint8)
    a = raw[:4 * (2 * U + 1 + P)].view(np.int32)
    ids, starts, rows = a[:U].copy(), a[U:2 * U + 1].copy(), a[2 * U + 1:].copy()
    x = raw[4 * (2 * U + 1 + P):].view(np.float32).reshape(R, D).copy()
    return layer, x, ids, starts, rows


def worker_part(units: Sequence[int], ustart: np.ndarray, urow: np.ndarray):
    """A worker's share of an MoE call's batch union: for units (indices into the union), the rows
    they read (sorted, as indices into the call's rows), their starts and their pairs' rows as
    indices into that row list."""
    spans = [(int(ustart[u]), int(ustart[u + 1])) for u in units]
    pair_rows = np.concatenate([urow[a:b] for a, b in spans]) if spans else np.zeros(0, np.int32)
    used, local = np.unique(pair_rows, return_inverse=True)
    starts = np.zeros(len(units) + 1, np.int32)
    starts[1:] = np.cumsum([b - a for a, b in spans])
    return used.astype(np.int64), starts, local.astype(np.int32)


def _unit_hash(layer: int, eid: int, name: str) -> float:
    """A number in (0, 1) fixed by (layer, expert, worker name)."""
    d = hashlib.blake2b(f"{layer}/{eid}/{name}".encode(), digest_size=8).digest()
    return (int.from_bytes(d, "little") + 0.5) / 2.0 ** 64


def placement(n_rows: int, n_experts: int, sparse_rows: Sequence[int], workers: Dict[str, float]) -> np.ndarray:
    """owner [n_rows, n_experts]: the index (into sorted worker names) of the worker holding each
    routed expert, -1 for rows without routed experts. Weighted rendezvous hashing: expert (l, e)
    goes to the worker with the largest weight / -ln(hash(l, e, name)), so each worker holds a
    share in proportion to its weight (its RAM), the result depends only on the names and
    weights, and a worker that joins or leaves moves only its own share."""
    names = sorted(workers)
    if not names:
        raise ValueError("a cluster needs at least one expert worker")
    for n in names:
        if not (workers[n] > 0 and math.isfinite(workers[n])):
            raise ValueError(f"worker {n}: weight {workers[n]} must be a positive number")
    owner = np.full((n_rows, n_experts), -1, np.int32)
    for l in sparse_rows:
        for e in range(n_experts):
            owner[l, e] = max(range(len(names)),
                              key=lambda i: workers[names[i]] / -math.log(_unit_hash(l, e, names[i])))
    return owner


def owned_by(owner: np.ndarray, w: int) -> Dict[int, List[int]]:
    """{layer: [expert ids]} that worker index w holds."""
    return {int(l): [int(e) for e in np.flatnonzero(owner[l] == w)] for l in range(owner.shape[0])
            if np.any(owner[l] == w)}


def token_bytes(D: int, topk: int, n_workers: int, n_moe_layers: int) -> float:
    """Bytes on the wire per decoded token (one row, no drafts), routing spread evenly: per MoE
    layer each involved worker (n·(1 − (1 − 1/n)^topk) of them on average) gets a header, the
    call's ints and the row (4·D), and the top-k outputs come back (topk·4·D, plus a float each)."""
    involved = n_workers * (1 - (1 - 1 / n_workers) ** topk)
    per_layer = involved * (8 * HEADER + 4 * (2 * topk + 1) + 4 * D + 4) + topk * 4 * D
    return per_layer * n_moe_layers
