#!/usr/bin/env python3
"""colibri benchmark: colibri vs HF transformers vs llama.cpp on the medium fixture, in one run.

Everything in the report is measured in the same invocation on the same machine:

1. colibri through its CLI: the int4 container (int4 experts and dense weights, int8
   embedding/lm_head) with every routed expert cached (``--cache-experts 0``) and with 4 experts
   per layer cached (``--cache-experts 4``) over the page cache and with O_DIRECT; the int8
   container (``--expert-bits 8 --dense-bits 8 --io-bits 8``) all cached; both all cached also at
   ``--idot 1`` (Q8 activations without the residual of the default ``--idot 2``).  Each
   measurement is a fresh process, one warm-up process first, median of ``--runs``;
   ``--skip-int8`` and ``--skip-idot1`` leave those rows (and their engine-only rounds) out.
2. HF transformers ``GlmMoeDsaForCausalLM`` (eager attention) in bf16 and f32, each dtype in its
   own subprocess (warm-up + ``--runs`` repetitions in it).
3. llama.cpp through ``llama-cpp-python``: the f32 fixture (indexer padded to head dim 64) is
   converted by llama.cpp's own ``convert_hf_to_gguf.py`` to an f32 GGUF, then quantized to
   Q4_0 and Q8_0; each file is measured in its own subprocess.  Any step that fails is reported
   in its table row (the error's last line) and the bench goes on.
3b. llama.cpp's engine-only figure: ``llama-bench`` built with cmake (``-DGGML_NATIVE=ON``,
   target llama-bench only) from the same vendored llama.cpp tree into ``--work``, reused while
   that tree is unchanged.  Engine-only rounds (``--runs`` of them) interleave it with colibri:
   each round runs each colibri variant (int4 and int8, --idot 2 and 1) with every expert cached
   (the bench prompt; a 512-token prompt) and ``llama-bench -m GGUF -t THREADS -p 32,512 -n 64 -r 1
   -o json`` on each GGUF, the order reversed every other round; pp32, pp512, tg64 are avg ±
   stddev over the rounds (llama-bench's statistics), with each colibri variant ÷ llama-bench on
   its peer quantization (int4 ÷ Q4_0, int8 ÷ Q8_0) of the averages and within each round.  On a CPU with AMX (/proc/cpuinfo flags amx_*), llama.cpp's AMX buffers make Q4_0/Q8_0
   context creation abort (``GGML_ASSERT(*cur_backend_id != -1)``): llama-bench is then built with
   AMX compiled out (``-mno-amx-*``: ggml's GGML_AMX_* options do nothing under GGML_NATIVE), or
   run with ``--repack 0`` if the built library still has AMX kernels, and llama-cpp-python loads
   with ``use_extra_bufts=False``; the report says which.  ``--long-prompt`` sets the 512.
4. Weight bytes touched per decoded token by colibri (from each container's tensor sizes), the
   achieved GB/s and the machine's memory bandwidth: streaming read (numpy add.reduce of a 1 GiB
   array on uint64 and float64 views, each of 2 threads one half, best of 5, read bytes counted,
   with the same reduction on cache-resident data as a check that it runs at memory speed) and
   copy (numpy copy, read + write bytes counted).
5. A verdict table: issue 12's "what must hold" lines with this run's figures and ratios (int4 ÷
   Q4_0 and int8 ÷ Q8_0 engine-only, int4 weight GB/s ÷ streaming read, page cache ÷ all cached,
   O_DIRECT ÷ fio, peak RSS ÷ RAM budget per configuration, --idot 2 ÷ --idot 1).

Definitions (the same for every engine):
    prefill tok/s = prompt tokens / wall time of the prompt forward
    decode tok/s  = decode forwards / their wall time: the forwards after the prompt, one new
                    token each (64 tokens = 1 prefill + 63 decode forwards for colibri and HF;
                    llama.cpp's loop runs 64 single-token evals)

Measurements on a shared machine: before each measured run the bench waits (``--quiet-wait``)
until other processes use < 25 % of the CPUs, and a run during which they took >= 15 % anyway
is discarded and retried (``--retries`` extra runs per configuration); the report says how many
runs were discarded and which figures, if any, come from disturbed runs.

Setup (the llama.cpp rows; without it they show the failure and the rest still runs)::

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python gguf   # compiles llama.cpp

The converter ships in the llama-cpp-python sdist (vendor/llama.cpp/convert_hf_to_gguf.py);
the bench fetches that sdist with ``pip download`` into ``--work`` the first time.  Building
llama-bench from it needs cmake and a C++ compiler (``--skip-llama-bench`` leaves it out).

Usage::

    python tools/make_bench_model.py --out /tmp/bench_model      # optional: --model builds it
    python tools/bench.py --model /tmp/bench_model --runs 3 --json /tmp/bench.json
    python tools/bench.py --model /tmp/bench_model --skip-hf --skip-draft    # colibri vs llama.cpp

``--model`` is the f32 fixture (built with tools/make_bench_model.py when missing); converted
files go to ``--work`` (default /tmp/colibri_bench) and are reused while newer than the fixture.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

LLAMA_INDEXER_HEAD_DIM = 64      # llama.cpp's glm-dsa indexer needs index_head_dim >= 64
WORKER_MARK = "BENCH_RESULT_JSON:"


# ---------------------------------------------------------------------------------------------
# small helpers


def log(*a):
    print("[bench]", *a, file=sys.stderr, flush=True)


def bench_prompt(n: int, vocab: int) -> List[int]:
    """The fixed benchmark prompt: ids (i*37 + 11) mod vocab."""
    return [(i * 37 + 11) % vocab for i in range(n)]


def median(xs: Sequence[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def last_error_line(text: str) -> str:
    """The most telling line of a failed step's output.

    A llama.cpp log line saying why loading failed (or a GGML assertion) beats Python's generic
    closing exception; otherwise the last non-empty line.
    """
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    if not lines:
        return "failed without output"
    for ln in reversed(lines):
        if ("error loading model" in ln or "GGML_ASSERT" in ln or "unknown model architecture" in ln
                or "llama_model_load:" in ln and "error" in ln.lower()):
            return ln
    return lines[-1]


def _short(s: str, n: int = 160) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def _newer(path: str, than: str) -> bool:
    return os.path.exists(path) and os.path.getmtime(path) >= os.path.getmtime(than)


def _run(cmd, env=None, timeout=None, what="step"):
    """subprocess.run with captured text output; never raises for a non-zero exit."""
    log(what + ": " + " ".join(str(c) for c in cmd))
    t = time.perf_counter()
    try:
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        r = subprocess.CompletedProcess(cmd, 124, out, err + f"\ntimed out after {timeout} s")
    log(f"  -> exit {r.returncode} in {time.perf_counter() - t:.1f} s")
    return r


def worker_result(proc) -> dict:
    """The JSON a worker subprocess printed after WORKER_MARK, or an error record."""
    for ln in reversed((proc.stdout or "").splitlines()):
        if ln.startswith(WORKER_MARK):
            return json.loads(ln[len(WORKER_MARK):])
    return {"error": last_error_line((proc.stderr or "") + "\n" + (proc.stdout or ""))
            + f" (exit {proc.returncode})"}


def emit_worker_result(d: dict) -> None:
    sys.stdout.write(WORKER_MARK + json.dumps(d) + "\n")
    sys.stdout.flush()


def peak_rss_self() -> int:
    """Peak RSS of this process: VmHWM (the high-water mark of this process's own memory map;
    ru_maxrss would also count the parent's footprint inherited through fork/exec)."""
    try:
        with open("/proc/self/status") as f:
            for ln in f:
                if ln.startswith("VmHWM:"):
                    return int(ln.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _cpu_times():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return sum(v[:8]), idle


def busy_fraction(seconds: float = 1.0) -> Optional[float]:
    """Share of all CPUs busy during ``seconds`` (this process sleeps meanwhile, so it is the
    load of everything else); None where /proc/stat is not readable."""
    try:
        t0, i0 = _cpu_times()
        time.sleep(seconds)
        t1, i1 = _cpu_times()
    except (OSError, ValueError, IndexError):
        return None
    return (t1 - t0 - (i1 - i0)) / max(t1 - t0, 1)


class OtherLoad:
    """Context manager: the share of all CPUs that OTHER processes used while it was open.

    CPU time of the whole machine (/proc/stat) minus this process's own (``who='self'``, all
    threads) or its waited-for children's (``who='children'``), over wall time x CPUs.  A run
    during which other processes took a noticeable share is "disturbed": on 2 shared cores an
    OpenMP engine then slows down far more than the share suggests (a descheduled thread stalls
    every barrier), so such runs are retried (see ``collect``).
    """

    def __init__(self, who: str = "self"):
        import resource
        self._res = resource
        self._who = resource.RUSAGE_CHILDREN if who == "children" else resource.RUSAGE_SELF
        self.fraction: Optional[float] = None

    def _own(self) -> float:
        r = self._res.getrusage(self._who)
        return r.ru_utime + r.ru_stime

    def __enter__(self):
        try:
            self._t0 = _cpu_times()
        except (OSError, ValueError, IndexError):
            self._t0 = None
        self._o0, self._w0 = self._own(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self._w0
        if self._t0 is None or wall <= 0:
            return False
        try:
            t1 = _cpu_times()
        except (OSError, ValueError, IndexError):
            return False
        hz = os.sysconf("SC_CLK_TCK")
        busy = ((t1[0] - self._t0[0]) - (t1[1] - self._t0[1])) / hz
        others = max(busy - (self._own() - self._o0), 0.0)
        self.fraction = round(others / (wall * (os.cpu_count() or 1)), 3)
        return False


#: A run during which other processes used at least this share of the CPUs is retried.
DISTURBED = 0.15


def collect(measure, runs: int, retries: int, quiet_wait: float, who: str = "self") -> dict:
    """Call ``measure(i)`` (i = 0 is the warm-up) until ``runs`` undisturbed samples exist or
    ``runs + retries`` measured attempts were made.  Before each measured attempt, wait (up to
    ``quiet_wait`` s) for a quiet machine.  Returns {'samples', 'disturbed', 'others', 'gates',
    'clean'}: the samples kept are the undisturbed ones, or all of them when none was."""
    measure(0)
    clean, dirty, others, gates = [], [], [], []
    attempts = 0
    while len(clean) < runs and attempts < runs + retries:
        attempts += 1
        if quiet_wait > 0:
            gates.append(wait_quiet(quiet_wait))
        with OtherLoad(who) as ol:
            sample = measure(attempts)
        if sample is None:
            break
        others.append(ol.fraction)
        (dirty if ol.fraction is not None and ol.fraction >= DISTURBED else clean).append(sample)
    return {"samples": clean if clean else dirty, "clean": bool(clean), "disturbed": len(dirty),
            "others": others, "gates": gates}


def wait_quiet(max_wait: float, threshold: float = 0.25) -> dict:
    """Wait (up to ``max_wait`` seconds) until the other processes on the machine use less than
    ``threshold`` of the CPUs, so that a measurement does not start while the machine is shared
    with a build or a test run.  Returns {'waited_s', 'busy', 'quiet'}."""
    t = time.perf_counter()
    time.sleep(0.3)  # let this process's own worker threads stop spinning
    busy = busy_fraction()
    while busy is not None and busy >= threshold and time.perf_counter() - t < max_wait:
        time.sleep(2.0)
        busy = busy_fraction()
    return {"waited_s": round(time.perf_counter() - t, 1), "busy": None if busy is None else round(busy, 3),
            "quiet": busy is None or busy < threshold}


# ---------------------------------------------------------------------------------------------
# machine


def cpu_flags(cpuinfo_text: Optional[str] = None) -> List[str]:
    """The CPU feature flags of the first processor in /proc/cpuinfo (or in ``cpuinfo_text``):
    the words after 'flags :' ([] where there is no such line, e.g. not Linux x86)."""
    if cpuinfo_text is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo_text = f.read()
        except OSError:
            return []
    for ln in cpuinfo_text.splitlines():
        k, _, v = ln.partition(":")
        if k.strip() == "flags":
            return v.split()
    return []


def amx_flags(flags: Sequence[str]) -> List[str]:
    """The Intel AMX features among CPU flags: amx_tile, amx_int8, amx_bf16 (amx_fp16, ...)."""
    return sorted(f for f in flags if f.startswith("amx"))


def machine_info() -> dict:
    model, physical = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            phys = core = None
            for ln in f:
                k, _, v = ln.partition(":")
                k, v = k.strip(), v.strip()
                if k == "model name" and model is None:
                    model = v
                elif k == "physical id":
                    phys = v
                elif k == "core id":
                    core = v
                elif not k and phys is not None and core is not None:
                    physical.add((phys, core))
                    phys = core = None
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            for ln in f:
                if ln.startswith("MemTotal:"):
                    mem = int(ln.split()[1]) * 1024
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        usable = os.cpu_count()
    return {
        "cpu": model or platform.processor() or "unknown",
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "physical_cores": len(physical) or None,
        "mem_total_bytes": mem,
        "amx": amx_flags(cpu_flags()),
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def _best_seconds(fn, parts, pool, repeats: int) -> float:
    """Best wall time of ``repeats`` passes of ``fn`` over ``parts``, one part per pool thread."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        list(pool.map(fn, parts))
        best = min(best, time.perf_counter() - t)
    return best


#: The read-only passes of the streaming-read measurement: numpy reductions (no store stream,
#: the GIL released inside the reduction loop).  uint64 add is a plain vectorized integer sum;
#: float64 add is numpy's pairwise sum, more work per byte (a cross-check: if the two differ
#: much, the faster one is the memory figure).
READ_PASSES = (("uint64 add.reduce", "uint64"), ("float64 add.reduce", "float64"))

#: Bytes per thread of the cache-resident control pass (fits any L2): the same reduction on data
#: that stays in L2 shows how fast the reduction itself can go.
IN_CACHE_BYTES = 512 << 10

#: The reduction counts as memory-bound (its 1-GiB figure is the memory's, not the loop's) when
#: it runs at least this much faster on cache-resident data.
MEMORY_BOUND = 1.25


def measure_read_bandwidth(buf, repeats: int = 5) -> dict:
    """Streaming-read bandwidth: each READ_PASSES reduction over ``buf`` (a float64 array, its
    pages faulted in) with 1 thread and with 2 threads (one half each), read bytes counted, best
    of ``repeats``; and over an IN_CACHE_BYTES slice per thread repeated to the same byte count.
    The reduction is memory-bound when its in-cache rate is well above its 1-GiB rate.
    ``gbs`` is the best 2-thread figure over the passes, ``method`` the pass that gave it."""
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor

    methods = OrderedDict()
    with ThreadPoolExecutor(1) as one, ThreadPoolExecutor(2) as two:
        for name, dtype in READ_PASSES:
            v = buf.view(dtype)                                  # [n] same bytes, another dtype
            half = v.size // 2
            t1 = _best_seconds(np.add.reduce, [v], one, repeats)
            t2 = _best_seconds(np.add.reduce, [v[:half], v[half:]], two, repeats)
            small = [v[: IN_CACHE_BYTES // v.itemsize].copy() for _ in range(2)]
            reps = max(1, v.nbytes // 2 // IN_CACHE_BYTES)

            def in_cache(x, reps=reps):
                for _ in range(reps):
                    np.add.reduce(x)

            tc = _best_seconds(in_cache, small, two, max(1, repeats // 2))
            methods[name] = {"gbs_1thread": v.nbytes / t1 / 1e9, "gbs_2threads": v.nbytes / t2 / 1e9,
                             "in_cache_gbs_2threads": 2 * reps * IN_CACHE_BYTES / tc / 1e9}
    best = max(methods, key=lambda k: methods[k]["gbs_2threads"])
    return {"array_bytes": int(buf.nbytes), "repeats": repeats, "methods": methods, "method": best,
            "gbs": methods[best]["gbs_2threads"],
            "memory_bound": methods[best]["in_cache_gbs_2threads"] >= MEMORY_BOUND * methods[best]["gbs_2threads"]}


def measure_read_2threads(nbytes: int = 1 << 30, repeats: int = 3) -> dict:
    """The engine-only rounds' streaming-read probe: READ_PASSES' reductions over a ``nbytes``
    array (its pages faulted in), two threads (one half each), read bytes counted, best of
    ``repeats``; ``gbs``: the faster pass."""
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor

    buf = np.ones(nbytes // 8, dtype=np.float64)
    passes = OrderedDict()
    with ThreadPoolExecutor(2) as two:
        for name, dtype in READ_PASSES:
            v = buf.view(dtype)
            half = v.size // 2
            passes[name] = v.nbytes / _best_seconds(np.add.reduce, [v[:half], v[half:]], two, repeats) / 1e9
    return {"gbs": max(passes.values()), "passes": passes}


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Memory bandwidth of a ``nbytes`` array: numpy copies (read + write bytes counted) and
    read-only reductions (``read``: see measure_read_bandwidth).

    Best of ``repeats``, with one thread and with two threads (each on one half; numpy releases
    the GIL for the copy and the reduction).  ``gbs`` (copy) is the larger of the two.
    """
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor

    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault every page in before timing
    half = src.size // 2
    with ThreadPoolExecutor(1) as one, ThreadPoolExecutor(2) as two:
        best1 = _best_seconds(lambda p: np.copyto(p[0], p[1]), [(dst, src)], one, repeats)
        best2 = _best_seconds(lambda p: np.copyto(p[0], p[1]),
                              [(dst[:half], src[:half]), (dst[half:], src[half:])], two, repeats)
    del dst
    moved = 2 * src.nbytes
    g1, g2 = moved / best1 / 1e9, moved / best2 / 1e9
    return {"array_bytes": int(src.nbytes), "repeats": repeats, "gbs_1thread": g1, "gbs_2threads": g2,
            "gbs": max(g1, g2), "read": measure_read_bandwidth(src, repeats)}


# ---------------------------------------------------------------------------------------------
# weight bytes per decoded token (colibri)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")

#: Component labels, in report order.
COMPONENTS = ("embedding row", "attention", "indexer keys", "indexer queries", "norms",
              "dense MLP", "router", "shared experts", "routed experts (top-k)", "final norm", "lm_head")


def weight_bytes_per_token(container_dir: str, ctx_len: int = 0) -> dict:
    """Weight bytes one decode forward of colibri reads, from the container's tensor sizes.

    Counted: one embedding row; every attention matrix (q_a, q_b, kv_a, kv_b, o) and norm; the
    indexer's key path (wk + k_norm, run on every token of a "full" indexer layer); the dense MLPs;
    the router, the shared experts and the top-k routed experts of each MoE layer (k times the
    layer's mean expert size); the final norm and the whole lm_head (one row of activations
    times every vocabulary row).  The indexer's query side (wq_b, weights_proj) runs only once
    the context exceeds ``index_topk``, so it counts only when ``ctx_len`` > index_topk.  Layers
    past ``num_hidden_layers`` (MTP) are not used by decoding and are left out.
    Payload and per-row scale (``.qs``) bytes both count.
    """
    from colibri.st import SafeTensorsDir

    with open(os.path.join(container_dir, "config.json")) as f:
        cfg = json.load(f)
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    n_layers = int(cfg["num_hidden_layers"])
    vocab = int(cfg["vocab_size"])
    topk = int(cfg.get("num_experts_per_tok") or 0)
    index_topk = int(cfg.get("index_topk") or 0)
    itypes = cfg.get("indexer_types") or ["full"] * n_layers
    comp: Dict[str, int] = OrderedDict((k, 0) for k in COMPONENTS)
    experts: Dict[int, Dict[int, int]] = {}
    skipped = 0
    with SafeTensorsDir(container_dir) as st:
        for name in st.names():
            nb = st.info(name).nbytes
            base = name[:-3] if name.endswith(".qs") else name
            if base == "model.embed_tokens.weight":
                comp["embedding row"] += nb / vocab
                continue
            if base == "lm_head.weight":
                comp["lm_head"] += nb
                continue
            if base == "model.norm.weight":
                comp["final norm"] += nb
                continue
            m = _LAYER.match(base)
            if not m:
                skipped += nb
                continue
            layer, rest = int(m.group(1)), m.group(2)
            if layer >= n_layers:
                skipped += nb
                continue
            em = _EXPERT.match(rest)
            if em:
                per = experts.setdefault(layer, {})
                per[int(em.group(1))] = per.get(int(em.group(1)), 0) + nb
            elif rest.startswith("self_attn.indexer."):
                full = layer >= len(itypes) or itypes[layer] == "full"
                if not full:
                    continue
                if rest.startswith("self_attn.indexer.wk.") or rest.startswith("self_attn.indexer.k_norm."):
                    comp["indexer keys"] += nb
                elif ctx_len > index_topk:
                    comp["indexer queries"] += nb
            elif rest.startswith("self_attn."):
                comp["attention"] += nb
            elif rest.startswith("mlp.shared_experts."):
                comp["shared experts"] += nb
            elif rest.startswith("mlp.gate.") or rest.endswith("e_score_correction_bias"):
                comp["router"] += nb
            elif rest.startswith("mlp."):
                comp["dense MLP"] += nb
            elif "norm" in rest:
                comp["norms"] += nb
            else:
                skipped += nb
    routed = 0.0
    expert_mean = {}
    for layer, per in sorted(experts.items()):
        mean = sum(per.values()) / len(per)
        expert_mean[layer] = mean
        routed += min(topk, len(per)) * mean
    comp["routed experts (top-k)"] = routed
    comp = OrderedDict((k, int(round(v))) for k, v in comp.items())
    total = sum(comp.values())
    return {
        "components": comp,
        "total": total,
        "moe_layers": len(experts),
        "experts_per_token": topk,
        "expert_bytes_mean": (sum(expert_mean.values()) / len(expert_mean)) if expert_mean else 0,
        "container_bytes": int(sum(os.path.getsize(p) for p in st.paths)),
        "unused_bytes": int(skipped),
        "ctx_len": ctx_len,
    }


# ---------------------------------------------------------------------------------------------
# table formatting


def fmt_num(x, nd: int = 1) -> str:
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{nd}f}"


def fmt_bytes(n) -> str:
    if n is None:
        return "–"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def fmt_ratio(a, b) -> str:
    if a is None or b is None or not b:
        return "–"
    return f"{a / b:.2f}×"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A GitHub markdown table; numeric-looking columns are right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    num = re.compile(r"^[-+]?[\d,]*\.?\d+(\s*[×%]|\s*[KMG]?B)?$|^–$")
    align = []
    for j in range(len(headers)):
        col = [r[j] for r in cells if j < len(r)]
        align.append("---:" if col and all(num.match(c) for c in col) else ":---")
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    for r in cells:
        r = list(r) + [""] * (len(headers) - len(r))
        out.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in r) + " |")
    return "\n".join(out)


def _prefix(r: dict) -> str:
    """'N/M': the first N of M greedy tokens equal HF f32's (quantization may flip a near-tied
    argmax of this random model early; after that the continuations differ)."""
    n = r.get("greedy_prefix_vs_hf_f32")
    if n is None or not r.get("tokens"):
        return "–"
    return f"{n}/{len(r['tokens'])}"


def _avg_sd(t: Optional[dict]) -> str:
    return "–" if not t else f"{fmt_num(t['avg_ts'])} ± {fmt_num(t['stddev_ts'])}"


def colibri_ref(rows: List[dict], r: dict) -> Optional[dict]:
    """The colibri row a peer row ``r`` of the main table is set against: colibri's all-cached
    --idot 2 row of the container whose peer quantization ``r`` is (int8 for Q8_0), else the
    reference row (int4); None when that row failed or there is none."""
    same = next((x for x in rows if x.get("engine") == "colibri" and x.get("cached") == "all"
                 and x.get("idot", 2) == 2 and x.get("peer") == r.get("weights")), None)
    mine = same or next((x for x in rows if x.get("ref")), None)
    return None if mine is None or mine.get("error") else mine


def _x(v: Optional[float]) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _round_keys(res: dict) -> List[str]:
    """The engine-only tests: ppP (the bench's prompt), ppL (the long prompt), tgN."""
    p = res.get("params", {})
    P, L, N = p.get("prompt_len"), p.get("long_prompt") or 0, p.get("tokens")
    return [f"pp{P}"] + ([f"pp{L}"] if L and L != P else []) + [f"tg{N}"]


def idot_costs(variants: Dict[str, dict], keys: Sequence[str]) -> List[str]:
    """'int4 (io int8): pp32 0.97×, ...' per container measured at both --idot 2 and --idot 1:
    --idot 2 ÷ --idot 1 of the engine-only averages (< 1 = what exactness costs)."""
    out = []
    for c in variants.values():
        if c.get("idot") != 2:
            continue
        one = next((o for o in variants.values() if o.get("container") == c.get("container") and o.get("idot") == 1),
                   None)
        if one is None:
            continue
        got = [(k, (c["tests"].get(k) or {}).get("avg_ts"), (one["tests"].get(k) or {}).get("avg_ts")) for k in keys]
        got = [f"{k} {fmt_ratio(a, b)}" for k, a, b in got if a and b]
        if got:
            out.append(f"{c['weights']}: " + ", ".join(got))
    return out


def engine_only_table(res: dict) -> List[str]:
    """Report lines: colibri (all experts cached; one row per variant: int4 and int8 at --idot 2
    and --idot 1) and llama-bench, llama.cpp without Python, from the interleaved engine-only
    rounds: ppP (the bench's prompt), ppL (the long prompt) and tgN, avg ± stddev over the
    rounds; each colibri row ÷ the llama-bench row of its peer quantization (Q4_0 for int4, Q8_0
    for int8) of the averages and, per round, its range; --idot 2 ÷ --idot 1.  [] when the run
    has neither llama-bench rows nor rounds."""
    rows = res.get("rows", [])
    lbs = [r for r in rows if r.get("engine") == LB]
    rounds = res.get("engine_rounds") or {}
    if not lbs and not rounds:
        return []
    L = res.get("params", {}).get("long_prompt") or 0
    keys = _round_keys(res)
    variants = rounds.get("colibri") or {}
    headers = (["engine", "weights"] + [f"{k} tok/s" for k in keys] + ["peer"] + [f"colibri ÷ peer {k}" for k in keys]
               + ["note"])
    body, ranges = [], []
    for c in variants.values():
        tests, ratios = c.get("tests") or {}, c.get("ratios") or {}
        note = ("; ".join(f"FAILED: {_short(e)}" for e in c.get("errors") or [])
                or ("--idot 2 (the default)" if c.get("idot") == 2 else f"--idot {c.get('idot')}"))
        body.append(["colibri", f"{c['weights']}, all experts cached"] + [_avg_sd(tests.get(k)) for k in keys]
                    + [f"llama-bench {c['peer']}" if ratios else "–"] + [_x(ratios.get(k)) for k in keys] + [note])
        rr = c.get("round_ratios") or {}
        if any(rr.values()):
            ranges.append(f"{c['weights']} ÷ {c['peer']}: " + ", ".join(
                f"{k} {min(rr[k]):.2f}–{max(rr[k]):.2f}×" for k in keys if rr.get(k)))
    for r in lbs:
        if r.get("error"):
            body.append([r["engine"], r.get("weights", "")] + ["–"] * (2 * len(keys) + 1) + ["FAILED: " + _short(r["error"])])
            continue
        tests = r["llama_bench"]["tests"]
        body.append([r["engine"], r.get("weights", "")] + [_avg_sd(tests.get(k)) for k in keys] + ["–"] * (len(keys) + 1)
                    + [((res.get("llama") or {}).get("amx_note") or "")])
    n = rounds.get("rounds_kept", 0)
    out = ["", f"Engine only: colibri (all experts cached) and llama-bench (llama.cpp's own benchmark, no Python), "
               f"measured in the same {n} interleaved round{'' if n == 1 else 's'}; tok/s, avg ± stddev over the rounds"
               + (f" (pp{L} = a {L}-token prompt)" if L else "") + "; each colibri row ÷ llama-bench on its peer "
               "quantization (int4 ÷ Q4_0, int8 ÷ Q8_0), ratios of the averages, > 1 = colibri faster:", "",
           markdown_table(headers, body)]
    if ranges:
        out += ["", "colibri ÷ its peer within each round (min – max): " + "; ".join(ranges) + "."]
    costs = idot_costs(variants, keys)
    if costs:
        out += ["", "--idot 2 (the default: integer dots on Q8 activations + their Q8 residual, near-float "
                    "accuracy) ÷ --idot 1 (Q8 activations only), the averages above (< 1 = what the residual "
                    "costs): " + "; ".join(costs) + "."]
    return out


def _bpts(res: dict) -> Dict[str, dict]:
    """container -> its weight bytes per token, for the containers the run measured."""
    return OrderedDict((c, res[bpt_key(c)]) for c in CONTAINERS if res.get(bpt_key(c)))


def weight_gbs(res: dict, r: dict) -> Optional[float]:
    """Weight GB/s of colibri row ``r``: its container's bytes per token × its decode tok/s."""
    bpt = _bpts(res).get(r.get("container", "int4"))
    if not bpt or r.get("error") or not r.get("decode_tok_s"):
        return None
    return bpt["total"] * r["decode_tok_s"] / 1e9


def _pct(a: Optional[float], b: Optional[float]) -> str:
    return "–" if a is None or not b else f"{100 * a / b:.1f}%"


def read_method_text(read: dict) -> str:
    """How the streaming-read figure was measured, and each pass's figures."""
    parts = [f"{name}: {m['gbs_1thread']:.2f} GB/s with 1 thread, {m['gbs_2threads']:.2f} with 2, "
             f"{m['in_cache_gbs_2threads']:.2f} on {IN_CACHE_BYTES >> 10} KiB per thread in cache"
             for name, m in read["methods"].items()]
    best = read["methods"][read["method"]]
    bound = (f"the reduction runs {best['in_cache_gbs_2threads'] / best['gbs_2threads']:.1f}× faster in cache, so "
             f"the {read['array_bytes'] / 2**30:.0f}-GiB figure is the memory's" if read.get("memory_bound") else
             "the reduction runs barely faster in cache: the figure may be the loop's limit, a lower bound of the "
             "memory's")
    return (f"Streaming read (read bytes only, numpy reductions over a {read['array_bytes'] / 2**30:.0f}-GiB array, "
            f"each thread one half, best of {read['repeats']}): " + "; ".join(parts)
            + f". The read bandwidth is {read['method']}'s 2-thread figure; {bound}.")


def weight_bytes_tables(res: dict) -> List[str]:
    """Report lines: the weight bytes a decoded token reads (per component, per container) and
    each colibri row's weight GB/s against the machine's streaming-read and copy bandwidths."""
    bpts = _bpts(res)
    if not bpts:
        return []
    rows = res.get("rows", [])
    bw = res.get("bandwidth") or {}
    read = bw.get("read") or {}
    labels = [CONTAINERS[c]["label"] for c in bpts]
    out = ["", "Weight bytes read per decoded token (colibri's containers: " + ", ".join(labels) + "):", ""]
    comp_rows = [[k] + [fmt_bytes(b["components"].get(k)) for b in bpts.values()]
                 for k in COMPONENTS if any(b["components"].get(k) for b in bpts.values())]
    comp_rows.append(["**total**"] + ["**" + fmt_bytes(b["total"]) + "**" for b in bpts.values()])
    out.append(markdown_table(["component"] + [f"{lb} bytes / token" for lb in labels], comp_rows))
    out.append("")
    bw_rows = []
    for r in rows:
        gbs = weight_gbs(res, r) if r.get("engine") == "colibri" else None
        if gbs is None:
            continue
        bw_rows.append([f"colibri {r.get('weights')}, {r.get('cached')} experts cached", fmt_num(r["decode_tok_s"], 2),
                        fmt_num(gbs, 2), _pct(gbs, read.get("gbs")), _pct(gbs, bw.get("gbs")),
                        fmt_bytes(r.get("expert_load_bytes_per_token"))])
    if read.get("gbs"):
        bw_rows.append([f"streaming read ({read['method']} of {read['array_bytes'] / 2**30:.0f} GiB, 2 threads, "
                        f"best of {read['repeats']})", "–", fmt_num(read["gbs"], 2), "100%",
                        _pct(read["gbs"], bw.get("gbs")), "–"])
    if bw.get("gbs"):
        bw_rows.append([f"copy (numpy copy of {bw.get('array_bytes', 1 << 30) / 2**30:.0f} GiB, read+write, best of "
                        f"{bw.get('repeats', 5)})", "–", fmt_num(bw["gbs"], 2), _pct(bw["gbs"], read.get("gbs")),
                        "100%", "–"])
    out.append(markdown_table(["", "decode tok/s", "weight GB/s", "% of streaming read", "% of copy",
                               "expert bytes loaded / token"], bw_rows))
    if bw.get("gbs"):
        out += ["", f"numpy copy: {bw['gbs_1thread']:.2f} GB/s with 1 thread, {bw['gbs_2threads']:.2f} GB/s with 2 "
                    "threads (read + write bytes counted)."]
    if read.get("methods"):
        out += ["", read_method_text(read)]
    return out


#: Issue 12's "what must hold" bars, judged from one run.
INT4_OVER_Q4_0 = 1.2      # colibri int4 all cached ÷ llama-bench Q4_0 (tgN, engine-only rounds)
READ_SHARE = 0.60         # int4 all-cached weight bytes/s ÷ the 2-thread streaming-read bandwidth
INT8_OVER_Q8_0 = 1.2      # colibri int8 all cached ÷ llama-bench Q8_0 (tgN, engine-only rounds)
PAGED_OVER_ALL = 0.8      # 4 experts/layer from the page cache ÷ all cached (colibri decode)
DIRECT_OVER_FIO = 0.85    # colibri's O_DIRECT read GB/s ÷ fio's best on the same file
#: Issue 14's prefill bars: colibri int4 all cached ÷ llama-bench Q4_0 (engine-only rounds), with
#: the AMX GEMM and, on an AMX CPU, with it off (the AVX-512 VNNI tiles).
INT4_OVER_Q4_0_PP_SHORT = 1.2   # the short prompt (pp32)
INT4_OVER_Q4_0_PP_LONG = 1.5    # the long prompt (pp512)


def _line(must: str, measured: Optional[str], ratio: Optional[float], target: str, ok) -> dict:
    """One verdict row; ``measured`` None = not measured in this run (holds None)."""
    if measured is None:
        return {"must_hold": must, "measured": "not measured in this run", "ratio": None, "target": target,
                "holds": None}
    return {"must_hold": must, "measured": measured, "ratio": ratio, "target": target,
            "holds": None if ratio is None or ok is None else bool(ok(ratio))}


def _vs_peer_line(res: dict, name: str, target: float, key: Optional[str] = None) -> dict:
    """colibri variant ``name`` ÷ llama-bench on its peer quantization, ``key`` (default tgN; ppN
    for a prefill) of the engine-only rounds (the averages; the within-round range in the text)."""
    p = res.get("params", {})
    key = key or f"tg{p.get('tokens')}"
    c = ((res.get("engine_rounds") or {}).get("colibri") or {}).get(name)
    container = name.split()[0]
    peer = CONTAINERS[container]["peer"]
    label = CONTAINERS[container]["label"] + name[len(container):].replace(" AMX off", ", AMX off,")
    must = f"{label} all cached ≥ {target:.1f}× llama-bench {peer} ({key}, engine-only rounds)"
    ratio = (c or {}).get("ratios", {}).get(key)
    if ratio is None:
        return _line(must, None, None, f"≥ {target:.2f}×", None)
    lb = next(r for r in res.get("rows", []) if r.get("engine") == LB and r.get("weights") == peer)
    rr = c["round_ratios"].get(key) or []
    n = (res.get("engine_rounds") or {}).get("rounds_kept", 0)
    text = (f"colibri {fmt_num(c['tests'][key]['avg_ts'])} tok/s, llama-bench {peer} "
            f"{fmt_num(lb['llama_bench']['tests'][key]['avg_ts'])} tok/s (avg of {n} round{'' if n == 1 else 's'}"
            + (f"; within a round {min(rr):.2f}–{max(rr):.2f}×" if rr else "") + ")")
    return _line(must, text, ratio, f"≥ {target:.2f}×", lambda x: x >= target)


def _read_share_line(res: dict, ref: Optional[dict]) -> dict:
    """int4 all cached: weight bytes per second ÷ the 2-thread streaming read. From the
    engine-only rounds when they measured the read (each round's decode ÷ the same round's read,
    the median over the rounds: the host's speed moves within minutes, so both sides are taken
    together), else from the main table and the read measured at the start."""
    must = (f"{CONTAINERS['int4']['label']} all cached ≥ {100 * READ_SHARE:.0f}% of the 2-thread streaming-read "
            "bandwidth in weight bytes per second")
    target = f"≥ {100 * READ_SHARE:.0f}%"
    bpt = (_bpts(res).get("int4") or {}).get("total")
    read0 = ((res.get("bandwidth") or {}).get("read") or {}).get("gbs")
    gbs0 = weight_gbs(res, ref) if ref is not None else None
    main = (f"main table {fmt_bytes(bpt)}/token × {fmt_num(ref['decode_tok_s'], 2)} tok/s = {gbs0:.2f} GB/s of "
            f"{read0:.2f} GB/s read at the start ({100 * gbs0 / read0:.1f}%)") if gbs0 and read0 and bpt else None
    name = next(iter(((res.get("engine_rounds") or {}).get("colibri") or {})), None)
    rounds = [(bpt * r["decode_tok_s"][name] / 1e9, r["read_gbs"])
              for r in (res.get("engine_rounds") or {}).get("read_rounds", [])
              if bpt and name and r["decode_tok_s"].get(name) and r.get("read_gbs")]
    if rounds:
        shares = [g / b for g, b in rounds]
        text = (f"{fmt_bytes(bpt)}/token × colibri's tg{res.get('params', {}).get('tokens')} ÷ the streaming read of "
                f"the same round, {len(rounds)} round{'' if len(rounds) == 1 else 's'}: "
                f"{statistics.median(g for g, _ in rounds):.2f} GB/s of {statistics.median(b for _, b in rounds):.2f} "
                f"GB/s (medians), per round {100 * min(shares):.1f}–{100 * max(shares):.1f}%"
                + (f"; {main}" if main else ""))
        line = _line(must, text, statistics.median(shares), target, lambda x: x >= READ_SHARE)
    else:
        line = _line(must, main, gbs0 / read0 if main else None, target, lambda x: x >= READ_SHARE)
    if line["ratio"] is not None:
        line["ratio_text"] = f"{100 * line['ratio']:.1f}%"
    return line


def _direct_line(res: dict, direct: Optional[dict]) -> dict:
    """colibri's O_DIRECT read rate ÷ fio's best on the same file: each run against the disk
    measured right after it (the median over the runs), else against the disk measured once."""
    fio = (res.get("disk") or {}).get("best_gbs")
    tool = (res.get("disk") or {}).get("tool") or "fio"
    must = f"O_DIRECT reads ≥ {DIRECT_OVER_FIO:.2f}× {tool}'s best on the same file"
    target = f"≥ {DIRECT_OVER_FIO:.2f}×"
    holds = lambda x: x >= DIRECT_OVER_FIO  # noqa: E731
    if direct is None or direct.get("error") or not direct.get("read_gb_s"):
        return _line(must, None, None, target, None)
    pairs = direct.get("disk_pairs") or []
    if pairs:
        ratios = [g / d for g, d in pairs]
        text = (f"{statistics.median(g for g, _ in pairs):.2f} GB/s ÷ {statistics.median(d for _, d in pairs):.2f} "
                f"GB/s (medians of {len(pairs)} runs, each ÷ the disk measured right after it: per run "
                f"{min(ratios):.2f}–{max(ratios):.2f}×)")
        return _line(must, text, statistics.median(ratios), target, holds)
    if not fio:
        return _line(must, None, None, target, None)
    return _line(must, f"{direct['read_gb_s']:.2f} GB/s ÷ {fio:.2f} GB/s", direct["read_gb_s"] / fio, target, holds)


def verdict_rows(res: dict) -> List[dict]:
    """Issue 12's "what must hold" lines with this run's figures: {'must_hold', 'measured',
    'ratio', 'target', 'holds' (True/False, None = not measured or no bar)}."""
    rows = res.get("rows", [])
    col = [r for r in rows if r.get("engine") == "colibri"]
    ref = next((r for r in col if r.get("ref")), None)
    ok = lambda r: r is not None and not r.get("error")  # noqa: E731
    out = [_vs_peer_line(res, "int4", INT4_OVER_Q4_0)]
    out.append(_read_share_line(res, ref if ok(ref) else None))
    out.append(_vs_peer_line(res, "int8", INT8_OVER_Q8_0))
    paged = next((r for r in col if r.get("cached") == "4 (page cache)"), None)
    must = f"4 experts/layer from the page cache ≥ {PAGED_OVER_ALL:.1f}× colibri's all-cached decode"
    both = ok(paged) and ok(ref) and paged.get("decode_tok_s") and ref.get("decode_tok_s")
    out.append(_line(must, f"{fmt_num(paged['decode_tok_s'], 2)} ÷ {fmt_num(ref['decode_tok_s'], 2)} tok/s "
                     "(int4, main table)" if both else None,
                     paged["decode_tok_s"] / ref["decode_tok_s"] if both else None,
                     f"≥ {PAGED_OVER_ALL:.2f}×", lambda x: x >= PAGED_OVER_ALL))
    out.append(_direct_line(res, next((r for r in col if "O_DIRECT" in str(r.get("cached"))), None)))
    P, L = res.get("params", {}).get("prompt_len"), res.get("params", {}).get("long_prompt")
    for name in ["int4"] + [n for n in ((res.get("engine_rounds") or {}).get("colibri") or {}) if n.endswith("AMX off")]:
        out.append(_vs_peer_line(res, name, INT4_OVER_Q4_0_PP_SHORT, f"pp{P}"))
        if L:
            out.append(_vs_peer_line(res, name, INT4_OVER_Q4_0_PP_LONG, f"pp{L}"))
    configs = [(f"colibri {r.get('weights')}, {r.get('cached')} cached", r) for r in col if ok(r)]
    configs += [(f"colibri {c['weights']}, engine-only rounds", c)
                for c in ((res.get("engine_rounds") or {}).get("colibri") or {}).values()]
    for label, r in configs:
        rss, budget = r.get("peak_rss_bytes"), r.get("ram_budget_bytes")
        out.append(_line(f"peak RSS ≤ the RAM budget: {label}",
                         f"{fmt_bytes(rss)} of {fmt_bytes(budget)}" if rss and budget else None,
                         rss / budget if rss and budget else None, "≤ 100%", lambda x: x <= 1.0))
        if out[-1]["ratio"] is not None:
            out[-1]["ratio_text"] = f"{100 * out[-1]['ratio']:.1f}%"
    N = res.get("params", {}).get("tokens")
    variants = (res.get("engine_rounds") or {}).get("colibri") or {}
    for c in CONTAINERS:
        two, one = variants.get(c), variants.get(f"{c} --idot 1")
        a = ((two or {}).get("tests", {}).get(f"tg{N}") or {}).get("avg_ts")
        b = ((one or {}).get("tests", {}).get(f"tg{N}") or {}).get("avg_ts")
        out.append(_line(f"--idot 1 measured side by side: {CONTAINERS[c]['label']} --idot 2 ÷ --idot 1 (tg{N}, "
                         "engine-only rounds)", f"{fmt_num(a)} ÷ {fmt_num(b)} tok/s" if a and b else None,
                         a / b if a and b else None, "(no bar: what --idot 2 costs)", None))
    return out


def verdict_table(res: dict) -> List[str]:
    """Report lines: the verdict table (verdict_rows) at the end of the report."""
    vr = res.get("verdict") or verdict_rows(res)
    body = [[v["must_hold"], v["measured"], v.get("ratio_text") or _x(v["ratio"]), v["target"],
             "–" if v["holds"] is None else ("yes" if v["holds"] else "**no**")] for v in vr]
    return ["", "Issues 12's and 14's \"what must hold\", from this run (medians and averages as in the tables above):", "",
            markdown_table(["must hold", "measured", "ratio", "target", "holds"], body)]


def render_report(res: dict) -> str:
    """The markdown report of a bench result dictionary (see ``main`` for its fields)."""
    m = res.get("machine", {})
    p = res.get("params", {})
    rows = res.get("rows", [])
    lines = []
    lines.append(f"### colibri benchmark — {res.get('fixture', {}).get('name', 'fixture')} "
                 f"({fmt_num(res.get('fixture', {}).get('n_params_b'), 3)} B parameters)")
    lines.append("")
    cores = m.get("physical_cores")
    lines.append(f"Machine: {m.get('cpu')}, {m.get('usable_cpus')} usable CPUs"
                 + (f" ({cores} physical cores)" if cores else "")
                 + (f", {m['mem_total_bytes'] / 2**30:.0f} GiB RAM" if m.get("mem_total_bytes") else "")
                 + (("; AMX: " + " ".join(m["amx"]) if m["amx"] else "; no AMX") if "amx" in m else "")
                 + f"; {p.get('threads')} threads for every engine.")
    lines.append(f"Prompt {p.get('prompt_len')} tokens, {p.get('tokens')} tokens greedy; median of "
                 f"{p.get('runs')} runs after one warm-up. Measured {res.get('date', '')}.")
    lines.append("")
    headers = ["engine", "weights", "experts cached", "size on disk", "prefill tok/s", "decode tok/s",
               "peak RSS", "colibri ÷ peer prefill", "colibri ÷ peer decode", "greedy = HF f32", "note"]
    body = []
    used: Dict[str, List[str]] = OrderedDict()  # colibri row label -> the peers set against it
    for r in rows:
        err = r.get("error")
        mine = None if r.get("engine") == "colibri" else colibri_ref(rows, r)
        if mine is not None and not err:
            used.setdefault(f"colibri {mine.get('weights')}, {mine.get('cached')} experts cached", []).append(
                r.get("weights", ""))
        body.append([
            r.get("engine", ""), r.get("weights", ""), r.get("cached", "–"),
            fmt_bytes(r.get("size_bytes")),
            "–" if err else fmt_num(r.get("prefill_tok_s")),
            "–" if err else fmt_num(r.get("decode_tok_s"), 2),
            fmt_bytes(r.get("peak_rss_bytes")),
            "–" if err or mine is None else fmt_ratio(mine.get("prefill_tok_s"), r.get("prefill_tok_s")),
            "–" if err or mine is None else fmt_ratio(mine.get("decode_tok_s"), r.get("decode_tok_s")),
            _prefix(r),
            ("FAILED: " + _short(err)) if err else r.get("note", ""),
        ])
    lines.append(markdown_table(headers, body))
    if used:
        lines.append("")
        lines.append("Ratios: colibri ÷ peer (> 1 = colibri faster); "
                     + "; ".join(f"{', '.join(dict.fromkeys(peers))} rows against {label}"
                                 for label, peers in used.items()) + ".")
    lines.extend(engine_only_table(res))
    spread = [r for r in rows if not r.get("error") and r.get("decode_samples")]
    if spread:
        lines.append("")
        lines.append("Spread over the measured runs (min – max tok/s; a wide spread means other processes "
                     "competed for the cores during that configuration):")
        lines.append("")
        srows = []
        for r in spread:
            pf, dc = r.get("prefill_samples") or [], r.get("decode_samples") or []
            srows.append([f"{r.get('engine')} {r.get('weights')}"
                          + (f", {r.get('cached')} cached" if r.get("engine") == "colibri" else ""),
                          f"{fmt_num(min(pf))} – {fmt_num(max(pf))}" if pf else "–",
                          f"{fmt_num(min(dc), 2)} – {fmt_num(max(dc), 2)}"])
        lines.append(markdown_table(["configuration", "prefill tok/s", "decode tok/s"], srows))
    lines.extend(weight_bytes_tables(res))
    disk = res.get("disk")
    if disk and disk.get("best_gbs"):
        lines.append("")
        got = [(r.get("cached"), r.get("read_gb_s")) for r in rows
               if r.get("engine") == "colibri" and "disk" in str(r.get("cached")) and r.get("read_gb_s")]
        lines.append(f"Disk: the container's file read at random with {disk['tool']}: "
                     + ", ".join(f"{k} {v:.2f} GB/s" for k, v in disk["gbs"].items())
                     + "".join(f"; colibri with {c} cached read its experts at {g:.2f} GB/s = "
                               f"{100 * g / disk['best_gbs']:.0f}% of the disk's best" for c, g in got) + ".")
    dr = res.get("draft")
    if dr:
        lines.append("")
        lines.append("Speculation on a useless drafter (the fixture plus a random MTP head, int8; colibri int4, "
                     "all experts cached): `--draft auto` against `--draft 0`, alternating fresh processes, "
                     f"median of {dr.get('runs')} each:")
        lines.append("")
        if dr.get("error"):
            lines.append("FAILED: " + _short(dr["error"]))
        else:
            prop = sum(d["drafts_proposed"] for d in dr["detail"])
            acc = sum(d["drafts_accepted"] for d in dr["detail"])
            lines.append(markdown_table(
                ["setting", "decode tok/s", "prefill + decode wall s", "drafts proposed / accepted (all runs)"],
                [["--draft 0", fmt_num(dr["draft0_tok_s"]), f"{dr['draft0_total_s']:.3f}", "–"],
                 ["--draft auto", fmt_num(dr["auto_tok_s"]), f"{dr['auto_total_s']:.3f}", f"{prop} / {acc}"],
                 ["auto ÷ 0", f"{dr['auto_over_draft0']:.3f}", f"{dr['auto_time_over_draft0']:.3f}",
                  "within 5%: " + ("yes" if dr["within_5_percent"] else "**NO**")]]))
    notes = res.get("notes") or []
    if notes:
        lines.append("")
        for n in notes:
            lines.append(f"- {n}")
    lines.extend(verdict_table(res))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# fixture and colibri


def ensure_fixture(model_dir: str) -> dict:
    man = os.path.join(model_dir, "bench_manifest.json")
    if not (os.path.exists(man) and os.path.exists(os.path.join(model_dir, "config.json"))):
        log(f"building the fixture in {model_dir}")
        r = _run([sys.executable, os.path.join(HERE, "make_bench_model.py"), "--out", model_dir],
                 what="make_bench_model")
        if r.returncode != 0:
            raise SystemExit("bench: building the fixture failed: " + last_error_line(r.stderr))
    with open(man) as f:
        return json.load(f)


def fixture_weights(model_dir: str) -> str:
    files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise SystemExit(f"bench: no .safetensors in {model_dir}")
    return os.path.join(model_dir, files[-1])


#: colibri's containers of the fixture: name -> convert bits (experts, dense, io), the tables'
#: weights label, and the llama.cpp quantization it is set against.
CONTAINERS = OrderedDict([
    ("int4", {"bits": (4, 4, 8), "label": "int4 (io int8)", "peer": "Q4_0"}),
    ("int8", {"bits": (8, 8, 8), "label": "int8", "peer": "Q8_0"}),
])


def ensure_container(model_dir: str, dst: str, name: str) -> Optional[str]:
    """The CONTAINERS[name] container of the fixture in ``dst`` (converted when missing or older
    than the fixture); error text or None."""
    stamp = os.path.join(dst, "colibri_convert.json")
    if _newer(stamp, fixture_weights(model_dir)):
        return None
    e, d, io = CONTAINERS[name]["bits"]
    r = _run([sys.executable, "-m", "colibri", "convert", model_dir, dst,
              "--expert-bits", str(e), "--dense-bits", str(d), "--io-bits", str(io)],
             what=f"colibri convert ({name})")
    if r.returncode != 0:
        return f"colibri convert ({name}): " + last_error_line(r.stderr + r.stdout)
    return None


def colibri_variants(containers: Sequence[str], idots: Sequence[int], amx_off: Sequence[str] = ()) -> List[dict]:
    """The colibri configurations measured with every expert cached (main table and engine-only
    rounds): each container at each ``--idot`` (2 = the default, exact; 1 = plain Q8
    activations), and each container of ``amx_off`` (a CPU with AMX) at the default with the
    AMX prefill GEMM turned off (COLIBRI_AMX=0: the AVX-512 VNNI tiles).  name: 'int4',
    'int4 --idot 1', 'int4 AMX off', ...; weights: the tables' label; extra: the run options;
    env: the process's extra environment."""
    out = []
    for c in containers:
        for idot in idots:
            flag = "" if idot == 2 else f" --idot {idot}"
            out.append({"name": c + flag, "container": c, "idot": idot, "peer": CONTAINERS[c]["peer"],
                        "weights": CONTAINERS[c]["label"] + ("," + flag if flag else ""),
                        "extra": () if idot == 2 else ("--idot", str(idot)), "env": {}})
        if c in amx_off:
            out.append({"name": c + " AMX off", "container": c, "idot": 2, "peer": CONTAINERS[c]["peer"],
                        "weights": CONTAINERS[c]["label"] + ", AMX off", "extra": (),
                        "env": {"COLIBRI_AMX": "0"}})
    return out


def dir_bytes(d: str, suffix: str = ".safetensors") -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.endswith(suffix))


