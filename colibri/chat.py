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


class ChatError(ValueError):
    """A chat that cannot start (its conversation file is held by another chat process)."""


class ContextFull(ValueError):
    """The next turn does not fit in the context."""


CONTEXT_POLICIES = ("stop", "drop-oldest")


class ChatSession:
    """A conversation with one LLM: turns, continuation, reset and persistence.

    context_policy: what a turn that does not fit in the context does: 'stop' (ContextFull, whose
    message says to :reset) or 'drop-oldest' (the oldest exchanges are dropped until it fits).
    A persisted conversation is locked (``<path>.lock``) while this session lives: a second chat
    on the same file is refused instead of overwriting it."""

    def __init__(self, llm, system: Optional[str] = None, path: Optional[str] = None, persist: bool = True,
                 context_policy: str = "stop"):
        if context_policy not in CONTEXT_POLICIES:
            raise ValueError(f"--context-policy must be one of {', '.join(CONTEXT_POLICIES)}, got {context_policy!r}")
        self.llm = llm
        self.system = system
        self.path = path if path is not None else session_path(llm.path)
        self.persist = persist
        self.context_policy = context_policy
        self.ids: List[int] = []            # the whole conversation, as token ids
        self.messages: List[dict] = []
        self.restored = False
        self.notice = ""
        self.warning = ""                   # the last failed save, for the front end to show
        self.dropped = 0                    # turns dropped by the last ask/more (drop-oldest)
        self._lock = _lock_file(self.path) if persist else None
        if persist:
            self._restore()
        if not self.ids:
            self._start()

    def close(self):
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _start(self):
        self.ids, self.messages = [], []
        if self.system:
            self.messages.append({"role": "system", "content": self.system})
        self.ids = self._head_ids()

    def _head_ids(self) -> List[int]:
        """Without a template: the fallback format's prefix and system message (with one, the
        template renders the whole conversation each turn)."""
        if self.llm.chat_template_source is not None:
            return []
        head = self.llm.chat_prefix() + (self.llm.chat_message("system", self.system) if self.system else "")
        return self.llm.encode(head, add_special_tokens=False) if head else []

    def _prompt_ids(self, text: str) -> List[int]:
        """The prompt of the next turn. With the model's own template: the whole conversation
        rendered by it (the engine reuses the KV rows of the prefix it shares with the last turn);
        without one, the new turn's fallback tokens appended to everything said so far."""
        if self.llm.chat_template_source is not None:
            return self.llm.chat_ids(self.messages + [{"role": "user", "content": text}])
        turn = self.llm.chat_message("user", text) + self.llm.chat_reply_start()
        return self.ids + self.llm.encode(turn, add_special_tokens=False)     # the format holds them

    def _fits(self, ids, kw) -> bool:
        from .session import positions_needed
        o = self.llm.options
        return positions_needed(len(ids), kw.get("max_tokens") or o.max_tokens,
                                o.draft if kw.get("draft") is None else kw["draft"]) <= self.llm.context

    def _drop_oldest(self) -> bool:
        """Drop the oldest user turn and its answer (the system message stays); the fallback
        format's ids are rendered again from the messages left. False when nothing is left."""
        first = next((i for i, m in enumerate(self.messages) if m["role"] == "user"), None)
        if first is None:
            return False
        end = first + 1
        while end < len(self.messages) and self.messages[end]["role"] == "assistant":
            end += 1
        del self.messages[first:end]
        if self.llm.chat_template_source is None:
            self.ids = self._head_ids() + self.llm.encode(
                "".join(self.llm.chat_message(m["role"], m["content"]) for m in self.messages
                        if m["role"] != "system"), add_special_tokens=False)
        return True

    def _room_for(self, build, kw) -> List[int]:
        self.dropped = 0
        ids = build()
        while not self._fits(ids, kw):
            if self.context_policy != "drop-oldest" or not self._drop_oldest():
                raise ContextFull(f"the conversation ({len(ids)} tokens) and the answer's max tokens exceed the "
                                  f"context of {self.llm.context} positions: :reset starts a new conversation "
                                  "(or start chat with --context-policy drop-oldest)")
            self.dropped += 1
            ids = build()
        return ids

    def ask(self, text: str, on_text=None, **kw):
        """One user turn: the answer streams to on_text; returns the Completion."""
        ids = self._room_for(lambda: self._prompt_ids(text), kw)
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
        ids = self._room_for(lambda: self.ids, kw)
        kw.setdefault("stop", STOPS)
        c = self.llm.complete(ids, on_text=on_text, **kw)
        self.ids = ids + list(c.token_ids)
        self.messages[-1]["content"] += c.text
        self.save()
        return c

    def reset(self):
        self._start()
        self.llm.session.forget()
        if self.persist and os.path.exists(self.path):
            os.remove(self.path)

    def save(self) -> bool:
        """Save the conversation (KV rows + history); a failure (a full disk, a folder made read-
        only) is kept in ``warning`` and returns False: the conversation goes on in memory."""
        if not self.persist:
            return True
        from . import kvstore
        try:
            # the KV rows cover the session's history (the last token of a turn is not forwarded yet)
            kvstore.save_session(self.path, self.llm.model, list(self.llm.history),
                                 meta={"ids": self.ids, "messages": self.messages, "system": self.system})
        except OSError as e:
            self.warning = f"the conversation was not saved to {self.path} ({e.strerror or e}); it goes on in memory"
            return False
        self.warning = ""
        return True

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
            self.llm.session.forget()
            return
        self.llm.session.adopt(history)
        self.ids = ids
        self.messages = list(meta.get("messages", []))
        self.restored = True
        n = sum(1 for m in self.messages if m["role"] == "user")
        self.notice = f"reopened the conversation of {self.path} ({n} turns, {len(history)} tokens in the KV cache)"

    def transcript(self) -> str:
        """The conversation so far, one '> question' line and its answer per turn (as it was shown)."""
        out = []
        for m in self.messages:
            if m["role"] == "user":
                out.append("> " + m["content"])
            elif m["role"] == "assistant":
                out.append(m["content"])
        return "\n".join(out)


