"""Every setting of colibri in one place: the :class:`Options` of the engine, its expert tiers and
generation, the command-line flags that set them, and the environment variables that set them.

One table (``Options``' fields and their ``metadata``) defines each setting once: its type, its
default, its flag, its help and its check. Every subcommand adds its flags with
:func:`add_arguments`, builds its Options with :func:`from_args`, and ``colibri.load`` takes the
same object. Where a setting comes from, the first that has it wins:

    the command line  >  COLIBRI_<FIELD> environment variable  >  the subcommand's default  >  the field's default

Errors name the setting the way the user gave it: ``--ram`` on the command line,
``COLIBRI_RAM_GB`` from the environment, ``ram_gb`` in the Python API.

Tuning switches (``COLIBRI_AMX``, ``COLIBRI_ISA``, ...) are not options: they pick kernels or
thresholds for A/B runs. They are listed, with what they do, in :data:`SWITCHES`.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Optional, Union

ENV_PREFIX = "COLIBRI_"
LEGACY_PREFIX = "COLI_"          # read with a warning: the name these variables had before 0.2

GROUPS = {
    "engine": "engine",
    "tiers": "expert tiers and I/O",
    "generation": "generation",
    "cluster": "cluster (routed experts in the RAM of expert workers)",
}


class OptionError(ValueError):
    """A setting with a bad value: ``field`` names the Options field, ``problem`` says what is
    wrong; ``str()`` names the field (front ends re-raise it with their own name for it)."""

    def __init__(self, field_name: str, problem: str):
        self.field, self.problem = field_name, problem
        super().__init__(f"{field_name} {problem}")


def _opt(default, group, help, flag=None, short=None, metavar=None, choices=None, negate=None, check=None):
    """One setting: ``flag`` (default --field-name), ``negate`` the flag of a bool whose default is
    True (``--no-prefetch``), ``check(value) -> problem or None``."""
    return field(default=default, metadata=dict(group=group, help=help, flag=flag, short=short, metavar=metavar,
                                                choices=choices, negate=negate, check=check))


# -- checks: value -> None (fine) or what is wrong --------------------------------------------------

def _int_at_least(lo):
    def check(v):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            return f"must be an integer >= {lo}, got {v!r}"
    return check


def _one_of(*allowed):
    def check(v):
        if v not in allowed:
            return f"must be one of {', '.join(map(str, allowed))}, got {v!r}"
    return check


def _positive_gb(v):
    if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0):
        return f"must be a positive number of GB, got {v!r}"


def _act_block(v):
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v % 64:
        return f"must be 0 (one scale per row) or a multiple of 64, got {v!r}"


def _temperature(v):
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v >= 0 and math.isfinite(v)):
        return f"must be a number >= 0, got {v!r}"


def _top_p(v):
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1:
        return f"must be in (0, 1], got {v!r}"


def _penalty_factor(v):
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (math.isfinite(v) and v > 0):
        return f"must be a number > 0 (1 = off), got {v!r}"


def _finite(v):
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        return f"must be a finite number, got {v!r}"


def _seed(v):
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        return f"must be an integer, got {v!r}"


def _prefetch(v):
    if v not in (True, False, "auto", "on", "off"):
        return f"must be true/false or auto, on, off, got {v!r}"


def _draft(v):
    from .draft import parse_draft
    try:
        parse_draft(v)
    except ValueError:
        return f"must be 'auto' or a depth 0..16, got {v!r}"


def _cluster(v):
    if v is None:
        return None
    from .cluster_wire import check_cluster_spec
    return check_cluster_spec(v)


def _seconds(v):
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (math.isfinite(v) and v > 0):
        return f"must be a number of seconds > 0, got {v!r}"


def _json_schema(v):
    from .grammar import check_json_schema
    return check_json_schema(v)


def _grammar(v):
    from .grammar import check_grammar
    return check_grammar(v)


@dataclass
class Options:
    """Settings of the engine, its expert tiers and generation; every field has the CLI's default.
    See each field's help (``python -m colibri run --help`` shows them all)."""
    # engine (model_init)
    cache_experts: int = _opt(0, "engine", "routed experts cached per layer (LRU); 0 = as many as the RAM budget "
                              "allows, up to all (default)", metavar="N", check=_int_at_least(0))
    dense_bits: int = _opt(32, "engine", "precision of resident weights stored as floats in the model files "
                           "(container files keep their own format; default 32 = f32)", choices=(4, 8, 32),
                           check=_one_of(4, 8, 32))
    expert_bits: int = _opt(32, "engine", "precision of routed experts stored as floats (default 32 = f32)",
                            choices=(4, 8, 32), check=_one_of(4, 8, 32))
    idot: int = _opt(2, "engine", "matmul path for int8/int4 weights: 2 = integer dots on Q8 activations + Q8 "
                     "residual (default, near-float accuracy); 1 = Q8 activations only (fastest); 0 = float "
                     "dequant-on-use", choices=(0, 1, 2), check=_one_of(0, 1, 2))
    act_block: int = _opt(0, "engine", "activation quantization block for integer dots: 0 = one scale per row "
                          "(default), or a multiple of 64", metavar="N", check=_act_block)
    absorb: str = _opt("auto", "engine", "absorbed MLA attention (latent space): auto = decode and speculative "
                       "verify (<= 17 rows), and prefill once the expanded path's kv_b rows pass 16 MB or the DSA "
                       "selection runs (default)", choices=("auto", "always", "never"),
                       check=_one_of("auto", "always", "never"))
    dsa_force: bool = _opt(False, "engine", "run the DSA top-k selection even when the context fits in index_topk")
    threads: int = _opt(0, "engine", "OpenMP threads (default 0: all cores)", metavar="N", check=_int_at_least(0))
    # expert tiers and I/O
    ram_gb: Optional[float] = _opt(None, "tiers", "RAM budget in GB for the expert cache sizing (default: 0.88 x "
                                   "available memory)", flag="--ram", metavar="GB", check=_positive_gb)
    pin: Optional[str] = _opt(None, "tiers", "pin the most used experts of a stats file ('layer eid count' lines) "
                              "in RAM", metavar="STATS")
    pin_gb: Optional[float] = _opt(None, "tiers", "hot-store size for --pin (default 10 GB, capped by the budget)",
                                   metavar="GB", check=_positive_gb)
    autopin: bool = _opt(True, "tiers", "do not pin experts from the routing history saved next to the model",
                         negate="--no-autopin")
    prefetch: Union[bool, str] = _opt(True, "tiers", "turn off the router-lookahead prefetch of the next layer's "
                                      "experts", negate="--no-prefetch", check=_prefetch)
    warm_experts: bool = _opt(True, "tiers", "when every expert fits in the budget, read each on its first use "
                              "instead of all at start-up (a faster start for a short job; slower first tokens)",
                              negate="--lazy-experts")
    direct: bool = _opt(False, "tiers", "read expert payloads with O_DIRECT, bypassing the OS page cache")
    io_threads: int = _opt(4, "tiers", "concurrent expert reads per MoE layer (default 4)", metavar="N",
                           check=_int_at_least(1))
    context: int = _opt(0, "tiers", "KV positions kept for a conversation (0 = the model's context, at most "
                        "4096; run sizes it to the prompt and --max-tokens)", metavar="N", check=_int_at_least(0))
    batch: int = _opt(0, "tiers", "prompt tokens per prefill forward: longer prompts go in near-equal pieces of at "
                      "most N (bounded scratch; each streamed expert read once per piece and layer; the same "
                      "result). 0 = the default: the whole prompt, in pieces only where the RAM budget is small",
                      short="-b", metavar="N", check=_int_at_least(0))
    # generation
    max_tokens: int = _opt(256, "generation", "tokens to generate (default %(default)s)", short="-n", metavar="N",
                           check=_int_at_least(1))
    temperature: float = _opt(0.7, "generation", "sampling temperature; 0 = greedy (default %(default)s)",
                              short="-t", check=_temperature)
    top_p: float = _opt(0.9, "generation", "nucleus sampling mass (default %(default)s)", check=_top_p)
    top_k: int = _opt(0, "generation", "sample from the K most likely tokens only (default 0: all)", metavar="K",
                      check=_int_at_least(0))
    repeat_penalty: float = _opt(1.0, "generation", "divide the logits of tokens seen in the last --repeat-last-n "
                                 "tokens by this (transformers' repetition_penalty; default 1.0: off)",
                                 metavar="X", check=_penalty_factor)
    repeat_last_n: int = _opt(64, "generation", "how many of the last tokens (prompt included) the penalties look "
                              "at (default %(default)s; -1 = all, 0 = penalties off)", metavar="N",
                              check=_int_at_least(-1))
    frequency_penalty: float = _opt(0.0, "generation", "lower a token's logit by this per occurrence in the last "
                                    "--repeat-last-n tokens (OpenAI's frequency_penalty; default 0)", metavar="X",
                                    check=_finite)
    presence_penalty: float = _opt(0.0, "generation", "lower the logit of a token present in the last "
                                   "--repeat-last-n tokens by this (OpenAI's presence_penalty; default 0)",
                                   metavar="X", check=_finite)
    seed: Optional[int] = _opt(None, "generation", "RNG seed for sampling (default: from the clock; the seed used "
                               "is reported)", check=_seed)
    draft: Union[str, int] = _opt("auto", "generation", "speculative draft depth: auto (default) picks the depth, 0 "
                                  "included, that minimises wall time per token; N forces a depth (0 = off). Drafts "
                                  "come from the model's MTP head, else from n-gram prompt lookup",
                                  metavar="N|auto", check=_draft)
    ignore_eos: bool = _opt(False, "generation", "keep generating past end-of-sequence tokens (benchmarks)")
    json_schema: Optional[Union[str, dict]] = _opt(
        None, "generation", "constrain the output to JSON that validates against this JSON schema (the schema's "
        "text, or a .json file); e.g. '{\"type\": \"object\"}' for any JSON object", metavar="SCHEMA",
        check=_json_schema)
    grammar: Optional[str] = _opt(None, "generation", "constrain the output to this grammar (Lark, llguidance's "
                                  "syntax, or llama.cpp's GBNF; the text or a file)", metavar="GRAMMAR",
                                  check=_grammar)
    # cluster (colibri.cluster)
    cluster: Optional[str] = _opt(None, "cluster", "hold the routed experts in the RAM of expert workers: "
                                  "local:N (N workers on this machine, to try it) or a Ray cluster's address "
                                  "(HOST:PORT, or auto); this machine keeps the rest of the model and computes "
                                  "a lost worker's share from its own copy", metavar="ADDRESS", check=_cluster)
    cluster_timeout: float = _opt(30.0, "cluster", "seconds an expert worker may take to answer one MoE call "
                                  "before it counts as lost (default %(default)s)", metavar="S", check=_seconds)
    cluster_ram: Optional[float] = _opt(None, "cluster", "GB of RAM each expert worker gives its experts (default: "
                                        "all of its share; less: the rest streams from its own disk through "
                                        "its own cache)", metavar="GB", check=_positive_gb)
    cluster_threads: int = _opt(0, "cluster", "OpenMP threads of each expert worker (default 0: all its cores)",
                                metavar="N", check=_int_at_least(0))

    def __post_init__(self):
        self.validate()

    def validate(self) -> "Options":
        """Check every field (OptionError names the first bad one); normalise draft and prefetch."""
        from .draft import parse_draft
        for f in fields(self):
            check = f.metadata.get("check")
            problem = check(getattr(self, f.name)) if check else None
            if problem:
                raise OptionError(f.name, problem)
        self.draft = parse_draft(self.draft)
        return self

    def replace(self, **changes) -> "Options":
        """A copy with ``changes`` (checked)."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"unknown option {unknown[0]!r}")
        return Options(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})

    # -- what each layer takes ---------------------------------------------------------------------

    @property
    def prefetch_enabled(self) -> bool:
        """Whether the router-lookahead prefetch may run at all (True, 'auto' or 'on')."""
        return self.prefetch is not False and self.prefetch != "off"

    def engine_kwargs(self) -> dict:
        """The keyword arguments of ``_core.model_init``."""
        return dict(cache_experts=self.cache_experts, dense_bits=self.dense_bits, expert_bits=self.expert_bits,
                    idot=self.idot, act_block=self.act_block,
                    absorb={"auto": -1, "never": 0, "always": 1}[self.absorb], dsa_force=self.dsa_force,
                    threads=self.threads, io_threads=self.io_threads, prefetch=self.prefetch, direct=self.direct)

    def worker_kwargs(self) -> dict:
        """The keyword arguments of ``_core.experts_init`` on an expert worker (colibri.cluster):
        the coordinator's expert settings, so both compute the same outputs."""
        return dict(expert_bits=self.expert_bits, idot=self.idot, act_block=self.act_block,
                    threads=self.cluster_threads, io_threads=self.io_threads, direct=self.direct,
                    ram_gb=self.cluster_ram)

    def sampler_kwargs(self) -> dict:
        """The keyword arguments of ``_core.Sampler`` (besides the vocabulary and the seed)."""
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n,
                    frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty)

    def tier_kwargs(self) -> dict:
        """The keyword arguments of ``tiers.configure`` (besides the model and the context)."""
        if self.cluster:
            # the workers hold the routed experts: this machine's cache only serves a lost
            # worker's share, read on demand (no pins, no warming, no lookahead)
            return dict(requested=self.cache_experts, ram_gb=self.ram_gb, pin=None, pin_gb=None, autopin=False,
                        prefetch=False, warm=False, mtp_tier=False, batch=self.batch)
        return dict(requested=self.cache_experts, ram_gb=self.ram_gb, pin=self.pin, pin_gb=self.pin_gb,
                    autopin=self.autopin, prefetch=self.prefetch_enabled,
                    warm=self.warm_experts, mtp_tier=self.draft != 0, batch=self.batch)

    @classmethod
    def from_env(cls, env=None, **overrides) -> "Options":
        """Options from ``COLIBRI_<FIELD>`` environment variables (e.g. ``COLIBRI_CACHE_EXPERTS=8``,
        ``COLIBRI_RAM_GB=16``, ``COLIBRI_PREFETCH=0``), then ``overrides``."""
        got = env_sources(os.environ if env is None else env)
        kw = {name: v for name, (v, _) in got.items()}
        kw.update(overrides)
        return _checked(cls, kw, lambda name: name if name in overrides else got.get(name, (0, name))[1])


