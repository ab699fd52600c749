"""The layer under every front end (issue 15): imports that point down, one generation driver, one
Options object reaching every subcommand and colibri.load, and the behaviour users of llama.cpp
expect from ``run`` and ``chat``."""
import ast
import errno
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import DATA

ROOT = DATA.parent.parent
PKG = ROOT / "colibri"
FRONT_ENDS = {"cli", "runner", "chat", "server", "plan", "convert", "parity"}


# -- structure -------------------------------------------------------------------------------------

def _imports():
    """module -> the colibri modules it imports anywhere (function-level imports included)."""
    mods = {p.stem: p for p in PKG.glob("*.py")}
    mods["_core"] = PKG / "_core.pyx"
    graph = {}
    for name, path in mods.items():
        src, deps = path.read_text(), set()
        if path.suffix == ".pyx":
            for m in re.finditer(r"^\s*from\s+\.(\w*)\s+import\s+([\w, ]+)", src, re.M):
                deps |= {m.group(1)} if m.group(1) else {x.strip() for x in m.group(2).split(",")}
            deps |= set(re.findall(r"^\s*(?:import|from)\s+colibri\.(\w+)", src, re.M))
        else:
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.ImportFrom) and node.level == 1:
                    deps |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("colibri"):
                    parts = node.module.split(".")
                    deps |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
                elif isinstance(node, ast.Import):
                    deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("colibri.")}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def test_imports_form_no_circle_and_nothing_imports_a_front_end():
    graph = _imports()
    assert {"session", "options", "cli", "_core"} <= set(graph)
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", f"import circle: {' -> '.join(path + [m])}"
        state[m] = "open"
        for d in sorted(graph[m]):
            visit(d, path + [m])
        state[m] = "done"
    for m in sorted(graph):
        visit(m, [])
    for m, deps in graph.items():
        for d in deps & FRONT_ENDS:
            assert m in ("cli", "__main__") and (d != "cli" or m == "__main__"), f"{m} imports the front end {d}"


def test_one_generation_driver():
    """Only colibri.session drives spec_decode; the front ends call Session.generate."""
    callers = [p.name for p in PKG.glob("*.py") if ".spec_decode(" in p.read_text()]
    assert callers == ["session.py"]
    for name in ("runner.py", "api.py", "parity.py"):
        assert "generate(" in (PKG / name).read_text()
    assert "Session(" in (ROOT / "tests" / "conftest.py").read_text()


def _help(*argv):
    from colibri.cli import build_parser
    ap = build_parser()
    sub = next(a for a in ap._actions if a.dest == "command").choices[argv[0]]
    return sub.format_help()


def test_every_subcommand_takes_every_option_it_can_use():
    from dataclasses import fields

    from colibri.options import Options, flag_of
    from colibri.plan import PLAN_OPTIONS
    every = {f.name: flag_of(f) for f in fields(Options)}
    engine = [every[f.name] for f in fields(Options) if f.metadata["group"] == "engine"]
    per_request = {"--json-schema", "--grammar"}       # serve: each request constrains its own output
    for cmd in ("run", "chat", "serve"):
        text = _help(cmd)
        missing = [flag for flag in every.values() if flag not in text and not (cmd == "serve" and flag in per_request)]
        assert not missing, f"{cmd} --help lacks {missing}"
    assert all(flag in _help("parity") for flag in engine)
    assert all(every[name] in _help("plan") for name in PLAN_OPTIONS)


def test_load_reaches_the_engine_and_generation_fields():
    import colibri
    llm = colibri.load(DATA / "tiny_dense", dense_bits=8, absorb="never", act_block=64, idot=1, top_k=1,
                       temperature=1.5, max_tokens=6, draft=0)
    try:
        m = llm.model
        assert (m.dense_bits, m.absorb, m.act_block, m.idot) == (8, 0, 64, 1)
        # top_k 1 at temperature 1.5 is greedy: the generation settings reached the sampler
        ids = [3, 14, 15, 92, 65]
        assert llm.complete(ids).token_ids == llm.complete(ids, temperature=0, top_k=0).token_ids
        with pytest.raises(TypeError, match="frobnicate"):
            llm.complete(ids, frobnicate=1)
    finally:
        llm.close()


