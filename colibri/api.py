"""The Python API: ``colibri.load(path=None, **options)`` returns an :class:`LLM`.

    import colibri
    llm = colibri.load()                                  # the embedded default model
    print(llm.generate("def fibonacci(n):", max_tokens=64, temperature=0))
    for piece in llm.stream("class Stack:", max_tokens=64):
        print(piece, end="", flush=True)
    llm.chat([{"role": "user", "content": "Write a function that adds two numbers."}])

One model per process, one generation at a time (a lock serialises callers). The KV cache of the
previous request is kept: a prompt that starts with the same tokens (the next turn of a
conversation, a fixed system prompt) prefills only what is new.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Iterator, List, Optional, Sequence

from .options import Options, env_get
from .session import Generation, Session

__all__ = ["Options", "LLM", "Completion", "load"]

#: What :meth:`LLM.complete` returns: the text, its token ids, usage, why it ended
#: (``finish_reason`` 'stop' or 'length'; ``stopped_by`` 'eos', 'stop', 'cancel' or 'length'), the
#: seed used and the stats (see colibri.session.Generation).
Completion = Generation


class LLM:
    """A loaded model with its tokenizer, KV cache and expert tiers. Build it with :func:`load`."""

    def __init__(self, path: Optional[str] = None, options: Optional[Options] = None):
        from ._core import model_init
        from .tokenizer import load_chat_template, load_tokenizer
        if path is None:
            from .models import default_model_dir
            path = default_model_dir()
        self.path = os.fspath(path)
        self.options = options or Options()
        # the text files first: a damaged tokenizer or template fails before the weights are mapped
        self.tokenizer = load_tokenizer(self.path)
        self.chat_template = load_chat_template(self.path)
        self.model = model_init(self.path, **self.options.engine_kwargs())
        self.cfg = self.model.cfg
        #: the expert workers holding the routed experts (colibri.cluster), or None
        self.cluster = None
        if self.options.cluster:
            self.cluster = self._start_cluster()
        #: the generation driver: tiers, KV cache, token history (colibri.session)
        self.session = Session(self.model, self.options, tokenizer=self.tokenizer)

    @property
    def context(self) -> int:
        """KV positions of the conversation."""
        return self.session.context

    @property
    def tiers(self):
        return self.session.tiers

    @property
    def lock(self) -> threading.Lock:
        """Held while a generation runs."""
        return self.session.lock

    @property
    def history(self) -> List[int]:
        """The tokens whose KV rows are valid, from position 0 (a prompt sharing a prefix with them
        prefills only the rest)."""
        return self.session.history

    # -- text -------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """Token ids of ``text``. ``add_special_tokens=False`` for text in a chat format, which
        holds every special token itself (as transformers' apply_chat_template tokenizes)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.path} has no tokenizer.json: pass token ids instead of text")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(list(ids))

    def _ids(self, prompt) -> List[int]:
        return self.session.check_ids(self.encode(prompt) if isinstance(prompt, str) else prompt)

    # -- generation -------------------------------------------------------------------------------

    def complete(self, prompt, stop=None, on_text=None, cancel: Optional[threading.Event] = None,
                 **settings) -> Completion:
        """Generate a continuation of ``prompt`` (text or token ids). ``settings``: any generation
        option (max_tokens, temperature, top_p, top_k, repeat_penalty, repeat_last_n,
        frequency_penalty, presence_penalty, seed, draft, ignore_eos, json_schema, grammar; None: the
        LLM's options).
        ``stop``: strings that end the generation (not included in the text); ``on_text(piece)``
        receives the text as it comes; ``cancel`` (an Event) ends it early. Returns a
        :class:`Completion`."""
        return self.session.generate(self._ids(prompt), stop=stop or (), on_text=on_text, cancel=cancel, **settings)

    def generate(self, prompt, **kw) -> str:
        """The generated text (see :meth:`complete` for the arguments)."""
        return self.complete(prompt, **kw).text

    def stream(self, prompt, **kw) -> Iterator[str]:
        """Yield the text as it is generated: whole UTF-8 characters, stop strings held back.
        Closing the iterator early stops the generation."""
        pieces: "queue.Queue" = queue.Queue()
        cancel = threading.Event()
        done = object()

        def work():
            try:
                pieces.put(self.complete(prompt, on_text=pieces.put, cancel=cancel, **kw))
            except BaseException as e:          # re-raised in the consumer
                pieces.put(e)
            pieces.put(done)

        th = threading.Thread(target=work, name="colibri-generate", daemon=True)
        th.start()
        try:
            while True:
                item = pieces.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Completion):
                    self.last = item
                    continue
                yield item
        finally:
            cancel.set()
            th.join()

    # Chat format. The model's own template (colibri.tokenizer: chat_template.jinja, or chat_template
    # in tokenizer_config.json) when it has one. Without one: GLM tokenizers (special tokens [gMASK],
    # <sop>, <|user|>, <|assistant|>) get GLM-5's format, as colibrì's gateway renders it:
    # [gMASK]<sop>, then <|system|>text, <|user|>text, <|assistant|><think></think>text, and
    # <|assistant|><think></think> to start the answer (no thinking); other tokenizers get a plain
    # "<|role|>\ntext\n" format. chat_format_note() says which, for front ends to show.

    @property
    def chat_template_source(self) -> Optional[str]:
        """The file of the model's chat template (chat_template.jinja or tokenizer_config.json), or
        None when the model has none and render_chat uses a fallback format."""
        return None if self.chat_template is None else self.chat_template.source

    def chat_format_note(self) -> Optional[str]:
        """None when the model has its own chat template; else one line saying which fallback
        format render_chat uses (chat and serve print it at start-up)."""
        if self.chat_template is not None:
            return None
        from .tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE
        return (f"{self.path} has no chat template ({CHAT_TEMPLATE_FILE}, or chat_template in "
                f"{TOKENIZER_CONFIG_FILE}); using {self.fallback_chat_format()}")

    def model_notes(self) -> List[str]:
        """What front ends tell the user at start-up: the fallback chat format of a model without
        a template, and dense attention past index_topk for a container without the DSA indexer."""
        return [n for n in (self.chat_format_note(), self.model.dsa_note()) if n]

    def fallback_chat_format(self) -> str:
        """The format used without a template, in words."""
        return ("GLM-5's chat format ([gMASK]<sop><|role|>text...)" if self.is_glm_chat()
                else "a plain chat format (<|role|>\\ntext\\n)")

    def is_glm_chat(self) -> bool:
        tok = self.tokenizer
        return tok is not None and all(tok.token_to_id(t) is not None
                                       for t in ("[gMASK]", "<sop>", "<|user|>", "<|assistant|>"))

    def chat_prefix(self) -> str:
        return "[gMASK]<sop>" if self.is_glm_chat() else ""

    def chat_message(self, role: str, content: str, tool_calls=()) -> str:
        """One message in the fallback format; an assistant's tool calls follow its text in GLM's
        format, and a tool's result is an ``observation`` message (GLM's role for it)."""
        from .tools import render_call
        if tool_calls:
            content = content.strip() + "".join(render_call(c) for c in tool_calls)
        role = "observation" if role == "tool" else role
        if self.is_glm_chat():
            return ("<|assistant|><think></think>" + content.strip()) if role == "assistant" else f"<|{role}|>{content}"
        return f"<|{role}|>\n{content}\n"

    def chat_reply_start(self, thinking: bool = False) -> str:
        """The opening of the assistant's turn; GLM's format opens a reasoning block when thinking."""
        if self.is_glm_chat():
            return "<|assistant|><think>" if thinking else "<|assistant|><think></think>"
        return "<|assistant|>\n"

    def render_chat(self, messages, tools=None, thinking: Optional[bool] = None) -> str:
        """The prompt text of a conversation ([{role, content}, ...]) in the model's chat format,
        the assistant's turn opened. ``tools`` (colibri.tools.Tool objects): the functions the
        model may call. Messages may be role 'tool' (a call's result) and an assistant's may hold
        ``tool_calls`` (colibri.tools.ToolCall objects). ``thinking``: whether the reply opens with
        a reasoning block (the template's ``enable_thinking``; None: the template's default)."""
        msgs = _check_messages(messages)
        tools = list(tools or [])
        if self.chat_template is not None:
            extra = {} if thinking is None else {"enable_thinking": bool(thinking)}
            return self.chat_template.render([_template_message(m) for m in msgs], add_generation_prompt=True,
                                             tools=[t.as_openai() for t in tools] or None, **extra)
        if tools:
            from .tools import render_tools
            sys_text = render_tools(tools)
            if msgs[0]["role"] == "system":
                msgs[0] = dict(msgs[0], content=msgs[0]["content"].rstrip() + "\n\n" + sys_text)
            else:
                msgs.insert(0, {"role": "system", "content": sys_text, "tool_calls": []})
        return (self.chat_prefix() + "".join(self.chat_message(m["role"], m["content"], m["tool_calls"])
                                             for m in msgs) + self.chat_reply_start(bool(thinking)))

    def chat_ids(self, messages) -> List[int]:
        """The prompt token ids of a conversation: render_chat, tokenized without the tokenizer's
        own special tokens (the chat format holds them)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def chat(self, messages, **kw) -> str:
        """The assistant's answer to a conversation; the turn ends at the next role tag."""
        kw.setdefault("stop", ["<|user|>", "<|system|>"])
        return self.complete(self.chat_ids(messages), **kw).text

    def special_token_ids(self) -> dict:
        """{text: id} of GLM's tool-call tags that the tokenizer holds as special tokens."""
        from .tools import TAGS
        if self.tokenizer is None:
            return {}
        added = self.tokenizer.get_added_tokens_decoder()
        return {t.content: i for i, t in added.items() if t.special and t.content in TAGS}

    def _start_cluster(self):
        from .cluster import attach
        try:
            return attach(self.model, self.path, self.options)
        except BaseException:
            self.model.close()
            raise

    def cluster_stats(self) -> Optional[dict]:
        """Per worker: calls, pairs, bytes, round-trip / remote compute / network seconds, losses,
        the units computed here instead; per layer: the mean round trip (None: no cluster)."""
        return self.cluster.stats() if self.cluster is not None else None

    def close(self):
        if self.cluster is not None:
            from .cluster import detach
            detach(self.model, self.cluster)
            self.cluster = None
        self.model.close()