#: The settings a single generation may change (Session.generate, LLM.complete, a server request).
GENERATION_FIELDS = tuple(f.name for f in fields(Options) if f.metadata["group"] == "generation")


# -- the environment -------------------------------------------------------------------------------

def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def env_lookup(env, name: str):
    """(value, variable) of ``COLIBRI_<NAME>``, else of the old ``COLI_<NAME>`` (with a warning on
    stderr), else (None, None)."""
    if env.get(ENV_PREFIX + name) is not None:
        return env[ENV_PREFIX + name], ENV_PREFIX + name
    if env.get(LEGACY_PREFIX + name) is not None:
        print(f"colibri: warning: {LEGACY_PREFIX + name} is now {ENV_PREFIX + name} (the old name goes in a later "
              "release)", file=sys.stderr)
        return env[LEGACY_PREFIX + name], LEGACY_PREFIX + name
    return None, None


def env_get(env, name: str) -> Optional[str]:
    """The value of ``COLIBRI_<NAME>`` (or of the old ``COLI_<NAME>``), None when unset."""
    return env_lookup(env, name)[0]


# COLIBRI_<NAME> variables that are not Options fields (each read where it acts)
NON_OPTION_ENV = {"MODEL", "API_KEY"}


def env_values(env) -> dict:
    """The Options fields set by environment variables, parsed (errors name the variable)."""
    return {name: v for name, (v, _) in env_sources(env).items()}


