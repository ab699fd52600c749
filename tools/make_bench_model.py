#!/usr/bin/env python3
"""Build the random ``glm_moe_dsa`` benchmark fixture with HF transformers.

The "medium" fixture (default) is a ~0.3 B parameter GLM-5.x-shaped MoE model:

    vocab 8192, hidden 1024, 8 layers (3 dense + 5 MoE), 16 MLA heads, 32 routed experts
    (top-8, 1 shared, moe_intermediate 512), DSA indexer (4 heads x 32, index_topk 4096).

Weights are random but reproducible: ``torch.manual_seed(1234)``, construction of
``GlmMoeDsaForCausalLM``, then every parameter with >= 2 dims is re-drawn from N(0, 0.02)
in ``named_parameters()`` order and every ``e_score_correction_bias`` is set to
``linspace(-0.1, 0.1, n_routed_experts)``.  1-D parameters (norm weights, LayerNorm bias)
keep their HF initial values.

Output (``--out DIR``, default ``bench_model/``):

    config.json            cfg.to_dict() (complete, not a diff against the defaults)
    model.safetensors      f32, written by save_pretrained (per-expert 2-D tensors)
    generation_config.json
    bench_manifest.json    seed, parameter count, config summary, library versions

``--int4 DST`` additionally converts the fixture into colibri's quantized container with
``python -m colibri convert OUT DST --expert-bits 4 --dense-bits 4 --io-bits 8``.
``--tiny`` builds a scaled-down model of the same architecture (for the tests).

Usage::

    python tools/make_bench_model.py --out /tmp/bench_model --int4 /tmp/bench_model_int4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SEED = 1234
INIT_STD = 0.02
MANIFEST_NAME = "bench_manifest.json"

#: The medium benchmark fixture.
MEDIUM = dict(
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=512,
    num_hidden_layers=8,
    first_k_dense_replace=3,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=32,
    num_experts_per_tok=8,
    n_shared_experts=1,
    q_lora_rank=256,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    index_topk=4096,
    index_head_dim=32,
    index_n_heads=4,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)

#: Same architecture, scaled down (tests): 1 dense + 1 MoE layer.
TINY = dict(
    MEDIUM,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=16,
    num_experts_per_tok=4,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    index_head_dim=16,
    index_n_heads=2,
)

#: Config keys echoed into the manifest.
SUMMARY_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "first_k_dense_replace", "num_attention_heads", "num_key_value_heads", "n_routed_experts",
    "num_experts_per_tok", "n_shared_experts", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "index_topk", "index_head_dim", "index_n_heads", "n_group",
    "topk_group", "norm_topk_prob", "routed_scaling_factor", "rope_parameters", "rms_norm_eps",
    "tie_word_embeddings", "max_position_embeddings", "mlp_layer_types", "indexer_types",
    "bos_token_id", "eos_token_id",
)


def config_kwargs(tiny: bool = False) -> dict:
    """A fresh copy of the keyword arguments of the fixture's ``GlmMoeDsaConfig``."""
    src = TINY if tiny else MEDIUM
    return json.loads(json.dumps(src))


def build_model(tiny: bool = False, seed: int = SEED):
    """The seeded random model (eval mode, float32) and its config."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = GlmMoeDsaConfig(**config_kwargs(tiny))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, INIT_STD)
        n_bias = 0
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-0.1, 0.1, b.numel(), dtype=torch.float32))
                n_bias += 1
        for name, p in model.named_parameters():  # in case a version makes it a parameter
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.linspace(-0.1, 0.1, p.numel(), dtype=torch.float32))
                n_bias += 1
    n_moe = sum(1 for t in cfg.mlp_layer_types if t == "sparse")
    if n_bias != n_moe:
        raise RuntimeError(f"found {n_bias} e_score_correction_bias tensors, expected {n_moe}")
    return model.eval(), cfg


def config_dict(cfg) -> dict:
    """``cfg.to_dict()`` made JSON-clean, with the architecture and dtype spelled out."""
    d = json.loads(json.dumps(cfg.to_dict(), default=str))
    d.pop("_name_or_path", None)
    d.pop("_attn_implementation_autoset", None)
    d["architectures"] = ["GlmMoeDsaForCausalLM"]
    d["model_type"] = "glm_moe_dsa"
    d["dtype"] = "float32"
    return d


def config_summary(cfg_dict: dict) -> dict:
    return {k: cfg_dict.get(k) for k in SUMMARY_KEYS}


def save_model(out: str, tiny: bool = False, seed: int = SEED, log=print) -> dict:
    """Build and write the fixture into ``out``; returns the manifest."""
    import torch
    import transformers

    t0 = time.perf_counter()
    model, cfg = build_model(tiny, seed)
    n_params = sum(p.numel() for p in model.parameters())
    n_buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    cfg_d = config_dict(cfg)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg_d, f, indent=2, sort_keys=True)
        f.write("\n")
    files = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    manifest = {
        "name": "tiny" if tiny else "medium",
        "seed": seed,
        "init": f"torch.manual_seed({seed}); GlmMoeDsaForCausalLM(cfg); every >=2-D parameter ~ "
                f"N(0, {INIT_STD}) in named_parameters() order; e_score_correction_bias = "
                "linspace(-0.1, 0.1, n_routed_experts); 1-D parameters keep the HF init",
        "n_params": int(n_params),
        "n_params_b": round(n_params / 1e9, 6),
        "n_buffers_saved": int(n_buffers),
        "dtype": "float32",
        "files": {n: os.path.getsize(os.path.join(out, n)) for n in files},
        "config_summary": config_summary(cfg_d),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "build_s": round(time.perf_counter() - t0, 2),
    }
    with open(os.path.join(out, MANIFEST_NAME), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
    log(f"[make_bench_model] {manifest['name']}: {n_params / 1e6:.1f} M parameters -> {out} "
        f"({sum(manifest['files'].values()) / 1e6:.1f} MB, {manifest['build_s']} s)")
    return manifest


def convert_int4(src: str, dst: str, log=print) -> None:
    """Run colibri's converter: int4 experts and dense weights, int8 embedding/lm_head."""
    cmd = [sys.executable, "-m", "colibri", "convert", src, dst,
           "--expert-bits", "4", "--dense-bits", "4", "--io-bits", "8"]
    log("[make_bench_model] " + " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()
        raise RuntimeError(f"colibri convert failed (rc {r.returncode}): {tail[-1] if tail else ''}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_model", help="output directory (default bench_model/)")
    ap.add_argument("--tiny", action="store_true", help="scaled-down model of the same architecture")
    ap.add_argument("--seed", type=int, default=SEED, help=f"torch seed (default {SEED})")
    ap.add_argument("--int4", default=None, metavar="DST",
                    help="also convert into colibri's int4 container in DST")
    args = ap.parse_args(argv)
    save_model(args.out, tiny=args.tiny, seed=args.seed)
    if args.int4:
        try:
            convert_int4(args.out, args.int4)
        except RuntimeError as e:
            print(f"[make_bench_model] {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
