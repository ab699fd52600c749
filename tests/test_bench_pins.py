"""tools/bench_pins.py: pins learned on some prompts, measured on held-out ones (embedded model)."""
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_pins.py"
MODEL = Path(__file__).resolve().parent.parent / "colibri" / "models" / "default"


def _moe_layers():
    cfg = json.loads((MODEL / "config.json").read_text())
    return cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]


def test_pins_learned_on_other_prompts_are_measured_on_held_out_ones(tmp_path):
    out = tmp_path / "pins.json"
    p = subprocess.run([sys.executable, str(TOOL), "--learn", "3", "--held", "2", "--tokens", "8",
                        "--cache", "2", "--pins", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert len(d["learn_prompts"]) == 3 and len(d["heldout_prompts"]) == 2
    assert not set(d["learn_prompts"]) & set(d["heldout_prompts"])
    r = d["results"]
    assert set(r) == {f"{c} | {s}" for c in ("LRU 2", "LRU 2 + 1 pins", "LRU 3") for s in ("held-out", "in-sample")}
    assert r["LRU 2 + 1 pins | held-out"]["pinned_experts"] == _moe_layers()     # one per MoE layer
    assert r["LRU 2 | held-out"]["pinned_experts"] == 0
    for v in r.values():
        assert 0.0 <= v["hit_rate"] <= 1.0 and v["decode_tok_s"] > 0
    assert "| LRU 2 + 1 pins | held-out |" in p.stdout
