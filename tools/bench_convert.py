#!/usr/bin/env python3
"""Conversion throughput at GLM-5's real widths: an FP8 (e4m3 + 128x128 block scales) checkpoint
shaped like GLM-5.x's release, converted with ``python -m colibri convert``, timed.

The checkpoint holds ``--layers`` MoE layers with ``--experts`` routed experts each (GLM-5.x has
256; fewer keep the file small — throughput per byte does not depend on the count), the
embedding and lm_head, in shards of ``--shard-gb``. The report gives source GB/s and the
projected time for the full FP8 release (``--full-gb``, 756 GB for GLM-5.2-FP8).

Usage::

    python tools/bench_convert.py --work /tmp/convbench --experts 32
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time

import numpy as np

# GLM-5.x widths (transformers' GlmMoeDsaConfig defaults)
GLM5 = dict(vocab_size=154880, hidden_size=6144, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512,
            qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, intermediate_size=12288,
            moe_intermediate_size=2048, num_experts_per_tok=8, n_shared_experts=1, index_topk=2048,
            index_head_dim=128, index_n_heads=32)
BLOCK = 128


def fp8_matrix(rng, O: int, I: int):
    """Random e4m3 codes of a [O, I] matrix (finite values only) and its f32 block scales."""
    codes = rng.integers(0, 0x7E, size=(O, I), dtype=np.uint8)          # positive finite codes
    codes |= (rng.integers(0, 2, size=(O, I), dtype=np.uint8) << 7)      # random sign
    scales = (rng.random(((O + BLOCK - 1) // BLOCK, (I + BLOCK - 1) // BLOCK), dtype=np.float32) * 1e-3 + 1e-4)
    return codes, scales


def bf16_random(rng, shape, one: bool = False) -> bytes:
    """Random BF16 bits: magnitudes in [2^-7, 2^-6) with random signs (1 ± that when one)."""
    if one:
        return (np.ones(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    bits = rng.integers(0x3C00, 0x3C80, size=shape, dtype=np.uint16)
    return (bits | (rng.integers(0, 2, size=shape, dtype=np.uint16) << 15)).tobytes()


def write_shard(path: str, tensors) -> int:
    """tensors: list of (name, dtype, shape, bytes); a safetensors file written in that order."""
    header, at = {}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(data)]}
        at += len(data)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for *_, data in tensors:
            f.write(data)
    return 8 + len(hb) + at


def layer_matrices(c: dict, li: int, n_experts: int):
    """(name, O, I) of the FP8 matrices of one MoE layer (attention, indexer, shared + routed experts)."""
    D, H, Lq, Lkv = c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    dn, dr, dv, Ie = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["moe_intermediate_size"]
    p = f"model.layers.{li}."
    mats = [(p + "self_attn.q_a_proj.weight", Lq, D), (p + "self_attn.q_b_proj.weight", H * (dn + dr), Lq),
            (p + "self_attn.kv_a_proj_with_mqa.weight", Lkv + dr, D),
            (p + "self_attn.kv_b_proj.weight", H * (dn + dv), Lkv), (p + "self_attn.o_proj.weight", D, H * dv),
            (p + "self_attn.indexer.wq_b.weight", c["index_n_heads"] * c["index_head_dim"], Lq),
            (p + "self_attn.indexer.wk.weight", c["index_head_dim"], D)]
    for e in ["shared_experts"] + [f"experts.{i}" for i in range(n_experts)]:
        mats += [(p + f"mlp.{e}.gate_proj.weight", Ie, D), (p + f"mlp.{e}.up_proj.weight", Ie, D),
                 (p + f"mlp.{e}.down_proj.weight", D, Ie)]
    return mats


def layer_vectors(c: dict, li: int, n_experts: int):
    D, p = c["hidden_size"], f"model.layers.{li}."
    return [(p + "input_layernorm.weight", (D,)), (p + "post_attention_layernorm.weight", (D,)),
            (p + "self_attn.q_a_layernorm.weight", (c["q_lora_rank"],)),
            (p + "self_attn.kv_a_layernorm.weight", (c["kv_lora_rank"],)),
            (p + "self_attn.indexer.k_norm.weight", (c["index_head_dim"],)),
            (p + "self_attn.indexer.k_norm.bias", (c["index_head_dim"],)),
            (p + "self_attn.indexer.weights_proj.weight", (c["index_n_heads"], D)),
            (p + "mlp.gate.weight", (n_experts, D)), (p + "mlp.gate.e_score_correction_bias", (n_experts,))]


def make_checkpoint(dst: str, layers: int, experts: int, shard_gb: float, seed: int = 0) -> int:
    """Write the FP8 checkpoint; returns its size in bytes."""
    rng = np.random.default_rng(seed)
    c = dict(GLM5, model_type="glm_moe_dsa", architectures=["GlmMoeDsaForCausalLM"], num_hidden_layers=layers,
             first_k_dense_replace=0, n_routed_experts=experts, n_group=1, topk_group=1, norm_topk_prob=True,
             routed_scaling_factor=2.5, rms_norm_eps=1e-5, indexer_types=["full"] * layers,
             rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, eos_token_id=[1],
             num_experts_per_tok=min(GLM5["num_experts_per_tok"], experts),
             quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]})
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    D, V = c["hidden_size"], c["vocab_size"]
    items = [("model.embed_tokens.weight", "BF16", (V, D), bf16_random(rng, (V, D))),
             ("lm_head.weight", "BF16", (V, D), bf16_random(rng, (V, D))),
             ("model.norm.weight", "BF16", (D,), bf16_random(rng, (D,), one=True))]
    for li in range(layers):
        for name, shape in layer_vectors(c, li, experts):
            items.append((name, "BF16", shape, bf16_random(rng, shape, one=name.endswith("norm.weight"))))
        for name, O, I in layer_matrices(c, li, experts):
            codes, scales = fp8_matrix(rng, O, I)
            items.append((name, "F8_E4M3", (O, I), codes.tobytes()))
            items.append((name + "_scale_inv", "F32", scales.shape, scales.tobytes()))
    total, shard, size, n = 0, [], 0, 0
    names = []
    for it in items + [None]:
        if it is None or (size and size + len(it[3]) > shard_gb * 1e9):
            fname = f"model-{n + 1:05d}.safetensors"
            total += write_shard(os.path.join(dst, fname), shard)
            names.append((fname, [t[0] for t in shard]))
            shard, size, n = [], 0, n + 1
            if it is None:
                break
        shard.append(it)
        size += len(it[3])
    index = {"metadata": {"total_size": total}, "weight_map": {t: f for f, ts in names for t in ts}}
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python tools/bench_convert.py --work /tmp/convbench --experts 32")
    ap.add_argument("--work", default="/tmp/colibri_convert_bench")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--shard-gb", type=float, default=5.0, help="source shard size (GLM-5.2-FP8: ~5 GB)")
    ap.add_argument("--full-gb", type=float, default=756.0, help="size of the full FP8 release (default 756)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint and container")
    a = ap.parse_args(argv)
    src, dst = os.path.join(a.work, "fp8"), os.path.join(a.work, "container")
    shutil.rmtree(a.work, ignore_errors=True)
    t = time.perf_counter()
    nbytes = make_checkpoint(src, a.layers, a.experts, a.shard_gb)
    print(f"[bench_convert] FP8 checkpoint: {nbytes / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "colibri", "convert", src, dst], env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return 1
    out = sum(os.path.getsize(os.path.join(dst, n)) for n in os.listdir(dst) if n.endswith(".safetensors"))
    gbs = nbytes / dt / 1e9
    res = {"source_bytes": nbytes, "output_bytes": out, "seconds": dt, "source_gb_s": gbs,
           "full_release_gb": a.full_gb, "projected_full_hours": a.full_gb / gbs / 3600}
    print(f"convert: {nbytes / 1e9:.2f} GB of FP8 -> {out / 1e9:.2f} GB container in {dt:.1f} s = "
          f"{gbs:.3f} GB/s of source; a {a.full_gb:.0f} GB release: {res['projected_full_hours']:.1f} h")
    print(json.dumps(res))
    if not a.keep:
        shutil.rmtree(a.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
