"""The text files of a model folder, read and checked once at load time: ``tokenizer.json`` (the
``tokenizers`` library), ``tokenizer_config.json`` (special tokens, chat template) and the model's
own chat template.

The chat template is ``chat_template.jinja`` when the folder has one (it wins, as in HF
transformers), else the ``chat_template`` field of tokenizer_config.json: a string, or HF's list
form ``[{"name": "default", "template": ...}, ...]`` (the "default" entry is used). It is rendered
as transformers' ``apply_chat_template`` renders it: a sandboxed Jinja environment with
trim_blocks and lstrip_blocks, the ``loopcontrols`` extension, a ``tojson`` filter that keeps
non-ASCII text and does not HTML-escape, the globals ``raise_exception`` and ``strftime_now``, and
the variables ``messages``, ``add_generation_prompt``, ``tools`` (None), ``documents`` (None) and
the special tokens of tokenizer_config.json (``bos_token``, ``eos_token``, ...).

A file that is present but unreadable or malformed raises :class:`ModelFileError` naming it; a
missing tokenizer_config.json or template is not an error (see :attr:`colibri.LLM.chat_template_source`).
"""
from __future__ import annotations

import json
import os
from typing import Optional

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# the special tokens transformers hands a chat template (its special_tokens_map)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ModelFileError(ValueError):
    """A tokenizer file or chat template of a model folder is unreadable or malformed (the message
    names the file)."""


def load_tokenizer(model_dir: str):
    """The model's ``tokenizers.Tokenizer``, or None when the folder has no tokenizer.json."""
    path = os.path.join(model_dir, TOKENIZER_FILE)
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(path)
    except Exception as e:          # tokenizers raises a bare Exception for bad JSON and a wrong schema
        raise ModelFileError(f"{path}: not a valid tokenizer file ({e})") from None


def load_tokenizer_config(model_dir: str) -> dict:
    """tokenizer_config.json as a dict; {} when the folder has none."""
    path = os.path.join(model_dir, TOKENIZER_CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (FileNotFoundError, NotADirectoryError):     # (no model folder at all: config.json says so)
        return {}
    except OSError as e:
        raise ModelFileError(f"{path}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:         # JSONDecodeError, UnicodeDecodeError
        raise ModelFileError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelFileError(f"{path}: top level must be a JSON object")
    return cfg


def load_chat_template(model_dir: str, tokenizer_config: Optional[dict] = None) -> Optional["ChatTemplate"]:
    """The model's own chat template (chat_template.jinja, else tokenizer_config.json's
    chat_template), or None when it has none. ``tokenizer_config``: the parsed file, if read already."""
    config_path = os.path.join(model_dir, TOKENIZER_CONFIG_FILE)
    cfg = load_tokenizer_config(model_dir) if tokenizer_config is None else tokenizer_config
    special = _special_tokens(cfg, config_path)
    jinja_path = os.path.join(model_dir, CHAT_TEMPLATE_FILE)
    if os.path.exists(jinja_path):
        return ChatTemplate(_read_text(jinja_path), jinja_path, special)
    raw = cfg.get("chat_template")
    if raw is None:
        return None
    return ChatTemplate(_default_template(raw, config_path), config_path, special)


class ChatTemplate:
    """A model's Jinja chat template, compiled: ``source`` is the file it came from."""

    def __init__(self, text: str, source: str, special_tokens: Optional[dict] = None):
        import jinja2
        self.source, self.text = source, text
        self.special_tokens = dict(special_tokens or {})
        if not text.strip():
            raise ModelFileError(f"{source}: the chat template is empty")
        try:
            self._template = _environment().from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise ModelFileError(f"{source}: the chat template does not parse (template line {e.lineno}: "
                                 f"{e.message})") from None
        except jinja2.TemplateError as e:
            raise ModelFileError(f"{source}: the chat template does not parse ({e})") from None

    def render(self, messages: list, add_generation_prompt: bool = True, tools=None, **extra) -> str:
        """The prompt text of ``messages`` ([{role, content}, ...]), ending with the assistant's
        turn opened when ``add_generation_prompt``; ``tools``: OpenAI-shaped function tools;
        ``extra``: the template's own variables (GLM's ``enable_thinking``)."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, documents=None, **self.special_tokens, **extra)
        except _TemplateRaised as e:
            raise ModelFileError(f"{self.source}: the chat template rejects this conversation: {e}") from None
        except Exception as e:      # a template is a program: any error of its own is reported with the file
            raise ModelFileError(f"{self.source}: the chat template failed to render "
                                 f"({type(e).__name__}: {e})") from None


class _TemplateRaised(Exception):
    """raise_exception(message) called by a template."""


def _raise_exception(message):
    raise _TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes <, >, & and '; chat templates want the plain JSON text
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    import datetime
    return datetime.datetime.now().strftime(fmt)


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _generation_tag()])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _generation_tag():
    """``{% generation %}...{% endgeneration %}`` (transformers marks the assistant's tokens with
    it, for training masks) renders its body unchanged."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return Generation


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ModelFileError(f"{path}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise ModelFileError(f"{path}: cannot be read ({e.strerror or e})") from None


def _default_template(raw, path: str) -> str:
    """tokenizer_config.json's chat_template: a string, or the 'default' entry of HF's list of
    named templates."""
    if isinstance(raw, str):
        return raw
    shape = "must be a string or a list of {\"name\": ..., \"template\": ...} objects"
    if not isinstance(raw, list) or not raw:
        raise ModelFileError(f"{path}: field 'chat_template' {shape}")
    named = {}
    for i, entry in enumerate(raw):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)):
            raise ModelFileError(f"{path}: field 'chat_template[{i}]' {shape}")
        named[entry["name"]] = entry["template"]
    if "default" not in named:
        raise ModelFileError(f"{path}: field 'chat_template' names templates {sorted(named)} but none is "
                             f"'default'")
    return named["default"]


def _special_tokens(cfg: dict, path: str) -> dict:
    """{name: text} of the special tokens in tokenizer_config.json (a string, or an AddedToken
    object {"content": ...}); absent or null ones are left out (undefined in the template)."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = cfg.get(name)
        if value is None:
            continue
        text = value.get("content") if isinstance(value, dict) else value
        if not isinstance(text, str):
            raise ModelFileError(f"{path}: field '{name}' must be a string or an object with a string 'content'")
        out[name] = text
    return out