def colibri_once(container: str, prompt: List[int], n_tokens: int, cache: int, threads: int, work: str,
                 extra=(), what: str = "colibri", env: Optional[dict] = None) -> dict:
    """One fresh `python -m colibri run` process (``env``: extra environment); its --stats-json,
    or {'error'}."""
    stats = os.path.join(work, f"colibri_stats_{cache}_{len(prompt)}.json")
    if os.path.exists(stats):
        os.remove(stats)
    r = _run([sys.executable, "-m", "colibri", "run", "--model", container,
              "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(n_tokens),
              "--temperature", "0", "--cache-experts", str(cache), "--threads", str(threads),
              "--no-autopin", "--stats-json", stats, "--quiet", *extra],
             env=dict(os.environ, OMP_NUM_THREADS=str(threads), **(env or {})), what=what)
    if r.returncode != 0 or not os.path.exists(stats):
        return {"error": "colibri run: " + last_error_line(r.stderr + r.stdout)}
    with open(stats) as f:
        return json.load(f)


def colibri_rates(s: dict):
    """(prefill tok/s, decode tok/s or None) of one colibri --stats-json: prompt tokens / prompt
    forward time, and decode forwards (all forwards but the prompt's) / their wall time."""
    dec = max(s["forwards"] - 1, 0) / s["decode_s"] if s["decode_s"] > 0 else None
    return s["prefill_tokens"] / s["prefill_s"], dec


