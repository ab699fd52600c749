"""tools/bench_spec.py end to end on the embedded model (a tiny run: the tool, not the figures)."""
import json
import pathlib
import subprocess
import sys

TOOL = pathlib.Path(__file__).parent.parent / "tools" / "bench_spec.py"


def test_bench_spec_reports_every_depth_and_lossless_tokens(tmp_path):
    out = tmp_path / "spec.json"
    p = subprocess.run([sys.executable, str(TOOL), "--work", str(tmp_path), "--runs", "1", "--tokens", "8",
                        "--models", "embedded", "--fractions", "0.25", "--io", "direct", "--modes",
                        "greedy,sampled", "--depths", "0,2,auto", "--quiet-wait", "0", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert set(d["configs"]) == {"embedded 0.25 direct greedy", "embedded 0.25 direct sampled"}
    for rows in d["configs"].values():
        assert [r["depth"] for r in rows] == [0, 2, "auto"]
        for r in rows:
            assert r["same_tokens"] and r["tok_s"] > 0 and r["bytes_per_token"] > 0
            assert set(r["iteration_us"]) == {"draft", "verify", "absorb", "spec_python"}
    assert len(d["verdict"]) == 2 and "| depth 0 tok/s |" in p.stdout
    again = subprocess.run([sys.executable, str(TOOL), "--report", str(out)], capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout.strip() == p.stdout.strip()
    bad = subprocess.run([sys.executable, str(TOOL), "--models", "gpt"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--models" in bad.stderr