def env_sources(env) -> dict:
    """field -> (parsed value, the variable that set it)."""
    out = {}
    for f in fields(Options):
        raw, var = env_lookup(env, f.name.upper())
        if raw is not None:
            out[f.name] = (_parse(f, raw, var), var)
    return out


def _parse(f, raw: str, where: str):
    """A field's value from text (an environment variable)."""
    text = raw.strip()
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    low = text.lower()
    if f.name == "prefetch" and low in ("auto", "on", "off"):
        return low
    if kind == "bool" or f.name == "prefetch":
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{where}={raw!r} is not a boolean (1/0, true/false, on/off)")
    if f.name == "draft":
        return text
    if "None" in kind and low in ("", "none"):
        return None
    try:
        if "float" in kind:
            return float(text)
        if "int" in kind:
            return int(text)
    except ValueError:
        raise ValueError(f"{where}={raw!r} is not a {'number' if 'float' in kind else 'integer'}") from None
    return text


def _checked(cls, kw: dict, name_of) -> "Options":
    """cls(**kw); an OptionError re-raised as a ValueError that names the setting as name_of(field)
    shows it."""
    try:
        return cls(**kw)
    except OptionError as e:
        raise ValueError(f"{name_of(e.field)} {e.problem}") from None


# -- the command line ------------------------------------------------------------------------------