def run_colibri(container: str, prompt: List[int], n_tokens: int, cache: int, threads: int,
                runs: int, work: str, quiet_wait: float = 0.0, retries: int = 0, extra=(),
                disk_pair: bool = False, env: Optional[dict] = None) -> dict:
    """``disk_pair``: right after each measured run, the disk's own best rate on the container's
    file (measure_disk), kept in the sample as ``paired_disk_gbs`` — the disk's speed moves
    between minutes, so a run's read rate is judged against the disk of the same minute."""
    failure = []

    def measure(i):
        got = colibri_once(container, prompt, n_tokens, cache, threads, work, extra,
                           what=f"colibri {os.path.basename(container)} cache={cache} {' '.join(extra)} "
                                f"{'warm-up' if i == 0 else f'run {i}'}", env=env)
        if "error" in got:
            failure.append(got["error"])
            return None
        if disk_pair and i > 0:
            got["paired_disk_gbs"] = measure_disk(container, work, seconds=PAIRED_DISK_S).get("best_gbs")
        return got

    got = collect(measure, runs, retries, quiet_wait, who="children")
    if failure:
        return {"error": failure[0]}
    samples = got.pop("samples")
    out = dict(got, samples=samples)
    rates = [colibri_rates(s) for s in samples]
    out["prefill_samples"] = [p for p, _ in rates]
    out["decode_samples"] = [d for _, d in rates if d is not None]
    out["prefill_tok_s"] = median(out["prefill_samples"])
    out["decode_tok_s"] = median(out["decode_samples"])
    out["decode_tokens"] = samples[-1]["decode_tokens"]
    out["tokens"] = samples[-1]["tokens"]
    out["peak_rss_bytes"] = max(s["peak_rss_bytes"] for s in samples)
    out["ram_budget_bytes"] = min((s["ram_budget_bytes"] for s in samples if s.get("ram_budget_bytes")), default=None)
    out["resident_bytes"] = samples[-1].get("resident_bytes")
    looks = samples[-1]["expert_hits"] + samples[-1]["expert_misses"]
    out["expert_hit_rate"] = samples[-1]["expert_hits"] / looks if looks else None
    out["expert_load_bytes_per_token"] = median(
        [s["bytes_read"] / max(s["forwards"], 1) for s in samples])
    for key in ("read_gb_s", "hit_rate", "prefetch_recall"):
        if key in samples[-1]:
            out[key] = median([s[key] for s in samples])
    pairs = [(s["read_gb_s"], s["paired_disk_gbs"]) for s in samples
             if s.get("read_gb_s") and s.get("paired_disk_gbs")]
    if pairs:
        out["disk_pairs"] = pairs
    return out