def _check_messages(messages) -> list:
    """[{role, content, tool_calls}] copies; tool_calls (ToolCall objects) only on assistant turns."""
    from .tools import ToolCall
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"messages[{i}].role must be system, user, assistant or tool, got {m['role']!r}")
        calls = list(m.get("tool_calls") or [])
        if calls and (m["role"] != "assistant" or not all(isinstance(c, ToolCall) for c in calls)):
            raise ValueError(f"messages[{i}].tool_calls: ToolCall objects on an assistant message")
        out.append({"role": m["role"], "content": m["content"], "tool_calls": calls})
    return out


def _template_message(m: dict) -> dict:
    """A message as chat templates read it (transformers' convention): tool calls as
    {"type": "function", "function": {"name", "arguments": {...}}}."""
    out = {"role": m["role"], "content": m["content"]}
    if m["tool_calls"]:
        out["tool_calls"] = [{"type": "function", "id": c.id,
                              "function": {"name": c.name, "arguments": c.arguments}} for c in m["tool_calls"]]
    return out


def load(path: Optional[str] = None, options: Optional[Options] = None, **kw) -> LLM:
    """Load a model folder (default: ``COLIBRI_MODEL``, else the embedded model) with ``Options``
    (from ``COLIBRI_*`` environment variables, then ``options``, then keyword overrides)."""
    if path is None:
        path = env_get(os.environ, "MODEL") or None
    if options is None:
        options = Options.from_env(**kw)
    elif kw:
        options = options.replace(**kw)
    return LLM(path, options)
