#!/usr/bin/env python3
"""Group-scaled int4 (one scale per 64 inputs of a row, colibrì's default container) against
per-row int4: speed and parity, on a model of the benchmark fixture's shape.

Builds a random float checkpoint with tools/make_bench_model.py's configuration (numpy, no torch:
every matrix N(0, 0.02) as the fixture's initialization, norms 1, router bias linspace(-0.1, 0.1)),
converts it twice (``convert --group-size 0`` and ``--group-size 64``), and measures, in one
process with the two variants alternated (A B B A ...) so that machine noise hits both alike:

- one decode matmul (S = 1, idot = 2, the engine's default numerics) at 2048 x 6144 and 6144 x 2048
  (GLM-5.2's expert gate/up and down widths), per-row against groups of 64, and each one's
  relative RMS error against the float product;
- decode: one token per forward after a prompt, every expert in RAM (tokens per second);
- parity of each container against the float model: max and mean |Δlogit| over a teacher-forced
  sequence, and top-1 agreement.

``--outliers K`` multiplies K input channels of every matrix by 8 (the heavy input channels real
LLM weights have and i.i.d. random weights lack; groups confine each to its 64 inputs).

Usage::

    python tools/bench_groups.py [--tiny] [--threads 1] [--tokens 32] [--rounds 4] [--outliers 0]
                                 [--json out.json] [--work DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def random_weights(cfg: dict, mtp: bool = False, seed: int = 2026, std=None, outliers: int = 0) -> dict:
    """HF glm_moe_dsa tensor names (engine spec §2.2) with random float32 values for config ``cfg``
    (a config.json dict): matrices N(0, std) (std None: 1/sqrt(inputs)), norm weights 1 + N(0,
    0.1) (std None) or 1, biases 0, router correction biases small. The MTP head (``mtp``) is layer
    num_hidden_layers: a sparse layer plus eh_proj and its norms. ``outliers`` input channels of
    every matrix (the same channels for matrices of one input width) are scaled by 8."""
    rng = np.random.default_rng(seed)
    D, V, NL = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    H, Lq, Lkv = cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    E, Ie, Id = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    nh, hd = cfg["index_n_heads"], cfg["index_head_dim"]
    kinds = cfg.get("indexer_types") or ["full"] * NL
    heavy = {}
    t = {}

    def mat(name, O, I, scale=None):
        s = scale or std or 1 / np.sqrt(I)
        w = (rng.standard_normal((O, I), dtype=np.float32) * np.float32(s)).astype(np.float32)
        if outliers:
            cols = heavy.setdefault(I, np.random.default_rng(I).choice(I, size=min(outliers, I), replace=False))
            w[:, cols] *= np.float32(8)
        t[name] = w

    def vec(name, n, base=1.0, noise=0.1):
        noise = noise if std is None else 0.0
        t[name] = (base + noise * rng.standard_normal(n)).astype(np.float32)

    mat("model.embed_tokens.weight", V, D, 1.0 if std is None else std)
    mat("lm_head.weight", V, D)
    vec("model.norm.weight", D)
    for i in range(NL + (1 if mtp else 0)):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        vec(p + "input_layernorm.weight", D)
        vec(p + "post_attention_layernorm.weight", D)
        mat(a + "q_a_proj.weight", Lq, D)
        vec(a + "q_a_layernorm.weight", Lq)
        mat(a + "q_b_proj.weight", H * (dn + dr), Lq)
        mat(a + "kv_a_proj_with_mqa.weight", Lkv + dr, D)
        vec(a + "kv_a_layernorm.weight", Lkv)
        mat(a + "kv_b_proj.weight", H * (dn + dv), Lkv)
        mat(a + "o_proj.weight", D, H * dv)
        if i < NL and kinds[i] == "full":
            mat(a + "indexer.wq_b.weight", nh * hd, Lq)
            mat(a + "indexer.wk.weight", hd, D)
            mat(a + "indexer.weights_proj.weight", nh, D)
            vec(a + "indexer.k_norm.weight", hd)
            vec(a + "indexer.k_norm.bias", hd, 0.0)
        m = p + "mlp."
        if i < cfg["first_k_dense_replace"]:
            mat(m + "gate_proj.weight", Id, D)
            mat(m + "up_proj.weight", Id, D)
            mat(m + "down_proj.weight", D, Id)
            continue
        mat(m + "gate.weight", E, D)
        t[m + "gate.e_score_correction_bias"] = (np.linspace(-0.1, 0.1, E) if std is not None else
                                                 0.05 * rng.standard_normal(E)).astype(np.float32)
        mat(m + "shared_experts.gate_proj.weight", Ie, D)
        mat(m + "shared_experts.up_proj.weight", Ie, D)
        mat(m + "shared_experts.down_proj.weight", D, Ie)
        for e in range(E):
            mat(f"{m}experts.{e}.gate_proj.weight", Ie, D)
            mat(f"{m}experts.{e}.up_proj.weight", Ie, D)
            mat(f"{m}experts.{e}.down_proj.weight", D, Ie)
        if i == NL:
            mat(p + "eh_proj.weight", D, 2 * D)
            for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
                vec(p + n, D)
    return t


def write_checkpoint(dst: str, tiny: bool, outliers: int) -> dict:
    """The float fixture: config.json and model.safetensors in dst; returns the config."""
    from safetensors.numpy import save_file
    import make_bench_model as mb
    cfg = mb.config_kwargs(tiny)
    cfg.update(model_type="glm_moe_dsa", architectures=["GlmMoeDsaForCausalLM"])
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file(random_weights(cfg, std=mb.INIT_STD, seed=mb.SEED, outliers=outliers),
              os.path.join(dst, "model.safetensors"))
    return cfg


def bench_matmul(rounds: int, outliers: int) -> list:
    """µs per decode matmul (S = 1, idot = 2), per-row vs groups of 64, best of the rounds, and each
    one's relative RMS error against the float matmul (16 random activation rows)."""
    from colibri import _core, quant
    rng = np.random.default_rng(0)
    out = []
    for O, I in ((2048, 6144), (6144, 2048)):
        W = (rng.standard_normal((O, I)) * 0.02).astype(np.float32)
        if outliers:
            W[:, rng.choice(I, size=outliers, replace=False)] *= np.float32(8)
        qts = {}
        for gs in (0, 64):
            p, s, _ = quant.quantize(W, 4, group_size=gs)
            qts[gs] = _core.QT.from_packed(p, s, O, I)
        x = rng.standard_normal((1, I)).astype(np.float32)
        best = {0: 1e30, 64: 1e30}
        for r in range(2 * rounds):
            for gs in ((0, 64) if r % 2 == 0 else (64, 0)):
                t0 = time.perf_counter()
                for _ in range(20):
                    _core.matmul(qts[gs], x, idot=2)
                best[gs] = min(best[gs], (time.perf_counter() - t0) / 20 * 1e6)
        xt = rng.standard_normal((16, I)).astype(np.float32)
        ref = xt.astype(np.float64) @ W.T.astype(np.float64)
        err = {gs: float(np.sqrt(np.mean((_core.matmul(qts[gs], xt, idot=2) - ref) ** 2) / np.mean(ref ** 2)))
               for gs in (0, 64)}
        out.append({"O": O, "I": I, "per_row_us": best[0], "group64_us": best[64], "ratio": best[64] / best[0],
                    "per_row_rel_rms_err": err[0], "group64_rel_rms_err": err[64]})
    return out