#: seconds of each fio job (or of the Python readers) when the disk is measured beside a run
PAIRED_DISK_S = 3


def measure_disk(container: str, work: str, seconds: int = 5) -> dict:
    """The disk's own best random-read rate on the container's file, with fio when installed
    (1 MiB O_DIRECT reads, libaio, queue depth 1 and 8, ``seconds`` each), else with 4 Python
    O_DIRECT readers."""
    shards = sorted(os.path.join(container, n) for n in os.listdir(container) if n.endswith(".safetensors"))
    target = max(shards, key=os.path.getsize)
    out = {"file": target, "tool": None, "gbs": {}}
    if shutil.which("fio"):
        out["tool"] = "fio"
        for qd in (1, 8):
            r = _run(["fio", "--name=read", f"--filename={target}", "--readonly", "--rw=randread", "--bs=1M",
                      "--direct=1", "--ioengine=libaio", f"--iodepth={qd}", f"--runtime={seconds}", "--time_based",
                      "--output-format=json"], what=f"fio qd {qd}")
            try:
                out["gbs"][f"qd{qd}"] = json.loads(r.stdout)["jobs"][0]["read"]["bw_bytes"] / 1e9
            except (ValueError, KeyError, IndexError):
                out.setdefault("errors", []).append(last_error_line(r.stderr + r.stdout))
    else:
        out["tool"] = "python O_DIRECT, 4 readers"
        out["gbs"]["4 readers"] = _python_direct_read_gbs(target, seconds=seconds)
    out["best_gbs"] = max(out["gbs"].values()) if out["gbs"] else None
    return out