def test_import_colibri_sets_no_openmp_variables():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = ("import os, colibri, colibri.plan, colibri.convert\n"
            "before = (os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))\n"
            "import colibri._core\n"
            "after = (os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))\n"
            "print(before == (None, None), after != (None, None))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "True"]


# -- run -------------------------------------------------------------------------------------------

def colibri(*args, env=None, check=True, **kw):
    full = dict(os.environ, OMP_NUM_THREADS="2", **(env or {}))
    p = subprocess.run([sys.executable, "-m", "colibri", *map(str, args)], capture_output=True, text=True,
                       env=full, timeout=300, cwd=ROOT, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}")
    return p


IDS = "3,14,15,92,65,35,89,79"


def test_run_reports_seed_and_why_it_stopped(tmp_path):
    stats = tmp_path / "s.json"
    p = colibri("run", "-m", DATA / "tiny_dense", "--prompt-ids", IDS, "-n", 7, "--seed", 1234, "--ignore-eos",
                "--stats-json", stats)
    assert "stopped: --max-tokens reached | seed 1234" in p.stderr
    s = json.loads(stats.read_text())
    assert (s["finish_reason"], s["stopped_by"], s["seed"], len(s["tokens"])) == ("length", "length", 1234, 7)
    # without --seed one is drawn and printed; the same seed gives the same tokens again
    p = colibri("run", "-m", DATA / "tiny_dense", "--prompt-ids", IDS, "-n", 7, "--ignore-eos", "--stats-json", stats)
    seed = int(re.search(r"seed (\d+)", p.stderr).group(1))
    first = json.loads(stats.read_text())["tokens"]
    colibri("run", "-m", DATA / "tiny_dense", "--prompt-ids", IDS, "-n", 7, "--ignore-eos", "--seed", seed,
            "--stats-json", stats)
    assert json.loads(stats.read_text())["tokens"] == first


def test_run_stop_string_cuts_the_text(tmp_path):
    whole = colibri("run", "def add(a, b):", "-n", 40, "-t", 0, "-q", "--ignore-eos").stdout.rstrip("\n")
    assert len(whole) > 20
    cut = whole[len(whole) // 2:len(whole) // 2 + 4]
    at = whole.find(cut)
    stats = tmp_path / "s.json"
    p = colibri("run", "def add(a, b):", "-n", 40, "-t", 0, "--ignore-eos", "--stop", "@@never@@", "--stop", cut,
                "--stats-json", stats)
    assert p.stdout.rstrip("\n") == whole[:at].rstrip("\n")     # run ends its output with one newline
    assert "stopped: stop string" in p.stderr
    s = json.loads(stats.read_text())
    assert (s["finish_reason"], s["stopped_by"]) == ("stop", "stop")


def test_run_top_k_one_and_penalties_from_the_command_line():
    greedy = colibri("run", "-m", DATA / "tiny_dense", "--prompt-ids", IDS, "-n", 12, "-t", 0, "-q").stdout
    assert colibri("run", "-m", DATA / "tiny_dense", "--prompt-ids", IDS, "-n", 12, "-t", 1.5, "--top-k", 1,
                   "-q").stdout == greedy
    penalized = colibri("run", "-m", DATA / "tiny_dense", "--prompt-ids", IDS, "-n", 12, "-t", 0, "-q",
                        "--repeat-penalty", 3, "--frequency-penalty", 2).stdout
    assert penalized != greedy


@pytest.mark.parametrize("args,env,msg", [
    (["hello", "--prompt-ids", "1,2"], {}, "not both"),
    (["--prompt-ids", "1,2", "--ram", "-1"], {}, "--ram must be a positive number"),
    (["--prompt-ids", "1,2"], {"COLIBRI_RAM_GB": "lots"}, "COLIBRI_RAM_GB='lots' is not a number"),
    (["--prompt-ids", "1,2"], {"COLIBRI_THREADS": "-3"}, "COLIBRI_THREADS must be an integer >= 0"),
    (["--prompt-ids", "1,2", "--threads", "-1"], {}, "--threads must be an integer >= 0"),
    (["--prompt-ids", "1,2", "--pin-gb", "0"], {}, "--pin-gb must be a positive number"),
    (["--prompt-ids", "1,2", "--top-k", "-2"], {}, "--top-k must be an integer >= 0"),
    (["--prompt-ids", "1,2", "--repeat-penalty", "0"], {}, "--repeat-penalty must be a number > 0"),
    (["--prompt-ids", "1,2", "--stats-json", "/nonexistent/dir/s.json"], {}, "--stats-json /nonexistent/dir"),
    (["--prompt-ids", "1,2", "--trace", "/nonexistent/t.jsonl"], {}, "--trace /nonexistent"),
])
def test_run_refuses_bad_settings_by_their_own_name(args, env, msg):
    t0 = time.perf_counter()
    p = colibri("run", "-m", DATA / "tiny_dense", *args, env=env, check=False)
    assert p.returncode == 1 and msg in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""      # refused before any generation


@pytest.mark.parametrize("line,what", [("99 0 7", "layer 99"), ("3 500 7", "expert 500")])
def test_run_pin_entries_for_missing_layers_or_experts_name_the_file(tmp_path, line, what):
    pins = tmp_path / "pins.txt"
    pins.write_text(f"4 0 5\n{line}\n")
    p = colibri("run", "-m", DATA / "tiny_dense", "--prompt-ids", "1,2", "--pin", pins, check=False)
    assert p.returncode == 1 and f"--pin {pins}:2: {what} does not exist" in p.stderr, p.stderr


@pytest.mark.parametrize("var", ["COLIBRI_MODEL", "COLI_MODEL"])
def test_run_takes_the_model_from_colibri_model(var):
    p = colibri("run", "--prompt-ids", IDS, "-n", 3, "-t", 0, env={var: str(DATA / "tiny_dense")})
    assert f"{DATA / 'tiny_dense'}: " in p.stderr and "embedded default model" not in p.stderr
    assert ("COLI_MODEL is now COLIBRI_MODEL" in p.stderr) == (var == "COLI_MODEL")


def test_run_into_a_closed_pipe_ends_quietly():
    """`colibri run ... | head -c 5`: the reader goes away; exit 0, no traceback."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    p = subprocess.Popen([sys.executable, "-m", "colibri", "run", "def f(x):", "-n", "1500", "-t", "0",
                          "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    assert len(p.stdout.read(5)) == 5
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "Broken pipe" not in err


# -- chat ------------------------------------------------------------------------------------------

def _chat(lines, hist, *extra, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="2", COLIBRI_USAGE_DIR=str(hist))
    p = subprocess.run([sys.executable, "-m", "colibri", "chat", "-t", "0", "-n", "12", *extra],
                       input="".join(line + "\n" for line in lines), capture_output=True, text=True, env=env,
                       timeout=300, cwd=ROOT)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_chat_ctrl_c_stops_the_answer_not_the_chat(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="2", COLIBRI_USAGE_DIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-m", "colibri", "chat", "-t", "0", "-n", "1500", "--ignore-eos",
                          "--no-save"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env, cwd=ROOT)
    p.stdin.write(b"def add(a, b):\n")
    p.stdin.flush()
    got = b""
    while len(got) < 40:                      # the "> " prompt, then the answer streaming
        chunk = os.read(p.stdout.fileno(), 4096)
        assert chunk, p.stderr.read().decode()
        got += chunk
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(b"class Stack:\n:stats\n:quit\n", timeout=300)
    err = err.decode()
    assert p.returncode == 0, err
    assert "answer stopped (Ctrl-C)" in err and "Traceback" not in err
    assert err.count("[stats] ") >= 2                     # the second question was answered


def test_chat_full_context_says_what_to_do_or_drops_old_turns(tmp_path):
    turns = ["def add(a, b):", "class Stack:", "import os", "x = [1, 2, 3]"]
    p = _chat(turns, tmp_path / "a", "--context", "60", "--no-save")
    assert ":reset starts a new conversation" in p.stderr
    p = _chat(turns, tmp_path / "b", "--context", "60", "--no-save", "--context-policy", "drop-oldest")
    assert "were dropped to make room" in p.stderr and "exceed the context" not in p.stderr
    assert p.stderr.count("[stats] ") == len(turns)


def test_chat_checks_max_tokens_at_start_up(tmp_path):
    p = _chat(["never read"], tmp_path, "-n", "100000", check=False)
    assert p.returncode == 1 and "--max-tokens (100000)" in p.stderr and "context" in p.stderr
    assert "Traceback" not in p.stderr


def test_chat_shows_the_reopened_conversation(tmp_path):
    _chat(["def add(a, b):"], tmp_path)
    p = _chat([":quit"], tmp_path)
    assert "reopened the conversation" in p.stderr and "> def add(a, b):" in p.stderr


def test_a_failed_save_is_a_warning_and_a_second_chat_is_refused(tmp_path, monkeypatch):
    import colibri
    from colibri import kvstore
    from colibri.chat import ChatError, ChatSession

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    llm = colibri.load(max_tokens=4, temperature=0, context=128, ignore_eos=True)
    try:
        path = str(tmp_path / "conv.kv")
        s = ChatSession(llm, path=path)
        with pytest.raises(ChatError, match="--session NAME"):
            ChatSession(llm, path=path)               # the first one holds the conversation
        monkeypatch.setattr(kvstore, "save_session", full_disk)
        c = s.ask("def add(a, b):")
        assert c.completion_tokens == 4 and "No space left" in s.warning and "goes on in memory" in s.warning
        monkeypatch.undo()
        s.ask("class Stack:")
        assert s.warning == "" and os.path.exists(path)
        s.close()
        ChatSession(llm, path=path).close()           # free again once the first is closed
    finally:
        llm.close()


# -- parity ----------------------------------------------------------------------------------------

def _ref(name="tiny_dsa"):
    return json.loads((DATA / name / "ref.json").read_text())


def _parity(model, ref, tmp_path, *extra):
    path = tmp_path / "ref.json"
    path.write_text(json.dumps(ref))
    return colibri("parity", model, path, *extra, check=False)


def test_parity_help_specifies_the_reference_format():
    text = _help("parity")
    for field in ("prompt_ids", "full_ids", "tf_pred", "logits", "[T, V]", "--max-logit-diff"):
        assert field in text


def test_parity_says_when_the_reference_is_ambiguous(tmp_path):
    """A reference whose greedy continuation leaves its own teacher forcing at some position (as
    transformers' prefix and full forwards do on a DSA top-k tie): greedy is compared up to it,
    and the verdict says so instead of a bare FAILED."""
    from colibri import model_init
    ref = _ref()
    P = len(ref["prompt_ids"])
    full = ref["full_ids"][:P + 3] + [(t * 7 + 3) % 256 for t in ref["full_ids"][P + 3:]]
    m = model_init(DATA / "tiny_dsa")
    pred, logits = m.forward_all(full)          # what a full forward over this sequence predicts
    m.close()
    ref.update(full_ids=full, tf_pred=[int(t) for t in pred], logits=logits.tolist())
    assert pred[P + 2] != full[P + 3]
    p = _parity(DATA / "tiny_dsa", ref, tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"ambiguous at position {P + 2}" in p.stdout and "greedy:          4/4 tokens" in p.stdout
    assert "PARITY OK" in p.stdout
    res = json.loads(_parity(DATA / "tiny_dsa", ref, tmp_path, "--json").stdout)
    assert res["ambiguous_at"] == P + 2 and res["pass"] is True


def test_parity_logit_tolerance_is_part_of_the_verdict(tmp_path):
    ref = _ref()
    ref["logits"][7][3] += 0.05                 # argmaxes unchanged, one logit off by 0.05
    p = _parity(DATA / "tiny_dsa", ref, tmp_path)
    assert p.returncode == 1 and "PARITY FAILED" in p.stdout and "tolerance" in p.stdout
    assert "teacher forcing: 32/32" in p.stdout
    assert _parity(DATA / "tiny_dsa", ref, tmp_path, "--max-logit-diff", "0.1").returncode == 0


@pytest.mark.parametrize("change,msg", [
    (lambda r: r.update(tf_pred=r["tf_pred"][:-1]), "'tf_pred' has 31 entries, 'full_ids' 32"),
    (lambda r: r.update(prompt_ids=[]), "'prompt_ids' is empty"),
    (lambda r: r.update(full_ids=[9] + r["full_ids"][1:]), "does not start with 'prompt_ids'"),
    (lambda r: r.update(logits=[row[:10] for row in r["logits"]]), "reference logits have shape [32, 10]"),
    (lambda r: r.update(logits=r["logits"][:5]), "'logits' has shape [5, 256], expected [32, V]"),
    (lambda r: r["full_ids"].__setitem__(20, 4096), "outside this model's vocabulary"),
    (lambda r: r.update(tf_pred="x"), "'tf_pred' must be a list of token ids"),
])
def test_parity_refuses_a_malformed_reference(tmp_path, change, msg):
    ref = _ref()
    change(ref)
    p = _parity(DATA / "tiny_dsa", ref, tmp_path)
    assert p.returncode == 1 and msg in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_readme_documents_every_option_and_switch():
    from dataclasses import fields

    from colibri.options import SWITCHES, Options, flag_of
    text = (ROOT / "README.md").read_text()
    assert [flag_of(f) for f in fields(Options) if not re.search("`" + re.escape(flag_of(f)) + "[` ,]", text)] == []
    assert [k for k in SWITCHES if f"`COLIBRI_{k}`" not in text] == []