def flag_of(f) -> str:
    return f.metadata.get("negate") or f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_arguments(p: argparse.ArgumentParser, groups=("engine", "tiers", "generation", "cluster"), skip=(), only=None,
                  **defaults):
    """Add the flags of the Options fields of ``groups`` (not those in ``skip``; only those in
    ``only`` when given) to ``p``, each in its argument group; ``defaults`` are the subcommand's own
    defaults (e.g. ``max_tokens=64``).
    Parsed values stay None unless given, so :func:`from_args` can tell a flag from a default."""
    shown = {f.name: defaults.get(f.name, f.default) for f in fields(Options)}
    made = {}
    for f in fields(Options):
        md = f.metadata
        if md["group"] not in groups or f.name in skip or (only is not None and f.name not in only):
            continue
        g = made.get(md["group"])
        if g is None:
            g = made[md["group"]] = p.add_argument_group(GROUPS[md["group"]])
        names = [flag_of(f)] + ([md["short"]] if md.get("short") else [])
        helptext = md["help"].replace("%(default)s", str(shown[f.name]))
        if f.type in ("bool", bool) or md.get("negate"):
            # a switch: --direct sets True, --no-prefetch sets False
            g.add_argument(*names, dest=f.name, action="store_const", const=not md.get("negate"),
                           default=None, help=helptext)
            continue
        parse = _cli_type(f)
        g.add_argument(*names, dest=f.name, type=parse, default=None, choices=md.get("choices"),
                       metavar=md.get("metavar"), help=helptext)
    p.set_defaults(_colibri_defaults=dict(defaults))