def _python_direct_read_gbs(path: str, seconds: float = 3.0, block: int = 1 << 20, readers: int = 4) -> float:
    import mmap
    import threading
    size = os.path.getsize(path) // block * block
    total = [0]
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def reader(seed):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        buf = mmap.mmap(-1, block)
        rng = __import__("random").Random(seed)
        n = 0
        try:
            while time.perf_counter() < stop:
                n += os.preadv(fd, [buf], rng.randrange(size // block) * block)
        finally:
            os.close(fd)
        with lock:
            total[0] += n

    t0 = time.perf_counter()
    ts = [threading.Thread(target=reader, args=(i,)) for i in range(readers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return total[0] / (time.perf_counter() - t0) / 1e9


def run_draft_check(model_dir: str, work: str, prompt: List[int], args) -> dict:
    """Speculation must earn its keep: the fixture with a random MTP head (every draft useless),
    --draft auto against --draft 0, alternating fresh processes; auto must stay within 5%."""
    sys.path.insert(0, HERE)
    import bench_draft
    try:
        container = bench_draft.ensure_mtp_fixture(model_dir, os.path.join(work, "draft"))
        if args.quiet_wait > 0:
            wait_quiet(args.quiet_wait)
        out = bench_draft.compare(container, max(args.runs, 5), args.tokens, threads=args.threads,
                                  log=log, prompt=prompt)
    except (subprocess.CalledProcessError, SystemExit) as e:
        return {"error": f"draft check: {e}"}
    out["within_5_percent"] = out["auto_over_draft0"] >= 0.95
    log(f"--draft auto / --draft 0 decode: {out['auto_over_draft0']:.3f}")
    return out


# ---------------------------------------------------------------------------------------------
# HF transformers peer (worker runs in a subprocess)


def hf_worker(model_dir: str, dtype: str, prompt: List[int], n_tokens: int, runs: int, threads: int,
              quiet_wait: float = 0.0, retries: int = 0) -> dict:
    import torch
    import transformers
    from transformers import GlmMoeDsaForCausalLM, LogitsProcessor, LogitsProcessorList

    torch.set_num_threads(threads)
    tdtype = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    t = time.perf_counter()
    model = GlmMoeDsaForCausalLM.from_pretrained(model_dir, dtype=tdtype, attn_implementation="eager").eval()
    load_s = time.perf_counter() - t
    ids = torch.tensor([prompt], dtype=torch.long)
    mask = torch.ones_like(ids)
    stamps: List[float] = []

    class Stamp(LogitsProcessor):
        """Called once per generated token, right after the forward that produced its logits."""

        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    def measure(i):
        with torch.inference_mode():
            t = time.perf_counter()
            model(input_ids=ids, attention_mask=mask, use_cache=True)
            tp = time.perf_counter() - t
            stamps.clear()
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                                 do_sample=False, logits_processor=LogitsProcessorList([Stamp()]),
                                 pad_token_id=pad)
            tg = time.perf_counter() - t
        dec = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) >= 2 else None
        return len(prompt) / tp, dec, tg, out[0, len(prompt):].tolist()

    got = collect(measure, runs, retries, quiet_wait)
    samples = got.pop("samples")
    prefill = [x[0] for x in samples]
    decode = [x[1] for x in samples if x[1] is not None]
    gen_total = [x[2] for x in samples]
    tokens = samples[-1][3]
    nparam = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "prefill_tok_s": median(prefill), "decode_tok_s": median(decode),
        "prefill_samples": prefill, "decode_samples": decode, "generate_s": gen_total, **got,
        "decode_tokens": len(tokens or []), "tokens": tokens, "load_s": load_s,
        "weight_bytes": int(nparam), "peak_rss_bytes": peak_rss_self(),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }


def run_hf(model_dir, dtype, prompt, n_tokens, runs, threads, timeout, quiet_wait=0.0, retries=0) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    r = _run([sys.executable, os.path.abspath(__file__), "--worker", "hf", "--model", model_dir,
              "--dtype", dtype, "--prompt-ids", ",".join(map(str, prompt)), "--tokens", str(n_tokens),
              "--runs", str(runs), "--threads", str(threads), "--quiet-wait", str(quiet_wait),
              "--retries", str(retries)], env=env, timeout=timeout, what=f"HF transformers {dtype}")
    return worker_result(r)


# ---------------------------------------------------------------------------------------------
# llama.cpp peer


def pad_indexer_for_llama(src_dir: str, dst_dir: str, head_dim: int = LLAMA_INDEXER_HEAD_DIM) -> dict:
    """Copy of the f32 fixture whose DSA indexer has ``head_dim`` dims per head (llama.cpp's
    glm-dsa needs >= 64): ``wq_b`` [nh*hd, q_lora] -> [nh*head_dim, q_lora] (each head's rows
    followed by zero rows), ``wk`` [hd, D] -> [head_dim, D] (zero rows), ``k_norm`` weight padded
    with 1 and bias with 0, ``index_head_dim`` = head_dim in config.json.

    This is NOT an exact transformation: k_norm is a LayerNorm over the head, and the zero
    padding changes its mean and variance (and the 1/sqrt(hd) score scale changes too).  It does
    not matter here: the indexer only picks which keys the attention sees, and while the context
    is <= index_topk (4096) every key is kept whatever the scores are, so the model's output does
    not depend on the indexer at all for this benchmark (32 + 64 tokens).  Any padding works; the
    padded copy costs the same compute as a real head_dim-64 indexer.
    """
    import numpy as np
    from safetensors.numpy import load_file, save_file

    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    hd, nh = int(cfg["index_head_dim"]), int(cfg["index_n_heads"])
    os.makedirs(dst_dir, exist_ok=True)
    for n in os.listdir(src_dir):
        if n.endswith(".json") and n not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(os.path.join(src_dir, n), os.path.join(dst_dir, n))
    changed = 0
    for n in sorted(os.listdir(src_dir)):
        if not n.endswith(".safetensors"):
            continue
        t = load_file(os.path.join(src_dir, n))
        if hd < head_dim:
            for k in list(t):
                a = t[k]
                if k.endswith("indexer.wq_b.weight"):
                    q = a.reshape(nh, hd, a.shape[-1])
                    t[k] = np.concatenate([q, np.zeros((nh, head_dim - hd, a.shape[-1]), a.dtype)],
                                          axis=1).reshape(nh * head_dim, a.shape[-1])
                elif k.endswith("indexer.wk.weight"):
                    t[k] = np.concatenate([a, np.zeros((head_dim - hd, a.shape[-1]), a.dtype)], axis=0)
                elif k.endswith("indexer.k_norm.weight"):
                    t[k] = np.concatenate([a, np.ones(head_dim - hd, a.dtype)])
                elif k.endswith("indexer.k_norm.bias"):
                    t[k] = np.concatenate([a, np.zeros(head_dim - hd, a.dtype)])
                else:
                    continue
                changed += 1
        save_file(t, os.path.join(dst_dir, n), metadata={"format": "pt"})
        del t
    idx = os.path.join(src_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        shutil.copy(idx, os.path.join(dst_dir, "model.safetensors.index.json"))
    cfg["index_head_dim"] = max(hd, head_dim)
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    return {"from": hd, "to": cfg["index_head_dim"], "tensors_padded": changed}


def gguf_type_summary(path: str) -> str:
    """'112 Q4_0, 1 Q6_K (output), 59 F32': the tensor types of a GGUF file ('' if unreadable)."""
    try:
        import gguf
        reader = gguf.GGUFReader(path)
        counts: Dict[str, int] = {}
        for t in reader.tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        out_t = next((t.tensor_type.name for t in reader.tensors if t.name == "output.weight"), None)
        parts = [f"{n} {k}" + (" (output)" if n == 1 and k == out_t else "")
                 for k, n in sorted(counts.items(), key=lambda kv: -kv[1])]
        return "tensors: " + ", ".join(parts)
    except Exception:
        return ""


def find_llama_src(work: str) -> str:
    """The llama.cpp tree vendored in the llama-cpp-python sdist (downloaded and unpacked into
    ``work`` with pip when not there yet); raises RuntimeError when it cannot be had.

    The whole vendor/llama.cpp is unpacked, its own vendor/ (nlohmann json, cpp-httplib, ...)
    included: the converter needs only the Python files, building llama-bench needs the rest.
    """
    try:
        from importlib.metadata import version
        ver = version("llama-cpp-python")
    except Exception:
        ver = None
    root = os.path.join(work, "llama_src")
    os.makedirs(root, exist_ok=True)

    def vendored():
        for n in sorted(os.listdir(root), reverse=True):
            if ver and not n.endswith(ver):
                continue
            p = os.path.join(root, n, "vendor", "llama.cpp")
            if (os.path.exists(os.path.join(p, "convert_hf_to_gguf.py"))
                    and os.path.exists(os.path.join(p, "vendor", "CMakeLists.txt"))):
                return p
        return None

    def sdists():
        return [n for n in os.listdir(root) if n.endswith(".tar.gz") and (not ver or n.endswith(f"-{ver}.tar.gz"))]

    p = vendored()
    if p:
        return p
    if not sdists():
        spec = f"llama-cpp-python=={ver}" if ver else "llama-cpp-python"
        r = _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                  "-d", root, spec], what="pip download (llama-cpp-python sdist)", timeout=1800)
        if r.returncode != 0:
            raise RuntimeError("pip download llama-cpp-python: " + last_error_line(r.stderr + r.stdout))
    for n in sdists():
        with tarfile.open(os.path.join(root, n)) as tf:
            members = [m for m in tf.getmembers()
                       if "/vendor/llama.cpp/" in m.name or m.name.endswith("/vendor/llama.cpp")]
            tf.extractall(root, members=members, filter="data")
    p = vendored()
    if not p:
        raise RuntimeError(f"no vendor/llama.cpp (convert_hf_to_gguf.py, vendor/) in the sdist under {root}")
    return p


def gguf_convert_worker(llama_src: str, src: str, outfile: str, outtype: str) -> None:
    """Run llama.cpp's convert_hf_to_gguf.py in this process.

    The only change: the fixture has no tokenizer, and the converter's GLM vocab step needs the
    real GLM tokenizer files, so ``GlmMoeDsaModel.set_vocab`` is pointed at the converter's own
    ``_set_vocab_none`` (tokenizer model "none"; llama.cpp then creates vocab_size placeholder
    tokens).  The benchmark feeds token ids, so no tokenizer is needed.  Every weight and
    hyper-parameter goes through the converter unchanged.
    """
    sys.path.insert(0, llama_src)
    sys.path.insert(1, os.path.join(llama_src, "gguf-py"))
    import importlib

    conv = importlib.import_module("convert_hf_to_gguf")
    cls = None
    try:
        cls = conv.get_model_class("GlmMoeDsaForCausalLM")
    except Exception:
        cls = None
    if cls is None:
        for mod in ("conversion.glm", "conversion"):
            try:
                cls = getattr(importlib.import_module(mod), "GlmMoeDsaModel")
                break
            except Exception:
                continue
    if cls is None:
        raise RuntimeError("the converter has no GlmMoeDsaForCausalLM model class")
    if not os.path.exists(os.path.join(src, "tokenizer.json")):
        cls.set_vocab = lambda self: self._set_vocab_none()
    sys.argv = ["convert_hf_to_gguf.py", src, "--outfile", outfile, "--outtype", outtype]
    conv.main()
    if not os.path.exists(outfile):
        raise RuntimeError(f"the converter wrote no {outfile}")


def quantize_worker(src: str, dst: str, qtype: str, threads: int) -> dict:
    import ctypes
    import llama_cpp

    ftype = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[qtype]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0 or not os.path.exists(dst):
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    return {"rc": int(rc)}