class _FileLock:
    def __init__(self, fd):
        self.fd = fd

    def close(self):
        os.close(self.fd)


def _lock_file(path: str) -> Optional[_FileLock]:
    """An exclusive lock on ``path + '.lock'`` for this process's life (fcntl; None where there is
    none); ChatError when another process holds it."""
    try:
        import fcntl
    except ImportError:                     # not POSIX: no lock
        return None
    lock = path + ".lock"
    os.makedirs(os.path.dirname(os.path.abspath(lock)), exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise ChatError(f"another chat{f' (pid {other})' if other else ''} is using the conversation {path}: "
                        "give this one its own with --session NAME, or --no-save") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return _FileLock(fd)


HELP = """commands: :reset (new conversation)  :more (continue the last answer)  :stats  :help  :quit
Ctrl-C stops an answer; at the prompt it (or Ctrl-D) ends the chat."""


def run(args) -> int:
    from .api import load
    from .options import from_args
    from .session import check_room
    opts = from_args(args)
    llm = load(args.model, opts)
    try:
        # -n must leave room for a question: checked now, not after the first one is typed
        check_room(1, opts.max_tokens, opts.draft, llm.context, tokens_name="--max-tokens")
        session = ChatSession(llm, system=args.system, persist=not args.no_save,
                              path=None if args.session == "default" else session_path(llm.path, args.session),
                              context_policy=args.context_policy)
    except ValueError:
        llm.close()
        raise
    try:
        return _loop(llm, session, args)
    finally:
        session.close()
        llm.close()


def _loop(llm, session, args) -> int:
    import signal
    import threading

    from .sysinfo import peak_rss_bytes
    out = sys.stdout
    print(f"[colibri] {llm.path}: chat ({HELP})", file=sys.stderr)
    if llm.chat_template_source is not None:
        print(f"[colibri] chat template: {llm.chat_template_source}", file=sys.stderr)
    for note in llm.model_notes():
        print(f"[colibri] {note}", file=sys.stderr)
    if session.notice:
        print(f"[colibri] {session.notice}", file=sys.stderr)
    if session.restored and session.messages:
        print(session.transcript(), file=sys.stderr)
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
            # Ctrl-C during an answer ends the answer (the engine stops at the next token, the KV
            # stays consistent); a second one, before it has, ends the program
            cancel = threading.Event()
            previous = signal.getsignal(signal.SIGINT)

            def on_interrupt(signum, frame):
                if cancel.is_set():
                    raise KeyboardInterrupt
                cancel.set()
            in_main = threading.current_thread() is threading.main_thread()
            if in_main:
                signal.signal(signal.SIGINT, on_interrupt)
            try:
                if cmd == ":more":
                    last = session.more(on_text=write, cancel=cancel)
                else:
                    last = session.ask(line, on_text=write, cancel=cancel)
            finally:
                if in_main:
                    signal.signal(signal.SIGINT, previous)
            out.write("\n")
            if cancel.is_set():
                print("[colibri] answer stopped (Ctrl-C)", file=sys.stderr)
            if session.dropped:
                print(f"[colibri] the oldest {session.dropped} turn(s) were dropped to make room "
                      "(--context-policy drop-oldest)", file=sys.stderr)
            if session.warning:
                print(f"[colibri] warning: {session.warning}", file=sys.stderr)
            print(_stats_line(llm, last, peak_rss_bytes()), file=sys.stderr)
        except ValueError as e:
            print(f"[colibri] {e}", file=sys.stderr)
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
    from .options import add_arguments as add_options
    p.add_argument("--model", "-m", default=None, help="model directory (default: COLIBRI_MODEL, else the "
                                                        "embedded model)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--session", default="default", metavar="NAME",
                   help="which saved conversation of the model to continue (default: 'default')")
    p.add_argument("--no-save", action="store_true", help="do not save or reopen the conversation")
    p.add_argument("--context-policy", choices=CONTEXT_POLICIES, default="stop",
                   help="when a turn does not fit in the context: stop and say so (default; :reset starts "
                        "anew) or drop the oldest turns")
    add_options(p)