def bench_decode(models: dict, prompt: list, tokens: int, rounds: int) -> dict:
    """Decode tokens per second of each model (greedy, one token per forward), alternated."""
    times = {k: [] for k in models}
    order = list(models)
    for r in range(rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            m = models[k]
            m.kv_alloc(len(prompt) + tokens + 2)
            logits = m.step(prompt, 0)
            t0 = time.perf_counter()
            for i in range(tokens):
                logits = m.step([int(np.argmax(logits))], len(prompt) + i)
            times[k].append(tokens / (time.perf_counter() - t0))
    return {k: {"tok_s_best": max(v), "tok_s_median": float(np.median(v))} for k, v in times.items()}


def parity(models: dict, ref, ids: list) -> dict:
    _, lr = ref.forward_all(ids)
    out = {}
    for k, m in models.items():
        _, lm = m.forward_all(ids)
        d = np.abs(lm - lr)
        out[k] = {"max_abs_logit_diff": float(d.max()), "mean_abs_logit_diff": float(d.mean()),
                  "rel_max": float(d.max() / np.abs(lr).max()),
                  "top1_agreement": float((np.argmax(lm, 1) == np.argmax(lr, 1)).mean())}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example: python tools/bench_groups.py --threads 1 --tokens 32 --json g.json")
    ap.add_argument("--tiny", action="store_true", help="the scaled-down fixture (tests)")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads (default 1: the least noisy)")
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per measurement")
    ap.add_argument("--rounds", type=int, default=4, help="alternated measurements per variant")
    ap.add_argument("--outliers", type=int, default=0, metavar="K",
                    help="scale K input channels of every matrix by 8 (default 0: i.i.d. weights)")
    ap.add_argument("--work", default=None, help="folder for the checkpoints (default: a temporary one)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    import colibri
    from colibri import _core
    from colibri.convert import ConvertOptions, convert
    _core.set_threads(args.threads)
    work = args.work or tempfile.mkdtemp(prefix="bench_groups_")
    try:
        src = os.path.join(work, "f32")
        cfg = write_checkpoint(src, args.tiny, args.outliers)
        dirs = {}
        for gs in (0, 64):
            dirs[gs] = os.path.join(work, f"int4_g{gs}")
            convert(src, dirs[gs], ConvertOptions(expert_bits=4, dense_bits=4, io_bits=8, group_size=gs),
                    verbose=False)
        models = {"per_row": colibri.model_init(dirs[0]), "group64": colibri.model_init(dirs[64])}
        ref = colibri.model_init(src)
        rng = np.random.default_rng(7)
        prompt = [int(t) for t in rng.integers(2, cfg["vocab_size"], 32)]
        ids = [int(t) for t in rng.integers(2, cfg["vocab_size"], 64)]
        res = {"isa": _core.isa_active(), "threads": args.threads, "outliers": args.outliers,
               "config": {k: cfg[k] for k in ("hidden_size", "moe_intermediate_size", "intermediate_size",
                                              "num_hidden_layers", "n_routed_experts", "num_experts_per_tok")},
               "bytes": {k: sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.endswith(".safetensors"))
                         for k, d in (("per_row", dirs[0]), ("group64", dirs[64]))},
               "resident_bytes": {k: m.resident_bytes() for k, m in models.items()},
               "matmul": bench_matmul(args.rounds, args.outliers),
               "decode": bench_decode(models, prompt, args.tokens, args.rounds),
               "parity": parity(models, ref, ids)}
        for m in list(models.values()) + [ref]:
            m.close()
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
