"""Does speculation earn its keep? ``--draft auto`` against ``--draft 0`` on the bench fixture.

The fixture (tools/make_bench_model.py) gets a random MTP head — a useless drafter, the worst case
for speculation: every draft is rejected and every verify pays for extra rows and experts. The
auto policy must notice and stay within 5% of plain decoding. Runs alternate between the two
settings in fresh processes (the machine is noisy); medians and the ratio are reported.

    python tools/bench_draft.py --model /tmp/bench_model [--runs 5] [--tokens 64] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def add_random_mtp_head(src: str, dst: str, seed: int = 4321, std: float = 0.02) -> None:
    """Copy the f32 fixture to dst (weights linked, not copied) and add a random MTP layer
    `model.layers.{num_hidden_layers}.*` in the GLM-5 naming, as its own safetensors file."""
    from safetensors.numpy import save_file
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        target = os.path.join(dst, name)
        if os.path.lexists(target):
            os.remove(target)
        if name.endswith(".safetensors"):
            os.symlink(os.path.abspath(os.path.join(src, name)), target)
        elif os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), target)
    with open(os.path.join(src, "config.json")) as f:
        c = json.load(f)
    D, E, I = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
    H, Lq, Lkv = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    shared = I * c.get("n_shared_experts", 1)
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) * std).astype(np.float32)
    one = lambda n: np.ones(n, np.float32)
    p = f"model.layers.{c['num_hidden_layers']}."
    t = {
        p + "eh_proj.weight": w(D, 2 * D), p + "enorm.weight": one(D), p + "hnorm.weight": one(D),
        p + "shared_head.norm.weight": one(D), p + "input_layernorm.weight": one(D),
        p + "post_attention_layernorm.weight": one(D),
        p + "self_attn.q_a_proj.weight": w(Lq, D), p + "self_attn.q_a_layernorm.weight": one(Lq),
        p + "self_attn.q_b_proj.weight": w(H * (dn + dr), Lq),
        p + "self_attn.kv_a_proj_with_mqa.weight": w(Lkv + dr, D), p + "self_attn.kv_a_layernorm.weight": one(Lkv),
        p + "self_attn.kv_b_proj.weight": w(H * (dn + dv), Lkv), p + "self_attn.o_proj.weight": w(D, H * dv),
        p + "mlp.gate.weight": w(E, D), p + "mlp.gate.e_score_correction_bias": np.linspace(-0.1, 0.1, E, dtype=np.float32),
        p + "mlp.shared_experts.gate_proj.weight": w(shared, D), p + "mlp.shared_experts.up_proj.weight": w(shared, D),
        p + "mlp.shared_experts.down_proj.weight": w(D, shared),
    }
    for e in range(E):
        t[f"{p}mlp.experts.{e}.gate_proj.weight"] = w(I, D)
        t[f"{p}mlp.experts.{e}.up_proj.weight"] = w(I, D)
        t[f"{p}mlp.experts.{e}.down_proj.weight"] = w(D, I)
    save_file(t, os.path.join(dst, "model-mtp.safetensors"))


def run_once(model: str, prompt_ids, tokens: int, draft: str, threads: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        stats_path = f.name
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "colibri", "run", "--model", model, "--prompt-ids",
           ",".join(map(str, prompt_ids)), "--max-tokens", str(tokens), "--temperature", "0",
           "--draft", draft, "--stats-json", stats_path, "--quiet"]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    with open(stats_path) as f:
        stats = json.load(f)
    os.unlink(stats_path)
    return stats


def ensure_mtp_fixture(model: str, work: str) -> str:
    """The int4 container (MTP head int8) of the fixture with a random MTP head, built in WORK
    when missing; returns its folder."""
    f32 = os.path.join(work, "f32_mtp")
    int4 = os.path.join(work, "int4_mtp")
    if not os.path.exists(os.path.join(int4, "config.json")):
        add_random_mtp_head(model, f32)
        subprocess.run([sys.executable, "-m", "colibri", "convert", f32, int4, "--expert-bits", "4",
                        "--dense-bits", "4", "--io-bits", "8", "--mtp-bits", "8"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return int4


def compare(model: str, runs: int = 5, tokens: int = 64, prompt_len: int = 32, threads: int = 2,
            log=print, prompt=None) -> dict:
    """--draft 0 and --draft auto in alternating fresh processes; medians, ratios and samples."""
    if prompt is None:
        prompt = [(i * 37 + 11) % 8192 for i in range(prompt_len)]
    samples = {"0": [], "auto": []}
    e2e = {"0": [], "auto": []}
    detail = {"0": [], "auto": []}
    run_once(model, prompt, 8, "0", threads)                      # warm-up (page cache)
    for r in range(runs):
        for draft in (("0", "auto") if r % 2 == 0 else ("auto", "0")):
            s = run_once(model, prompt, tokens, draft, threads)
            samples[draft].append(s["decode_tok_s"])
            e2e[draft].append(s["prefill_s"] + s["decode_s"])
            detail[draft].append({k: s[k] for k in ("decode_tok_s", "drafts_proposed", "drafts_accepted",
                                                    "tokens_per_forward", "tokens")})
            log(f"  run {r + 1} --draft {draft:4s}: {s['decode_tok_s']:7.1f} tok/s, "
                f"{s['drafts_proposed']} drafts proposed, {s['drafts_accepted']} accepted")
    if detail["0"][0]["tokens"] != detail["auto"][0]["tokens"]:
        raise SystemExit("--draft auto changed the greedy output: speculation is not lossless")
    med0, meda = statistics.median(samples["0"]), statistics.median(samples["auto"])
    t0, ta = statistics.median(e2e["0"]), statistics.median(e2e["auto"])
    return {"draft0_tok_s": med0, "auto_tok_s": meda, "auto_over_draft0": meda / med0,
            "draft0_total_s": t0, "auto_total_s": ta, "auto_time_over_draft0": ta / t0,
            "runs": runs, "tokens": tokens, "samples": samples,
            "detail": [{k: v for k, v in d.items() if k != "tokens"} for d in detail["auto"]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the f32 bench fixture (tools/make_bench_model.py)")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "colibri_bench_draft"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    int4 = ensure_mtp_fixture(args.model, args.work)
    res = compare(int4, args.runs, args.tokens, threads=args.threads)
    print(f"\n| setting | decode tok/s (median of {args.runs}) |\n|---|---|\n"
          f"| --draft 0 | {res['draft0_tok_s']:.1f} |\n| --draft auto (random MTP head) | {res['auto_tok_s']:.1f} |\n"
          f"| auto / 0 | {res['auto_over_draft0']:.3f} |\n\n"
          f"generation wall time (prefill + decode), median: --draft 0 {res['draft0_total_s']:.3f}s, "
          f"--draft auto {res['auto_total_s']:.3f}s, auto / 0 = {res['auto_time_over_draft0']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