def _cli_type(f):
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if f.name == "draft" or f.name == "absorb" or "str" in kind:
        return str
    if "float" in kind:
        return float
    return int


def from_args(args: argparse.Namespace, env=None, **overrides) -> Options:
    """The Options of a parsed command line: its flags, then ``COLIBRI_*`` variables, then the
    subcommand's defaults (given to add_arguments); ``overrides`` win over all. A bad value is a
    ValueError that names the flag or the variable it came from."""
    env = os.environ if env is None else env
    by_name = {f.name: f for f in fields(Options)}
    source = {}                                   # field -> the name the user gave it under
    kw = dict(getattr(args, "_colibri_defaults", {}) or {})
    for name, (v, var) in env_sources(env).items():
        kw[name], source[name] = v, var
    for f in fields(Options):
        v = getattr(args, f.name, None)
        if v is not None:
            kw[f.name], source[f.name] = v, flag_of(f)
    kw.update(overrides)
    return _checked(Options, kw, lambda name: source.get(name, flag_of(by_name[name])))


# -- tuning switches -------------------------------------------------------------------------------

#: Environment switches for kernels and thresholds (A/B runs, bug hunts): not options a user needs,
#: but each is listed here, with its default and what it does, and read through :func:`switch`.
#: Kernel thresholds and choices are read once, when ``colibri._core`` is imported; the per-model
#: ones (marked "model") at each model_init. Name (after COLIBRI_) -> (default, what it does).
SWITCHES = {
    "ISA": ("", "force a kernel variant: scalar, avx2 or avx512vnni (clamped to what the CPU has); "
                "model"),
    "AMX": ("1", "0 turns off the AMX-INT8 prefill GEMM (batches take the AVX-512 VNNI GEMM)"),
    "GEMM": ("1", "0 keeps batches on the row kernels (no tiled GEMM)"),
    "GEMM_MIN_ROWS": ("8", "rows from which a batch takes the AMX GEMM"),
    "GEMM_VNNI_MIN_ROWS": ("16", "rows from which a batch takes the AVX-512 VNNI GEMM (0: never)"),
    "SPIN": ("auto", "how OpenMP threads wait at barriers: auto (spin a bounded time when the CPUs are "
                     "idle at start-up), on, off (sleep); read when the engine extension loads"),
    "PARALLEL_MIN_MACS": ("", "multiply-adds from which a matmul is split over the threads (default "
                              "2^15, 2^22 with passive OpenMP waits)"),
    "BLOCK_SUMS": ("1", "0 turns off the int4/int8 tiles' precomputed activation block sums"),
    "GROUP_KERNELS": ("1", "0: decode matmuls one weight row per kernel call instead of four"),
    "PREFETCH_GROUPS": ("4", "weight groups the matvec kernels prefetch ahead"),
    "FUSED_MIN_MACS": ("262144", "multiply-adds from which a fused FFN group runs on every thread"),
    "PREFILL_CHUNK": ("256", "rows per chunk of a long forward's expert FFNs"),
    "MAP_STREAM_ROWS": ("256", "rows from which COLIBRI_MAP_STREAM applies"),
    "INTERLEAVE": ("1", "0 keeps the stored weight layout (no row interleaving for the tiles); model"),
    "FUSED": ("1", "0 turns off the fused FFN groups (one matmul after another); model"),
    "OVERLAP": ("1", "0: a MoE call waits for all its expert reads before it multiplies the present "
                     "ones; model"),
    "STEP": ("1", "0 turns off the decode step's C loop over the layers (call by call); model"),
    "MAP_STREAM": ("0", "1: prefills of many rows use the experts they stream in place in the file "
                        "mapping; model"),
    "MMAP": ("auto", "1 uses container experts in place in the file mapping, 0 reads them, auto: in "
                     "place unless the tiles want interleaved rows; model"),
    "FORCED_DRAFTS": ("1", "0: a grammar's forced tokens are not put into verify forwards as drafts (A/B "
                           "of grammar-constrained decoding)"),
    "USAGE_DIR": ("", "folder for routing histories and chat sessions (instead of next to the model)"),
    "CONVERT_STOP_AFTER": ("", "tests: the converter stops after N shards, as if killed"),
}


def switch(name: str) -> str:
    """The value of tuning switch COLIBRI_<name>, stripped (its SWITCHES default when unset)."""
    if name not in SWITCHES:
        raise KeyError(f"unknown switch COLIBRI_{name}")
    return os.environ.get(ENV_PREFIX + name, SWITCHES[name][0]).strip()
