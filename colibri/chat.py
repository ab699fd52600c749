"""``python -m colibri chat``: an interactive conversation that streams its answers and survives
restarts.

The conversation is kept as token ids. With the model's own chat template each turn renders the
whole conversation through it; without one, the new user message's tokens (in a fallback format)
are appended to everything said so far. Either way the engine reuses the KV rows of the prefix the
prompt shares with the last turn, so it prefills about only the new turn. After every turn the KV cache and
the token history are saved next to the model (``colibri.kvstore``: crash-safe, checksummed); the
next ``chat`` reopens them without prefilling old turns. A damaged file is reported and discarded.
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional

SESSION_FILE = ".colibri_chat.kv"
STOPS = ["<|user|>", "<|system|>"]


def session_path(model_dir: str, name: str = "default") -> str:
    """Where the chat session of model_dir is saved: next to the model when its folder is
    writable, else under ~/.cache/colibri/chat/ (COLIBRI_USAGE_DIR, used by the tests, wins)."""
    from .usage import model_state_path
    suffix = "" if name == "default" else f".{name}"
    return model_state_path(model_dir, SESSION_FILE + suffix, "chat", suffix + ".kv")


class ChatSession:
    """A conversation with one LLM: turns, continuation, reset and persistence."""

    def __init__(self, llm, system: Optional[str] = None, path: Optional[str] = None, persist: bool = True):
        self.llm = llm
        self.system = system
        self.path = path if path is not None else session_path(llm.path)
        self.persist = persist
        self.ids: List[int] = []            # the whole conversation, as token ids
        self.messages: List[dict] = []
        self.restored = False
        self.notice = ""
        if persist:
            self._restore()
        if not self.ids:
            self._start()

    def _start(self):
        self.ids, self.messages = [], []
        if self.system:
            self.messages.append({"role": "system", "content": self.system})
        if self.llm.chat_template_source is not None:
            return                          # the template renders the whole conversation each turn
        head = self.llm.chat_prefix() + (self.llm.chat_message("system", self.system) if self.system else "")
        self.ids = self.llm.encode(head, add_special_tokens=False) if head else []

    def _prompt_ids(self, text: str) -> List[int]:
        """The prompt of the next turn. With the model's own template: the whole conversation
        rendered by it (the engine reuses the KV rows of the prefix it shares with the last turn);
        without one, the new turn's fallback tokens appended to everything said so far."""
        if self.llm.chat_template_source is not None:
            return self.llm.chat_ids(self.messages + [{"role": "user", "content": text}])
        turn = self.llm.chat_message("user", text) + self.llm.chat_reply_start()
        return self.ids + self.llm.encode(turn, add_special_tokens=False)     # the format holds them

    def ask(self, text: str, on_text=None, **kw):
        """One user turn: the answer streams to on_text; returns the Completion."""
        ids = self._prompt_ids(text)
        kw.setdefault("stop", STOPS)
        c = self.llm.complete(ids, on_text=on_text, **kw)
        self.ids = ids + list(c.token_ids)
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": c.text}]
        self.save()
        return c

    def more(self, on_text=None, **kw):
        """Continue the last answer (after it stopped at max_tokens)."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise ValueError("there is no answer to continue")
        kw.setdefault("stop", STOPS)
        c = self.llm.complete(self.ids, on_text=on_text, **kw)
        self.ids = self.ids + list(c.token_ids)
        self.messages[-1]["content"] += c.text
        self.save()
        return c

    def reset(self):
        self._start()
        self.llm.history = []
        if self.persist and os.path.exists(self.path):
            os.remove(self.path)

    def save(self):
        if not self.persist:
            return
        from . import kvstore
        # the KV rows cover llm.history (the last token of a turn is not forwarded yet)
        kvstore.save_session(self.path, self.llm.model, list(self.llm.history),
                             meta={"ids": self.ids, "messages": self.messages, "system": self.system})

    def _restore(self):
        from . import kvstore
        try:
            got = kvstore.load_session(self.path, self.llm.model)
        except kvstore.SessionError as e:
            self.notice = f"saved conversation discarded: {e}"
            try:
                os.remove(self.path)
            except OSError:
                pass
            return
        if got is None:
            return
        history, meta = got
        ids = [int(t) for t in meta.get("ids", [])]
        if ids[:len(history)] != list(history) or meta.get("system") != self.system:
            self.notice = f"saved conversation of {self.path} does not match (other system prompt?); starting anew"
            self.llm.history = []
            return
        self.llm.history = list(history)
        self.ids = ids
        self.messages = list(meta.get("messages", []))
        self.restored = True
        n = sum(1 for m in self.messages if m["role"] == "user")
        self.notice = f"reopened the conversation of {self.path} ({n} turns, {len(history)} tokens in the KV cache)"


HELP = """commands: :reset (new conversation)  :more (continue the last answer)  :stats  :help  :quit"""


def run(args) -> int:
    from .api import Options, load
    from .runner import peak_rss_bytes
    kw = dict(cache_experts=args.cache_experts, threads=args.threads, ram_gb=args.ram, io_threads=args.io_threads,
              prefetch=not args.no_prefetch, direct=args.direct, autopin=not args.no_autopin, pin=args.pin,
              pin_gb=args.pin_gb, warm_experts=not args.lazy_experts, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
              draft=args.draft, batch=args.batch)
    llm = load(args.model, Options.from_env(**kw))
    session = ChatSession(llm, system=args.system, persist=not args.no_save)
    out = sys.stdout
    print(f"[colibri] {llm.path}: chat ({HELP})", file=sys.stderr)
    if llm.chat_template_source is not None:
        print(f"[colibri] chat template: {llm.chat_template_source}", file=sys.stderr)
    for note in llm.model_notes():
        print(f"[colibri] {note}", file=sys.stderr)
    if session.notice:
        print(f"[colibri] {session.notice}", file=sys.stderr)
    last = None
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            break
        cmd = line.strip()
        if not cmd:
            continue
        try:
            if cmd in (":quit", ":exit", ":q"):
                break
            if cmd == ":help":
                print(HELP, file=sys.stderr)
                continue
            if cmd == ":reset":
                session.reset()
                print("[colibri] new conversation", file=sys.stderr)
                continue
            if cmd == ":stats":
                print(_stats_line(llm, last, peak_rss_bytes()), file=sys.stderr)
                continue
            write = lambda piece: (out.write(piece), out.flush())
            if cmd == ":more":
                last = session.more(on_text=write, seed=args.seed)
            else:
                last = session.ask(line, on_text=write, seed=args.seed)
            out.write("\n")
            print(_stats_line(llm, last, peak_rss_bytes()), file=sys.stderr)
        except ValueError as e:
            print(f"[colibri] {e}", file=sys.stderr)
    llm.close()
    return 0


def _stats_line(llm, c, rss) -> str:
    if c is None:
        return f"[stats] no turn yet | peak RSS {rss / 2**30:.2f} GiB"
    s = c.stats
    return (f"[stats] {c.completion_tokens} tokens, {s['decode_tok_s']:.1f} tok/s, "
            f"{s['tokens_per_forward']:.2f} tokens/forward, prefill {c.prefill_tokens} of {c.prompt_tokens} "
            f"prompt tokens, expert hit {100 * s['hit_rate']:.0f}%, peak RSS {rss / 2**30:.2f} GiB"
            + (" (stopped at max tokens: :more continues)" if c.finish_reason == "length" else ""))


def add_arguments(p) -> None:
    p.add_argument("--model", "-m", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", "-n", type=int, default=256, help="tokens per answer (default 256)")
    p.add_argument("--temperature", "-t", type=float, default=0.7, help="0 = greedy (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    p.add_argument("--seed", type=int, default=None, help="RNG seed for sampling")
    p.add_argument("--draft", default="auto", metavar="N|auto", help="speculative draft depth (default auto)")
    p.add_argument("--no-save", action="store_true", help="do not save or reopen the conversation")
    p.add_argument("--batch", type=int, default=0, metavar="N",
                   help="prompt tokens per prefill forward (0 = the whole prompt, in pieces only where the RAM budget is small)")