def llama_worker(gguf: str, prompt: List[int], n_tokens: int, runs: int, threads: int,
                 quiet_wait: float = 0.0, retries: int = 0, extra_bufts: bool = True) -> dict:
    """The Python loop through llama-cpp-python.  ``extra_bufts=False`` loads the model with
    ``use_extra_bufts=False`` (no repacked/AMX weight buffers; Llama() has no argument for it,
    so llama_model_default_params is wrapped while the model loads)."""
    import numpy as np
    import llama_cpp
    import llama_cpp.llama_cpp as lcpp
    from llama_cpp import Llama

    if not extra_bufts:
        default_params = lcpp.llama_model_default_params

        def no_extra_bufts():
            params = default_params()
            params.use_extra_bufts = False
            return params

        lcpp.llama_model_default_params = no_extra_bufts
    t = time.perf_counter()
    llm = Llama(model_path=gguf, n_ctx=max(256, len(prompt) + n_tokens + 16), n_batch=512,
                n_threads=threads, n_threads_batch=threads, seed=0, verbose=True)
    load_s = time.perf_counter() - t
    n_vocab = llm.n_vocab()

    def last_logits():
        return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))

    def measure(i):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        tp = time.perf_counter() - t
        out = []
        t = time.perf_counter()
        for _ in range(n_tokens):
            tok = int(np.argmax(last_logits()))
            out.append(tok)
            llm.eval([tok])
        td = time.perf_counter() - t
        return len(prompt) / tp, n_tokens / td, out

    got = collect(measure, runs, retries, quiet_wait)
    samples = got.pop("samples")
    prefill = [x[0] for x in samples]
    decode = [x[1] for x in samples]
    tokens = samples[-1][2]
    return {"prefill_tok_s": median(prefill), "decode_tok_s": median(decode),
            "prefill_samples": prefill, "decode_samples": decode, "tokens": tokens, **got,
            "decode_tokens": len(tokens or []), "load_s": load_s, "peak_rss_bytes": peak_rss_self(),
            "llama_cpp_python": getattr(llama_cpp, "__version__", None), "use_extra_bufts": extra_bufts}


# ---------------------------------------------------------------------------------------------
# llama-bench: llama.cpp's own benchmark, built from the same vendored tree


#: GCC flags that take AMX out of a -march=native build (an explicit -mno-X beats the ISA that
#: -march implies, wherever it stands on the command line).  ggml's GGML_AMX_TILE/INT8/BF16
#: options are only read when GGML_NATIVE is OFF, so under GGML_NATIVE=ON they cannot do it.
NO_AMX_CFLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

#: The parts of the llama.cpp tree that go into the llama-bench binary (the build fingerprint).
LLAMA_BUILD_INPUTS = ("CMakeLists.txt", "cmake", "common", "ggml", "include", "src", "vendor",
                      os.path.join("tools", "llama-bench"), os.path.join("tools", "CMakeLists.txt"))


def llama_bench_cmake_args(src: str, build: str, amx_cpu: bool) -> List[str]:
    """cmake configure arguments for llama-bench: Release, GGML_NATIVE=ON like the bench's
    llama-cpp-python build, tests/examples/server off; on a CPU with AMX the AMX kernels are
    compiled out (their repacked Q4_0/Q8_0 buffers make context creation abort with
    ``GGML_ASSERT(*cur_backend_id != -1)``)."""
    args = ["-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
    if amx_cpu:
        args += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
                 f"-DCMAKE_C_FLAGS={NO_AMX_CFLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_CFLAGS}"]
    return args


def tree_fingerprint(src: str, parts: Sequence[str] = LLAMA_BUILD_INPUTS) -> str:
    """sha1 over (path, size, mtime) of every file under ``parts`` of ``src``: changes whenever
    a source file that the build reads is added, removed or modified."""
    import hashlib

    h = hashlib.sha1()
    for part in parts:
        top = os.path.join(src, part)
        if os.path.isfile(top):
            paths = [top]
        else:
            paths = sorted(os.path.join(d, n) for d, _, ns in os.walk(top) for n in ns)
        for path in paths:
            st = os.stat(path)
            h.update(f"{os.path.relpath(path, src)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def build_error_line(text: str) -> str:
    """The line that says why a cmake configure/build failed: the last compiler ``error:`` line,
    or the last ``CMake Error at ...:`` line with the first line of its message (make's closing
    'Error 2' lines say nothing); else the last line."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        ln = lines[i]
        if re.search(r"\berror\b", ln, re.I) and not re.search(r"(make|ninja).*(\*\*\*|Error \d|failed)", ln, re.I):
            if ln.startswith("CMake Error") and ln.endswith(":") and i + 1 < len(lines):
                return ln + " " + lines[i + 1]
            return ln
    return last_error_line(text)


def lib_has_amx(lib: Optional[str]) -> Optional[bool]:
    """Whether a built libggml-cpu has its AMX kernels (ggml_cpu_has_amx_int8(), asked in a
    subprocess); None when the library is missing or cannot be loaded."""
    if not lib or not os.path.exists(lib):
        return None
    r = subprocess.run([sys.executable, "-c", "import ctypes, sys; "
                        "print(ctypes.CDLL(sys.argv[1]).ggml_cpu_has_amx_int8())", lib],
                       capture_output=True, text=True, timeout=60)
    return bool(int(r.stdout.strip())) if r.returncode == 0 and r.stdout.strip() in ("0", "1") else None


def _find_lib(top: str, name: str = "libggml-cpu.so") -> Optional[str]:
    for d, _, ns in os.walk(top):
        if name in ns:
            return os.path.join(d, name)
    return None


def llama_cpp_python_lib() -> Optional[str]:
    """The libggml-cpu.so that llama-cpp-python loads (None if not installed as a shared lib)."""
    try:
        import importlib.util
        spec = importlib.util.find_spec("llama_cpp")
    except Exception:
        return None
    if spec is None or not spec.origin:
        return None
    return _find_lib(os.path.dirname(spec.origin))


def ensure_llama_bench(llama_src: str, work: str, amx_cpu: bool, timeout: int) -> dict:
    """Build llama-bench from ``llama_src`` into WORK/llama-bench-build (only that target),
    reused while the source tree and the configure arguments are unchanged.

    Returns {'binary', 'cmake_args', 'reused', 'amx_compiled', 'repack_off', 'amx_note'} or
    {'error'}.  On a CPU with AMX the build leaves AMX out; if the library still reports AMX
    kernels (another compiler), llama-bench runs with ``--repack 0`` instead.
    """
    build = os.path.join(work, "llama-bench-build")
    args = llama_bench_cmake_args(llama_src, build, amx_cpu)
    want = {"fingerprint": tree_fingerprint(llama_src), "cmake_args": args}
    stamp = os.path.join(build, "colibri_bench_build.json")
    binary = os.path.join(build, "bin", "llama-bench")
    out = {"binary": binary, "cmake_args": args, "src": llama_src}
    try:
        with open(stamp) as f:
            have = json.load(f)
    except (OSError, ValueError):
        have = None
    out["reused"] = have == want and os.path.exists(binary)
    if not out["reused"]:
        if not shutil.which("cmake"):
            return {"error": "llama-bench build: cmake not found"}
        shutil.rmtree(build, ignore_errors=True)
        r = _run(["cmake", *args], timeout=timeout, what="cmake configure (llama-bench)")
        if r.returncode != 0:
            return {"error": "llama-bench cmake configure: " + build_error_line(r.stdout + "\n" + r.stderr)}
        r = _run(["cmake", "--build", build, "--target", "llama-bench", "-j2"], timeout=timeout,
                 what="cmake --build --target llama-bench")
        if r.returncode != 0 or not os.path.exists(binary):
            return {"error": "llama-bench build: " + build_error_line(r.stdout + "\n" + r.stderr)}
        with open(stamp, "w") as f:
            json.dump(want, f, indent=1)
    out["amx_compiled"] = lib_has_amx(_find_lib(build))
    out["repack_off"] = amx_cpu and out["amx_compiled"] is not False
    out["amx_note"] = amx_note(amx_cpu, out["amx_compiled"], out["repack_off"])
    return out


def amx_note(amx_cpu: bool, amx_compiled: Optional[bool], repack_off: bool) -> str:
    """How a llama.cpp build avoids the AMX abort, in a few words for the table."""
    if not amx_cpu:
        return "CPU without AMX"
    if repack_off:
        return "AMX CPU: --repack 0" + (" (AMX still compiled in)" if amx_compiled else "")
    return f"AMX CPU: built with AMX off ({NO_AMX_CFLAGS})"


def llama_bench_cmd(binary: str, gguf: str, threads: int, prompt_lens: Sequence[int], n_gen: int,
                    runs: int, repack_off: bool = False) -> List[str]:
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", ",".join(str(n) for n in prompt_lens),
           "-n", str(n_gen), "-r", str(runs), "-o", "json"]
    return cmd + (["--repack", "0"] if repack_off else [])


def _test_key(t: dict) -> str:
    """llama-bench's test name: pp512, tg64, pp512+tg64; '@dN' at context depth N."""
    p, g, d = int(t.get("n_prompt") or 0), int(t.get("n_gen") or 0), int(t.get("n_depth") or 0)
    key = "+".join(x for x in ((f"pp{p}" if p else ""), (f"tg{g}" if g else "")) if x)
    return key + (f" @ d{d}" if d else "")


def parse_llama_bench_json(text: str) -> dict:
    """llama-bench ``-o json`` output -> {'tests': {'pp32': {'avg_ts', 'stddev_ts', 'samples_ts'},
    ...}, 'meta': {build, CPU, threads, batch sizes, repack, flash attention, model}}.

    Raises ValueError when the text holds no llama-bench JSON array."""
    start = text.find("[")
    if start < 0:
        raise ValueError("no JSON array in llama-bench's output")
    data = json.loads(text[start:text.rindex("]") + 1])
    if not isinstance(data, list) or not data or not all(isinstance(t, dict) and "avg_ts" in t for t in data):
        raise ValueError("llama-bench's JSON has no test results")
    tests = OrderedDict()
    for t in data:
        n_tok = int(t.get("n_prompt") or 0) + int(t.get("n_gen") or 0)
        # tok/s per repetition from the exact nanoseconds (samples_ts is printed to 3 decimals)
        samples = ([n_tok * 1e9 / float(ns) for ns in t["samples_ns"]] if t.get("samples_ns") and n_tok
                   else [float(x) for x in t.get("samples_ts") or []])
        tests[_test_key(t)] = {"avg_ts": float(t["avg_ts"]), "stddev_ts": float(t.get("stddev_ts") or 0.0),
                               "samples_ts": samples,
                               "n_prompt": int(t.get("n_prompt") or 0), "n_gen": int(t.get("n_gen") or 0)}
    meta_keys = ("build_commit", "build_number", "cpu_info", "backends", "model_type", "model_size",
                 "n_threads", "n_batch", "n_ubatch", "flash_attn", "repack", "type_k", "type_v")
    meta = {k: data[0][k] for k in meta_keys if k in data[0]}
    return {"tests": tests, "meta": meta}


def llama_bench_row(parsed: dict, prompt_len: int, n_gen: int) -> dict:
    """The bench-table fields of a parsed llama-bench run: prefill = pp<prompt_len>, decode =
    tg<n_gen> (avg over its repetitions), their samples for the spread table."""
    tests = parsed["tests"]
    pp, tg = tests.get(f"pp{prompt_len}"), tests.get(f"tg{n_gen}")
    return {"prefill_tok_s": pp["avg_ts"] if pp else None, "decode_tok_s": tg["avg_ts"] if tg else None,
            "prefill_samples": pp["samples_ts"] if pp else [], "decode_samples": tg["samples_ts"] if tg else [],
            "llama_bench": parsed}


def ts_stats(samples: Sequence[float]) -> dict:
    """{'avg_ts', 'stddev_ts', 'samples_ts'} of tok/s samples, with llama-bench's statistics (the
    mean; the sample standard deviation, n - 1, 0 for a single sample)."""
    xs = [float(x) for x in samples]
    return {"avg_ts": statistics.fmean(xs) if xs else None,
            "stddev_ts": statistics.stdev(xs) if len(xs) > 1 else 0.0, "samples_ts": xs}


def merge_llama_bench(parsed_runs: Sequence[dict]) -> dict:
    """Several parsed llama-bench runs (one per interleaved round) as one: each test's samples
    pooled, avg and stddev recomputed as llama-bench computes them; the first run's meta."""
    tests: Dict[str, dict] = OrderedDict()
    for parsed in parsed_runs:
        for key, t in parsed["tests"].items():
            got = tests.setdefault(key, {"samples_ts": [], "n_prompt": t["n_prompt"], "n_gen": t["n_gen"]})
            got["samples_ts"].extend(t["samples_ts"])
    for t in tests.values():
        t.update(ts_stats(t["samples_ts"]))
    return {"tests": tests, "meta": dict(parsed_runs[0]["meta"]) if parsed_runs else {},
            "invocations": len(parsed_runs)}


def llama_bench_once(build: dict, gguf: str, threads: int, lens: Sequence[int], n_gen: int,
                     timeout: int) -> dict:
    """One llama-bench invocation, -r 1 (after its own warm-up): parsed JSON or {'error'}."""
    cmd = llama_bench_cmd(build["binary"], gguf, threads, lens, n_gen, 1, build.get("repack_off", False))
    r = _run(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(threads)), timeout=timeout,
             what=f"llama-bench {os.path.basename(gguf)}")
    if r.returncode != 0:
        return {"error": "llama-bench: " + last_error_line(r.stderr + "\n" + r.stdout) + f" (exit {r.returncode})"}
    try:
        return parse_llama_bench_json(r.stdout)
    except ValueError as e:
        return {"error": f"llama-bench: {e}: " + last_error_line(r.stderr + "\n" + r.stdout)}


READ_STEP = "streaming read"      # the engine-only rounds' bandwidth probe (measure_read_2threads)


