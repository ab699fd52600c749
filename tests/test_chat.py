"""``python -m colibri chat``: streamed turns, warm reopen after a restart (no prefill of old turns,
byte-identical output), damaged session files discarded, :reset and :more."""
import os
import re
import subprocess
import sys

from conftest import DATA, GLM_STYLE_TEMPLATE, model_folder

ROOT = DATA.parent.parent
TURNS = ["def add(a, b):", "class Stack:", "import os"]


def chat(lines, hist, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="2", COLIBRI_USAGE_DIR=str(hist))
    p = subprocess.run([sys.executable, "-m", "colibri", "chat", "--temperature", "0", "--max-tokens", "12", *extra],
                       input="".join(line + "\n" for line in lines), capture_output=True, text=True, env=env,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return p


def answers(p):
    """The answers printed on stdout: each follows the '> ' input prompt (after the bare prompts of
    lines that print nothing, as :stats) and ends with a newline before the next prompt; split
    there, since the model's code may hold '> ' itself (`a > b`)."""
    assert p.stdout.startswith("> "), p.stdout[:80]
    out = []
    for a in p.stdout[2:].split("\n> "):
        while a.startswith("> "):
            a = a[2:]
        if a.strip():
            out.append(a)
    return out


def prefills(p):
    return [(int(a), int(b)) for a, b in re.findall(r"prefill (\d+) of (\d+) prompt tokens", p.stderr)]


def test_restarted_conversation_equals_the_uninterrupted_one(tmp_path):
    # --draft 0: with drafts the KV cache sometimes holds the row of a turn's last token too (a verify
    # forward computed it), and `auto` picks its depth by timing, so prefill counts would vary by one
    whole = chat(TURNS, tmp_path / "a", "--draft", "0")
    parts = [chat([t], tmp_path / "b", "--draft", "0") for t in TURNS]
    assert answers(whole) == [answers(p)[0] for p in parts]
    assert len(answers(whole)) == 3
    # every restart reopened the saved KV cache and prefilled only the new turn
    for i, p in enumerate(parts[1:], 1):
        assert f"reopened the conversation" in p.stderr and f"({i} turns" in p.stderr
        (new, total), = prefills(p)
        cached = int(re.search(r"(\d+) tokens in the KV cache", p.stderr).group(1))
        assert total - new == cached > 20             # every old token came from the reopened KV cache
    assert [n for n, _ in prefills(whole)][1:] == [prefills(p)[0][0] for p in parts[1:]]


def test_damaged_session_is_reported_and_discarded(tmp_path):
    chat(TURNS[:1], tmp_path)
    (f,) = [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    p = chat(TURNS[1:2], tmp_path)
    assert "discarded" in p.stderr and "reopened" not in p.stderr
    fresh = chat(TURNS[1:2], tmp_path / "fresh")
    assert answers(p) == answers(fresh)              # the damaged history was not used


def test_reset_more_and_stats(tmp_path):
    p = chat([TURNS[0], ":more", ":stats", ":reset", TURNS[0]], tmp_path)
    a = answers(p)
    assert len(a) == 3 and a[0] == a[2]                # after :reset the same question gets the same answer
    assert "new conversation" in p.stderr and p.stderr.count("[stats]") >= 4
    assert chat([TURNS[0]], tmp_path, "--no-save").stdout        # --no-save reads nothing either


def test_start_up_says_which_chat_format_is_used(tmp_path):
    """The embedded default model has no chat template: chat says so, and names the fallback."""
    p = chat([], tmp_path, "--no-save")
    # (the path is the subprocess's own package: from the checkout, or the installed one)
    assert re.search(r"\[colibri\] \S*models/default has no chat template \(chat_template\.jinja, or "
                     r"chat_template in tokenizer_config\.json\); using a plain chat format", p.stderr)
    # a model with a template: chat names it
    d = model_folder(tmp_path / "m", {"chat_template.jinja": GLM_STYLE_TEMPLATE})
    p = chat([], tmp_path, "--no-save", "--model", str(d))
    assert f"[colibri] chat template: {d / 'chat_template.jinja'}" in p.stderr
    assert "has no chat template" not in p.stderr


def test_turns_are_rendered_by_the_models_template(tmp_path):
    """With a chat template, every turn's prompt is the template's rendering of the whole
    conversation (as the API's chat() renders it), and the KV rows of the prefix it shares with
    the previous turn are reused."""
    from colibri import load
    from colibri.chat import ChatSession
    d = model_folder(tmp_path / "m", {"chat_template.jinja": GLM_STYLE_TEMPLATE})
    llm = load(str(d))
    s = ChatSession(llm, system="be brief", persist=False)
    first = s.ask(TURNS[0], max_tokens=6, temperature=0)
    assert llm.history[:first.prompt_tokens] == llm.chat_ids(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": TURNS[0]}])
    second = s.ask(TURNS[1], max_tokens=6, temperature=0)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": TURNS[0]},
            {"role": "assistant", "content": first.text}, {"role": "user", "content": TURNS[1]}]
    assert llm.history[:second.prompt_tokens] == llm.chat_ids(msgs)
    assert second.prefill_tokens < second.prompt_tokens - first.prompt_tokens // 2   # the prefix was reused
    llm.close()