def run_engine_rounds(variants: List[dict], lb_rows: List[dict], build: dict, prompt: List[int],
                      long_prompt: List[int], args, work: str) -> dict:
    """colibri (every expert cached, each of ``variants``: colibri_variants with 'path' and
    'error') and llama-bench on each GGUF, interleaved: ``--runs`` rounds, each one colibri
    process per variant with the bench prompt (-> ppP, tgN), one with the long prompt (-> ppL)
    and one llama-bench -r 1 per GGUF, the order reversed every other round.  A round during
    which other processes took >= DISTURBED of the CPUs in any of its measurements is discarded
    (up to ``--retries`` extra rounds).  Fills ``lb_rows`` with llama-bench's figures (samples
    pooled over the rounds); returns the per-round record and, in 'colibri', each variant's
    figures and its ratios to the llama-bench row of its peer quantization (colibri_figures)."""
    P, L, N = len(prompt), len(long_prompt), args.tokens
    lens = [P] + ([L] if L and L != P else [])
    out = {"engine": "engine-only rounds", "weights": "colibri + llama-bench", "rounds": [], "gates": []}
    errors: Dict[str, str] = {}
    colibri_steps = []
    for v in variants:
        name = f"colibri {v['name']}"
        if v.get("error"):
            errors[name] = v["error"]
            continue
        colibri_steps.append((name, lambda v=v: colibri_once(v["path"], prompt, N, 0, args.threads, work, v["extra"],
                                                             what=f"colibri {v['name']} (engine-only round)",
                                                             env=v.get("env"))))
        if L and L != P:
            colibri_steps.append((name + " long", lambda v=v: colibri_once(
                v["path"], long_prompt, 2, 0, args.threads, work, v["extra"],
                what=f"colibri {v['name']} {L}-token prompt (engine-only round)", env=v.get("env"))))
    lb_steps = [(r["weights"], (lambda g=r["gguf"]: llama_bench_once(build, g, args.threads, lens, N, args.timeout)))
                for r in lb_rows]
    # the machine's streaming read, measured in every round beside the engines it is compared with
    lb_steps.append((READ_STEP, lambda: worker_result(_run([sys.executable, os.path.abspath(__file__), "--worker",
                                                            "read"], what="streaming read (engine-only round)"))))
    for name, step in colibri_steps:  # warm-up: page cache, first-process costs
        got = step()
        if "error" in got:
            errors[name] = got["error"]
    clean, dirty = [], []
    attempts = 0
    while len(clean) < args.runs and attempts < args.runs + args.retries:
        steps = [(n, f) for n, f in colibri_steps + lb_steps if n not in errors]
        if not steps:
            break
        if attempts % 2:
            steps.reverse()
        attempts += 1
        if args.quiet_wait > 0:
            out["gates"].append(wait_quiet(args.quiet_wait))
        rnd = {"order": [n for n, _ in steps], "others": {}, "results": {}}
        for name, step in steps:
            with OtherLoad("children") as ol:
                got = step()
            if "error" in got:
                errors[name] = got["error"]
                continue
            rnd["others"][name] = ol.fraction
            rnd["results"][name] = got
        rnd["clean"] = all(f is None or f < DISTURBED for f in rnd["others"].values())
        (clean if rnd["clean"] else dirty).append(rnd)
        out["rounds"].append({k: v for k, v in rnd.items() if k != "results"})
    kept = clean if clean else dirty
    out.update(clean=bool(clean), disturbed=len(dirty), rounds_kept=len(kept), others=[f for r in out["rounds"] for f in r["others"].values()])
    out["errors"] = errors
    for row in lb_rows:
        name = row["weights"]
        if name in errors:
            row["error"] = errors[name]
            continue
        merged = merge_llama_bench([r["results"][name] for r in kept if name in r["results"]])
        row.update(llama_bench_row(merged, P, N))
        row["command"] = " ".join(llama_bench_cmd(build["binary"], row["gguf"], args.threads, lens, N, 1,
                                                  build.get("repack_off", False)))
        row["note"] = llama_bench_note(merged, L, build.get("amx_note", ""))
    out["colibri"] = OrderedDict((v["name"], colibri_figures(v, kept, errors, lb_rows, P, N, L)) for v in variants)
    # per round: the streaming read and each variant's decode rate (for the bandwidth share)
    out["read_rounds"] = []
    for r in kept:
        got = r["results"].get(READ_STEP)
        if not got or got.get("error"):
            continue
        rates = OrderedDict()
        for v in variants:
            src = r["results"].get(f"colibri {v['name']}")
            if src:
                rates[v["name"]] = colibri_rates(src)[1]
        out["read_rounds"].append({"read_gbs": got["gbs"], "decode_tok_s": rates})
    return out


def colibri_figures(v: dict, kept: List[dict], errors: Dict[str, str], lb_rows: List[dict], P: int, N: int,
                    L: int) -> dict:
    """Variant ``v``'s figures over the ``kept`` rounds: 'tests' (ppP, tgN from its bench-prompt
    processes, ppL from its long-prompt ones: avg, stddev, samples), its peak RSS and RAM budget
    over all its processes, and against the llama-bench row of its peer quantization (when that
    ran): 'ratios' (of the averages) and 'round_ratios' (within each round)."""
    short = f"colibri {v['name']}"
    long_ = short + " long"
    tests = OrderedDict()
    if short not in errors:
        rates = [colibri_rates(r["results"][short]) for r in kept if short in r["results"]]
        tests[f"pp{P}"] = ts_stats([p for p, _ in rates])
        if L and L != P and long_ not in errors:
            tests[f"pp{L}"] = ts_stats([colibri_rates(r["results"][long_])[0] for r in kept if long_ in r["results"]])
        tests[f"tg{N}"] = ts_stats([d for _, d in rates if d is not None])
    stats = [r["results"][n] for r in kept for n in (short, long_) if n in r["results"]]
    out = {"weights": v["weights"], "peer": v["peer"], "container": v["container"], "idot": v["idot"],
           "tests": tests, "errors": [errors[n] for n in (short, long_) if n in errors],
           "peak_rss_bytes": max((s["peak_rss_bytes"] for s in stats), default=None),
           "ram_budget_bytes": min((s["ram_budget_bytes"] for s in stats if s.get("ram_budget_bytes")), default=None),
           "ratios": {}, "round_ratios": {}}
    peer = next((r for r in lb_rows if r["weights"] == v["peer"] and not r.get("error") and r.get("llama_bench")),
                None)
    if peer is None:
        return out
    for key, c in tests.items():
        t = peer["llama_bench"]["tests"].get(key)
        if not t or c["avg_ts"] is None:
            continue
        out["ratios"][key] = c["avg_ts"] / t["avg_ts"]
        ratios = [colibri_over_round(r, short, v["peer"], key, P, N, L) for r in kept]
        out["round_ratios"][key] = [x for x in ratios if x is not None]
    return out


def colibri_over_round(rnd: dict, colibri: str, name: str, key: str, P: int, N: int, L: int) -> Optional[float]:
    """colibri (the round's step ``colibri``, its long-prompt step for ppL) ÷ llama-bench (GGUF
    ``name``) for test ``key`` within one round."""
    res = rnd.get("results", {})
    lb = res.get(name, {}).get("tests", {}).get(key)
    src = res.get(colibri + " long" if key == f"pp{L}" and L != P else colibri)
    if not lb or not src or not lb["samples_ts"]:
        return None
    pre, dec = colibri_rates(src)
    mine = dec if key == f"tg{N}" else pre
    return None if mine is None else mine / statistics.fmean(lb["samples_ts"])


LCP = "llama.cpp (llama-cpp-python)"   # the Python loop: eval() per token through the bindings
LB = "llama.cpp (llama-bench)"          # llama.cpp's own C++ benchmark, engine only


def run_llama_suite(model_dir: str, work: str, prompt, n_tokens, runs, threads, timeout,
                    notes: List[str], quiet_wait: float = 0.0, retries: int = 0, llama_bench: bool = True,
                    amx_cpu: bool = False, info: Optional[dict] = None) -> List[dict]:
    """Convert (pad -> f32 GGUF -> Q4_0/Q8_0), build llama-bench from the same llama.cpp tree and
    measure the llama-cpp-python loop on each GGUF; failures become error rows.  The llama-bench
    rows get their GGUF ('gguf') here and their figures in run_engine_rounds.  ``info`` (if
    given) receives the llama-bench build record."""
    quants = [("q4_0", "Q4_0"), ("q8_0", "Q8_0")]
    engines = (LCP, LB) if llama_bench else (LCP,)
    rows = [{"engine": e, "weights": label, "cached": "all"} for _, label in quants for e in engines]
    info = {} if info is None else info

    def fail_all(msg):
        for r in rows:
            r.setdefault("error", msg)
        return rows

    try:
        import llama_cpp  # noqa: F401
    except Exception as e:
        return fail_all(f"llama-cpp-python not importable: {e}")
    gdir = os.path.join(work, "gguf")
    os.makedirs(gdir, exist_ok=True)
    src = os.path.join(gdir, "padded_hf")
    weights = fixture_weights(model_dir)
    if not _newer(os.path.join(src, "config.json"), weights):
        r = _run([sys.executable, os.path.abspath(__file__), "--worker", "pad", "--model", model_dir,
                  "--out", src], timeout=timeout,
                 what=f"padding the indexer to head dim {LLAMA_INDEXER_HEAD_DIM}")
        res = worker_result(r)
        if "error" in res:
            return fail_all("indexer padding: " + res["error"])
    try:
        llama_src = find_llama_src(work)
    except Exception as e:
        return fail_all(f"llama.cpp sources: {e}")
    f32 = os.path.join(gdir, "bench-f32.gguf")
    if not _newer(f32, os.path.join(src, "config.json")):
        tmp = f32 + ".tmp"
        r = _run([sys.executable, os.path.abspath(__file__), "--worker", "gguf-convert",
                  "--llama-src", llama_src, "--model", src, "--out", tmp, "--outtype", "f32"],
                 timeout=timeout, what="convert_hf_to_gguf (f32)")
        if r.returncode != 0 or not os.path.exists(tmp):
            return fail_all("convert_hf_to_gguf: " + last_error_line(r.stderr + r.stdout))
        os.replace(tmp, f32)
    notes.append("llama.cpp GGUFs: llama.cpp's convert_hf_to_gguf.py (f32 GGUF; tokenizer step replaced by "
                 "its own `_set_vocab_none`, the fixture has no tokenizer) then llama_model_quantize; "
                 f"indexer zero-padded to head dim {LLAMA_INDEXER_HEAD_DIM} (output-neutral while the "
                 "context <= index_topk).")
    # llama-cpp-python's own libggml-cpu was built with -march=native: on an AMX CPU its AMX
    # buffers abort Q4_0/Q8_0 context creation, so it loads without extra buffer types there.
    lcp_amx = lib_has_amx(llama_cpp_python_lib())
    lcp_extra_bufts = not (amx_cpu and lcp_amx is not False)
    info["llama_cpp_python_amx_compiled"] = lcp_amx
    info["llama_cpp_python_use_extra_bufts"] = lcp_extra_bufts
    build = None
    if llama_bench:
        build = ensure_llama_bench(llama_src, work, amx_cpu, timeout)
        info.update(build)
        if "error" in build:
            for r in rows:
                if r["engine"] == LB:
                    r["error"] = build["error"]
    for q, label in quants:
        lcp_row, lb_row = (next((r for r in rows if r["engine"] == e and r["weights"] == label), None)
                           for e in (LCP, LB))
        dst = os.path.join(gdir, f"bench-{label}.gguf")
        if not _newer(dst, f32):
            tool = shutil.which("llama-quantize")
            if tool:
                r = _run([tool, f32, dst + ".tmp", label, str(threads)], timeout=timeout,
                         what=f"llama-quantize {label}")
            else:
                r = _run([sys.executable, os.path.abspath(__file__), "--worker", "quantize", "--model", f32,
                          "--out", dst + ".tmp", "--outtype", q, "--threads", str(threads)],
                         timeout=timeout, what=f"llama_model_quantize {label}")
            if r.returncode != 0 or not os.path.exists(dst + ".tmp"):
                for row in (lcp_row, lb_row):
                    if row is not None:
                        row.setdefault("error", f"quantize {label}: " + last_error_line(r.stderr + r.stdout))
                continue
            os.replace(dst + ".tmp", dst)
        types = gguf_type_summary(dst)
        lcp_row["size_bytes"] = os.path.getsize(dst)
        lcp_row["note"] = types + ("" if lcp_extra_bufts else "; use_extra_bufts=False (AMX CPU)")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        r = _run([sys.executable, os.path.abspath(__file__), "--worker", "llama", "--model", dst,
                  "--prompt-ids", ",".join(map(str, prompt)), "--tokens", str(n_tokens),
                  "--runs", str(runs), "--threads", str(threads), "--quiet-wait", str(quiet_wait),
                  "--retries", str(retries)] + ([] if lcp_extra_bufts else ["--no-extra-bufts"]),
                 env=env, timeout=timeout, what=f"llama-cpp-python {label}")
        res = worker_result(r)
        if "error" in res:
            res["error"] = f"llama-cpp-python {label}: " + res["error"]
        lcp_row.update(res)
        if lb_row is not None and not lb_row.get("error"):
            lb_row["size_bytes"] = os.path.getsize(dst)
            lb_row["gguf"] = dst  # measured in the engine-only rounds, interleaved with colibri
    return rows


def llama_bench_note(parsed: dict, long_prompt: int, amx: str) -> str:
    """The main table's note of a llama-bench row: the long-prompt figure and the AMX handling."""
    t = parsed["tests"].get(f"pp{long_prompt}")
    return ((f"pp{long_prompt} {fmt_num(t['avg_ts'])} ± {fmt_num(t['stddev_ts'])} tok/s; " if t else "") + amx)


# ---------------------------------------------------------------------------------------------
# main


def _loadavg() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover
        return None


def git_commit() -> Optional[str]:
    try:
        r = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return r.stdout.strip() + ("+dirty" if dirty else "") if r.returncode == 0 else None
    except OSError:
        return None


def agreement(a: Optional[List[int]], b: Optional[List[int]]) -> Optional[int]:
    """Length of the common prefix of two greedy continuations."""
    if a is None or b is None:
        return None
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def llama_bench_method_note(info: dict, rows: List[dict], args) -> str:
    """The report's note on how llama-bench was built and run (``info``: run_llama_suite's record)."""
    lens = f"{args.prompt_len}" + (f",{args.long_prompt}" if args.long_prompt else "")
    meta = next((r["llama_bench"]["meta"] for r in rows if r.get("llama_bench")), {})
    ver = os.path.basename(os.path.dirname(os.path.dirname(info["src"]))) if info.get("src") else "the"
    built = ("built earlier (same source and flags) " if info.get("reused") else "built ") + \
        f"from the llama.cpp tree vendored in the {ver} sdist" + \
        (f" (llama.cpp build {meta.get('build_number')}, commit {meta.get('build_commit')})" if meta else "")
    knobs = (f"; its defaults: n_batch {meta.get('n_batch')}, n_ubatch {meta.get('n_ubatch')}, flash_attn "
             f"{meta.get('flash_attn')} (-1 = auto), repack {str(meta.get('repack')).lower()}") if meta else ""
    return (f"llama-bench: `llama-bench -m GGUF -t {args.threads} -p {lens} -n {args.tokens} -r 1 -o json`"
            + (" --repack 0" if info.get("repack_off") else "")
            + f" once per round, {built}, cmake -DGGML_NATIVE=ON Release, target llama-bench only; "
            + (info.get("amx_note") or "") + knobs + ". Each round runs each colibri variant (all experts cached: the "
            f"{args.prompt_len}-token prompt and {args.tokens} tokens, then a {args.long_prompt}-token prompt) and "
            "llama-bench on each GGUF, and a 2-thread streaming read of a 1-GiB array (the bandwidth line's "
            "divisor, round by round), the order reversed every other round; llama-bench's figures pool its "
            "samples over the rounds with its own statistics (mean, sample stddev). ppN = an N-token prompt in "
            "one batch, tgN = N single-token decodes, both from an empty context, no sampling (the engine "
            "alone, no Python); colibri's tgN is its decode tok/s after the prompt. llama-cpp-python rows: the "
            "Python loop, one eval() per token, logits read back each step."
            + ("" if info.get("llama_cpp_python_use_extra_bufts", True)
               else " On this AMX CPU llama-cpp-python loads with use_extra_bufts=False."))


def bpt_key(container: str) -> str:
    """The result key of a container's weight bytes per token ('bytes_per_token' is int4's)."""
    return "bytes_per_token" if container == "int4" else f"bytes_per_token_{container}"


def colibri_row(v: dict, cache: int, extra: Sequence[str], cached: str, ref: bool, prompt: List[int],
                args, work: str) -> dict:
    """One main-table row of colibri variant ``v`` (colibri_variants) with ``cache`` experts per
    layer cached (0 = all) and run options ``extra``: median of ``--runs`` fresh processes."""
    row = {"engine": "colibri", "weights": v["weights"], "cached": cached, "ref": ref, "variant": v["name"],
           "container": v["container"], "idot": v["idot"], "peer": v["peer"]}
    if v.get("error"):
        row["error"] = v["error"]
        return row
    row["size_bytes"] = dir_bytes(v["path"])
    row.update(run_colibri(v["path"], prompt, args.tokens, cache, args.threads, args.runs, work,
                           args.quiet_wait, args.retries, tuple(v["extra"]) + tuple(extra),
                           disk_pair="--direct" in extra, env=v.get("env")))
    if not row.get("error") and row.get("decode_tokens", args.tokens) < args.tokens:
        row["note"] = f"stopped at EOS after {row['decode_tokens']} tokens"
    elif not row.get("error") and row.get("hit_rate") is not None:
        row["note"] = (f"expert hit rate {100 * row['hit_rate']:.0f}%"
                       + (f", prefetch recall {100 * row['prefetch_recall']:.0f}%, reads "
                          f"{row['read_gb_s']:.2f} GB/s" if cache else ""))
    return row


def run_bench(args) -> dict:
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    model_dir = os.path.abspath(args.model or os.path.join(work, "bench_model"))
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "colibri_commit": git_commit(),
                 "machine": machine_info(), "notes": []}
    res["machine"]["loadavg_start"] = _loadavg()
    res["machine"]["nice"] = os.nice(0)
    res["params"] = {"runs": args.runs, "tokens": args.tokens, "prompt_len": args.prompt_len,
                     "threads": args.threads, "model": model_dir, "work": work,
                     "long_prompt": args.long_prompt}
    fixture = ensure_fixture(model_dir)
    res["fixture"] = fixture
    vocab = fixture["config_summary"]["vocab_size"]
    prompt = bench_prompt(args.prompt_len, vocab)
    res["params"]["prompt_ids"] = prompt

    # In a subprocess, like every large allocation of the bench: a child started from this
    # process inherits its peak RSS in ru_maxrss (which colibri reports), so this one stays small.
    if args.quiet_wait > 0:
        wait_quiet(args.quiet_wait)
    bw = worker_result(_run([sys.executable, os.path.abspath(__file__), "--worker", "bandwidth"],
                            what="memory bandwidth"))
    if "error" in bw:
        res["notes"].append("memory bandwidth: " + bw["error"])
        bw = None
    else:
        log(f"bandwidth {bw['gbs']:.2f} GB/s")
    res["bandwidth"] = bw

    rows: List[dict] = []
    containers = ["int4"] + ([] if args.skip_int8 else ["int8"])
    paths = {c: os.path.join(work, c) for c in containers}
    errors = {c: ensure_container(model_dir, paths[c], c) for c in containers}
    variants = colibri_variants(containers, (2,) if args.skip_idot1 else (2, 1),
                                amx_off=("int4",) if res["machine"].get("amx") else ())
    for v in variants:
        v["path"], v["error"] = paths[v["container"]], errors[v["container"]]
    int4, err = paths["int4"], errors["int4"]
    # every variant with every expert cached; the default (int4, --idot 2) also with 4 experts per
    # layer over the OS page cache and with true disk reads
    default = variants[0]
    configs = ([(default, 0, (), "all"), (default, 4, (), "4 (page cache)"),
                (default, 4, ("--direct",), "4 (disk, O_DIRECT)")]
               + [(v, 0, (), "all") for v in variants[1:]])
    for v, cache, extra, label in configs:
        rows.append(colibri_row(v, cache, extra, label, v is default and cache == 0, prompt, args, work))
    if not err:
        res["disk"] = measure_disk(int4, work)
    for c in containers:
        if errors[c]:
            continue
        try:
            res[bpt_key(c)] = weight_bytes_per_token(paths[c], ctx_len=args.prompt_len + args.tokens)
        except Exception as e:  # pragma: no cover - reported, not fatal
            res["notes"].append(f"bytes/token ({c}): {e}")

    if not args.skip_draft and not err:
        res["draft"] = run_draft_check(model_dir, work, prompt, args)

    if not args.skip_hf:
        for dtype in ("bf16", "f32"):
            row = {"engine": "HF transformers", "weights": dtype, "cached": "all"}
            row.update(run_hf(model_dir, dtype, prompt, args.tokens, args.runs, args.threads, args.timeout,
                              args.quiet_wait, args.retries))
            if not row.get("error"):
                row["size_bytes"] = row.get("weight_bytes")
                row["note"] = "eager attention, generate()"
            rows.append(row)
    if not args.skip_llama:
        llama_rows = run_llama_suite(model_dir, work, prompt, args.tokens, args.runs, args.threads,
                                     args.timeout, res["notes"], args.quiet_wait, args.retries,
                                     llama_bench=not args.skip_llama_bench,
                                     amx_cpu=bool(res["machine"].get("amx")), info=res.setdefault("llama", {}))
        rows.extend(llama_rows)
    lb_rows = [r for r in rows if r.get("engine") == LB and r.get("gguf") and not r.get("error")]
    if lb_rows or (args.long_prompt > 0 and not err):
        res["engine_rounds"] = run_engine_rounds(variants, lb_rows, res.get("llama") or {}, prompt,
                                                 bench_prompt(args.long_prompt, vocab), args, work)
    if not args.skip_llama and not args.skip_llama_bench:
        res["notes"].append(llama_bench_method_note(res["llama"], rows, args))

    ref_tokens = next((r.get("tokens") for r in rows if r.get("engine") == "HF transformers"
                       and r.get("weights") == "f32" and r.get("tokens")), None)
    if ref_tokens:
        for r in rows:
            if r.get("tokens"):
                r["greedy_prefix_vs_hf_f32"] = agreement(r["tokens"], ref_tokens)
    res["rows"] = rows
    measured = rows + ([res["engine_rounds"]] if res.get("engine_rounds") else [])
    gates = [g for r in measured for g in (r.get("gates") or [])]
    if args.quiet_wait > 0 and gates:
        busy = [g for g in gates if not g["quiet"]]
        res["notes"].append(
            f"before each of the {len(gates)} measured runs the bench waited for the other processes to use "
            f"< 25% of the CPUs (up to {args.quiet_wait:.0f} s; {sum(g['waited_s'] for g in gates):.0f} s "
            f"waited in all); {len(busy)} run(s) started on a busy machine anyway.")
    n_dist = sum(r.get("disturbed") or 0 for r in measured)
    unclean = [f"{r['engine']} {r['weights']}" + (f" ({r['cached']} cached)" if r["engine"] == "colibri" else "")
               for r in measured if r.get("clean") is False]
    res["notes"].append(
        f"runs during which other processes used >= {int(DISTURBED * 100)}% of the CPUs were discarded and "
        f"retried (up to {args.retries} extra runs per configuration): {n_dist} discarded"
        + (f"; NO undisturbed run for {', '.join(unclean)}: those figures are from disturbed runs."
           if unclean else "; every figure comes from undisturbed runs."))
    res["machine"]["loadavg_end"] = _loadavg()
    res["notes"].append(f"1-minute load average {res['machine']['loadavg_start']} at the start, "
                        f"{res['machine']['loadavg_end']} at the end, bench at nice {res['machine']['nice']} "
                        "(other processes share the machine).")
    res["notes"].append("greedy = HF f32: how many of the first greedy tokens equal HF f32's; the fixture is "
                        "random, its logits are nearly flat, so any quantization flips an early argmax and the "
                        "continuations then differ (an equal prefix checks that an engine computes the same model).")
    res["notes"].append("decode tok/s = decode forwards / their wall time (one new token per forward, "
                        "the prompt forward excluded); prefill tok/s = prompt tokens / prompt forward time.")
    res["notes"].append("colibri: one fresh process per measurement (`python -m colibri run`, OMP_NUM_THREADS="
                        f"{args.threads}); HF/llama.cpp: one subprocess per configuration, warm-up + runs inside.")
    res["verdict"] = verdict_rows(res)
    return res


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="colibri vs HF transformers vs llama.cpp on the benchmark fixture.")
    ap.add_argument("--model", default=None,
                    help="the f32 fixture directory (built when missing; default WORK/bench_model)")
    ap.add_argument("--work", default="/tmp/colibri_bench", help="where converted files go")
    ap.add_argument("--runs", type=int, default=3, help="measured runs per configuration (median)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens to decode (greedy)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens")
    ap.add_argument("--threads", type=int, default=2, help="threads for every engine (default 2)")
    ap.add_argument("--skip-hf", action="store_true", help="leave out HF transformers")
    ap.add_argument("--skip-llama", action="store_true",
                    help="leave out llama.cpp (llama-cpp-python and llama-bench)")
    ap.add_argument("--skip-llama-bench", action="store_true",
                    help="leave out llama-bench (no cmake build); the llama-cpp-python rows stay")
    ap.add_argument("--long-prompt", type=int, default=512, metavar="N",
                    help="second prefill length: colibri (all experts cached) and llama-bench's ppN "
                         "(default 512; 0 = leave out)")
    ap.add_argument("--skip-int8", action="store_true",
                    help="leave out colibri's int8 container (its all-cached rows and engine-only rounds)")
    ap.add_argument("--skip-idot1", action="store_true",
                    help="leave out colibri's --idot 1 rows (plain Q8 activations; all cached and in the "
                         "engine-only rounds); --idot 2, the default, is always measured")
    ap.add_argument("--skip-draft", action="store_true",
                    help="leave out the --draft auto vs --draft 0 check (fixture with a random MTP head)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds allowed for each peer subprocess")
    ap.add_argument("--quiet-wait", type=float, default=60.0, metavar="S",
                    help="before each measured run, wait up to S seconds for the other processes on the "
                         "machine to use < 25%% of the CPUs (0 = never wait; default 60)")
    ap.add_argument("--retries", type=int, default=3, metavar="N",
                    help="extra runs allowed per configuration to replace runs during which other "
                         "processes took >= 15%% of the CPUs (default 3)")
    # internal: worker subprocesses
    ap.add_argument("--worker", choices=("hf", "llama", "gguf-convert", "quantize", "pad", "bandwidth", "read"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="f32", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-ids", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--outtype", default="f32", help=argparse.SUPPRESS)
    ap.add_argument("--llama-src", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-extra-bufts", action="store_true", help=argparse.SUPPRESS)
    return ap


def worker_main(args) -> int:
    ids = [int(x) for x in args.prompt_ids.split(",")] if args.prompt_ids else []
    if args.worker == "hf":
        emit_worker_result(hf_worker(args.model, args.dtype, ids, args.tokens, args.runs, args.threads,
                                     args.quiet_wait, args.retries))
    elif args.worker == "llama":
        emit_worker_result(llama_worker(args.model, ids, args.tokens, args.runs, args.threads,
                                        args.quiet_wait, args.retries, extra_bufts=not args.no_extra_bufts))
    elif args.worker == "gguf-convert":
        gguf_convert_worker(args.llama_src, args.model, args.out, args.outtype)
    elif args.worker == "pad":
        emit_worker_result(pad_indexer_for_llama(args.model, args.out))
    elif args.worker == "bandwidth":
        emit_worker_result(measure_bandwidth())
    elif args.worker == "read":
        emit_worker_result(measure_read_2threads())
    elif args.worker == "quantize":
        emit_worker_result(quantize_worker(args.model, args.out, args.outtype, args.threads))
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.runs < 1 or args.tokens < 2 or args.prompt_len < 1:
        raise SystemExit("bench: --runs >= 1, --tokens >= 2 and --prompt-len >= 1 are required")
    if args.long_prompt < 0:
        raise SystemExit("bench: --long-prompt must be >= 0 (0 = leave the long prefill out)")
    res = run_bench(args)
    text = render_report(res)
    sys.stdout.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
