#!/usr/bin/env python3
"""Build colibri's embedded default model: a small, trained ``glm_moe_dsa`` with a native MTP head.

The whole pipeline, reproducible with fixed seeds (CPU, torch 2.13.0, transformers 5.x):

  train    corpus (the running interpreter's standard library and the .py files of PACKAGES, pinned
           wheels from PyPI; split by file), byte-level BPE tokenizer, GlmMoeDsaForCausalLM + MTP
           layer trained jointly, f32 HF checkpoint in --out (outside the repository); resumable
           (--resume) from OUT.state.pt with the prepared tokens in OUT.data/.
  convert  ``python -m colibri convert`` of that checkpoint into colibri/models/default
           (or --dst), int4 or int8 experts/dense, int8 io and MTP.
  ref      tests/data/default_ref.json: transformers on the container's DEQUANTIZED weights.
  eval     held-out loss of containers, parity, greedy loops (distinct 4-grams), MTP acceptance
           (greedy and sampled, depths 1-4) and decode speed through the CLI.
  tune     fine-tune the converted container against greedy loops (sequence-level unlikelihood
           on the model's own greedy continuations, or DITTO on repeated corpus spans, with the
           next-token + MTP objective kept; quantization-aware from round 2: on the container's
           int4 image), f32 checkpoint in --out; resumable (--resume) from OUT.state.pt.
  card     colibri/models/default/MODEL_CARD.md (and train_meta.json) from the training metadata
           and the eval results.

    nice -n 5 python tools/train_tiny.py train --out /tmp/colibri_tiny_f32
    python tools/train_tiny.py convert --src /tmp/colibri_tiny_f32 --bits 4
    nice -n 5 python tools/train_tiny.py tune --round 1 --out /tmp/colibri_tiny_f32.tuned1 \
        --base-meta /tmp/colibri_tiny_f32/train_meta.json      # then convert; more rounds alike
    python tools/train_tiny.py convert --src /tmp/colibri_tiny_f32.tuned1 --bits 4
    python tools/train_tiny.py ref --src /tmp/colibri_tiny_f32.tuned1
    python tools/train_tiny.py eval --src /tmp/colibri_tiny_f32.tuned1 --results /tmp/eval.json
    python tools/train_tiny.py card --src /tmp/colibri_tiny_f32.tuned1 --results /tmp/eval.json
    python tools/train_tiny.py all --out /tmp/colibri_tiny_f32 [--resume]     # all of it in one go

Architecture (GLM-5 ``glm_moe_dsa``, scaled down): MLA with q_lora and kv_lora, interleaved
default RoPE, sigmoid-routed MoE with e_score_correction_bias (aux-loss-free balancing: the bias
is nudged against each step's expert load, DeepSeek-V3 style, plus a small balance loss), one
shared expert, first layer dense, norm_topk_prob, routed_scaling_factor 2.5, and a DSA indexer in
every layer. HF runs the indexer under no_grad, so its weights stay at their initialisation; the
context (max_position_embeddings) therefore equals index_topk and the selection never drops a key.

MTP (DeepSeek-V3 / GLM-5, the convention colibri's engine drafts with), for position i with h_i the
last main layer's residual before ``model.norm`` and t the tokens:

    hx_i  = eh_proj . [enorm(embed(t_{i+1})) ; hnorm(model.norm(h_i))]
    o_i   = MTP decoder layer (MLA + MoE, causal and dense over hx_0..hx_i, position i)
    logits_mtp_i = lm_head(shared_head.norm(o_i))  ->  t_{i+2}

    loss = CE_main + MTP_LAMBDA * CE_mtp

The MTP layer is saved as ``model.layers.{num_hidden_layers}.*`` with per-expert names (HF drops it
on load; colibri reads it).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time

# Before torch loads: OpenMP workers that spin while waiting collapse (10x slower steps) when the
# two cores are shared with other jobs; passive waiting costs little when they are not.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG_MODEL = os.path.join(ROOT, "colibri", "models", "default")
REF_PATH = os.path.join(ROOT, "tests", "data", "default_ref.json")
DEFAULT_OUT = "/tmp/colibri_tiny_f32"

# ----------------------------------------------------------------------------------------------
# Fixed experiment definition
# ----------------------------------------------------------------------------------------------

SEED = 20260311
HELDOUT_PERCENT = 5                     # files whose sha256(relative path) % 100 < this are held out
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
EOS = "<|endoftext|>"
VOCAB = 4096

MODEL = dict(
    vocab_size=VOCAB,
    hidden_size=192,
    intermediate_size=384,              # the dense layer(s)
    moe_intermediate_size=64,
    num_hidden_layers=12,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=32,
    num_experts_per_tok=4,
    n_shared_experts=1,
    q_lora_rank=96,
    kv_lora_rank=48,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    attention_bias=False,
    max_position_embeddings=2048,
    index_topk=2048,                    # = the context: the (untrained) indexer never drops a key
    index_head_dim=32,
    index_n_heads=4,
    initializer_range=0.02,
)

TRAIN = dict(
    seq_len=512,
    batch=8,
    steps=1900,
    lr=2e-3,
    min_lr_frac=0.1,
    warmup=60,
    weight_decay=0.1,
    betas=(0.9, 0.95),
    grad_clip=1.0,
    mtp_lambda=0.3,
    mtp_distill=0.3,                    # weight of KL(main's next-next distribution || MTP head's)
    bias_update=3e-3,                   # e_score_correction_bias step per update (DeepSeek-V3's gamma)
    balance_alpha=1e-3,                 # small batch-wise expert balance loss
    log_every=25,
    eval_every=500,
    max_minutes=135,                    # safety stop of the training loop (wall clock)
    stdlib_share=0.7,                   # share of training windows drawn from the stdlib
    save_every=40,                      # training state for --resume (next to --out)
    eval_windows=24,                    # held-out windows for the in-training evaluation
)

# Held-out prompts for the MTP / speed measurements: the first lines of held-out files, cut at a
# code line boundary. Filled in by heldout_prompts().
N_PROMPTS = 12
DISTINCT_OK = 0.6      # a greedy continuation with fewer distinct 4-grams than this has looped


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------------
# Corpus and split
# ----------------------------------------------------------------------------------------------

# Permissively licensed pure-Python distributions (py3-none-any wheels from PyPI), pinned:
# (distribution, version, license as its metadata states it). Their .py files join the stdlib's.
# Backports of stdlib modules (typing_extensions, tomli, importlib_metadata, zipp, mock, ...) are
# left out on purpose: they would put held-out stdlib code into the training split.
PACKAGES = (
    ("alembic", "1.20.1", "MIT"), ("anyio", "4.16.0", "MIT"), ("attrs", "26.1.0", "MIT"),
    ("beautifulsoup4", "4.15.0", "MIT"), ("boltons", "26.2.0", "BSD-3-Clause"),
    ("bottle", "0.13.4", "MIT"), ("cachetools", "8.0.2", "MIT"), ("celery", "5.7.0", "BSD-3-Clause"),
    ("click", "8.5.1", "BSD-3-Clause"), ("dask", "2026.8.0", "BSD-3-Clause"),
    ("Django", "5.2.19", "BSD-3-Clause"), ("fabric", "3.2.3", "BSD-2-Clause"), ("fastapi", "0.165.0", "MIT"),
    ("Flask", "3.1.3", "BSD-3-Clause"), ("fsspec", "2026.9.0", "BSD-3-Clause"), ("gunicorn", "27.0.1", "MIT"),
    ("h11", "0.16.0", "MIT"), ("html5lib", "1.1", "MIT"), ("httpcore", "1.0.9", "BSD-3-Clause"),
    ("httpx", "0.29.0", "BSD-3-Clause"), ("idna", "3.20", "BSD-3-Clause"), ("iniconfig", "2.3.1", "MIT"),
    ("invoke", "3.0.3", "BSD-2-Clause"), ("ipython", "9.18.1", "BSD-3-Clause"), ("isort", "9.0.2", "MIT"),
    ("itsdangerous", "2.2.0", "BSD-3-Clause"), ("jedi", "0.20.1", "MIT"), ("Jinja2", "3.1.6", "BSD-3-Clause"),
    ("jsonschema", "4.26.0", "MIT"), ("kombu", "5.7.0", "BSD-3-Clause"), ("Mako", "1.4.3", "MIT"),
    ("Markdown", "3.11.3", "BSD-3-Clause"), ("marshmallow", "4.4.0", "MIT"), ("mistune", "3.4.0", "BSD-3-Clause"),
    ("more-itertools", "11.2.1", "MIT"), ("mpmath", "1.4.1", "BSD-3-Clause"), ("networkx", "3.6.1", "BSD-3-Clause"),
    ("nltk", "3.10.4", "Apache-2.0"), ("oauthlib", "4.0.1", "BSD-3-Clause"), ("openpyxl", "3.1.5", "MIT"),
    ("packaging", "26.4", "Apache-2.0 OR BSD-2-Clause"), ("parso", "0.8.7", "MIT"), ("pip", "26.3", "MIT"),
    ("pluggy", "1.7.0", "MIT"), ("prompt_toolkit", "3.0.53", "BSD-3-Clause"), ("pyasn1", "0.6.5", "BSD-2-Clause"),
    ("pycodestyle", "2.15.0", "MIT"), ("pyflakes", "4.1.0", "MIT"), ("pyglet", "2.1.19", "BSD-3-Clause"),
    ("Pygments", "2.21.0", "BSD-2-Clause"), ("pyparsing", "3.3.3", "MIT"), ("pytest", "9.2.0", "MIT"),
    ("python-dateutil", "4.0.0", "BSD-3-Clause"), ("requests", "2.34.2", "Apache-2.0"), ("rich", "15.0.0", "MIT"),
    ("rsa", "4.9.1", "Apache-2.0"), ("Scrapy", "2.19.0", "BSD-3-Clause"), ("setuptools", "84.2.1", "MIT"),
    ("six", "1.17.0", "MIT"), ("sniffio", "1.3.1", "MIT OR Apache-2.0"), ("soupsieve", "2.10", "MIT"),
    ("Sphinx", "9.0.4", "BSD-2-Clause"), ("sqlparse", "0.6.1", "BSD-3-Clause"), ("starlette", "1.10.0", "BSD-3-Clause"),
    ("sympy", "1.14.0", "BSD-3-Clause"), ("tabulate", "0.10.0", "MIT"), ("textual", "8.2.8", "MIT"),
    ("toolz", "1.2.0", "BSD-3-Clause"), ("traitlets", "5.16.1", "BSD-3-Clause"), ("Twisted", "26.10.0", "MIT"),
    ("typer", "0.29.2", "MIT"), ("urllib3", "2.8.0", "MIT"), ("Werkzeug", "3.1.9", "BSD-3-Clause"),
    ("wheel", "0.48.0", "MIT"),
)
DEFAULT_WHEELS = os.path.join(os.path.expanduser("~"), ".cache", "colibri-corpus", "wheels")
MAX_FILE_BYTES = 1 << 20                # larger .py files are generated tables, not code
NEAR_DUP_SHARE = 0.3                    # a training file holding this share of a held-out file's lines is dropped


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_heldout(rel: str) -> bool:
    h = int(hashlib.sha256(rel.encode("utf-8")).hexdigest()[:8], 16)
    return h % 100 < HELDOUT_PERCENT


def _skipped(rel: str) -> bool:
    return any(part in SKIP_DIRS for part in rel.split("/")[:-1])


def corpus_files():
    """(relative path, absolute path) of every .py file of the stdlib, sorted, test dirs skipped."""
    root = stdlib_root()
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        for f in sorted(files):
            if f.endswith(".py"):
                p = os.path.join(d, f)
                out.append((os.path.relpath(p, root).replace(os.sep, "/"), p))
    out.sort()
    return out


def read_source(path: str) -> str:
    with open(path, "rb") as f:
        raw = f.read()
    return _decode(raw)


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").replace("\r\n", "\n")


def _wheel_key(dist: str, version: str):
    return re.sub(r"[-_.]+", "_", dist).lower(), version


def wheel_index(wheels: str) -> dict:
    """{(normalised distribution name, version): path} of the wheels in WHEELS."""
    import glob
    return {_wheel_key(*os.path.basename(p).split("-")[:2]): p
            for p in sorted(glob.glob(os.path.join(wheels, "*.whl")))}


def fetch_packages(wheels: str):
    """pip download of every pinned wheel missing from WHEELS (no dependencies: the list is the corpus)."""
    os.makedirs(wheels, exist_ok=True)
    have = wheel_index(wheels)
    missing = [f"{d}=={v}" for d, v, _ in PACKAGES if _wheel_key(d, v) not in have]
    if missing:
        log(f"corpus: downloading {len(missing)} wheels into {wheels}")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.11", "--platform", "any", "--implementation", "py",
                        "-d", wheels, *missing], check=True)
        have = wheel_index(wheels)
    return {d: have[_wheel_key(d, v)] for d, v, _ in PACKAGES}


def package_docs(wheels: str):
    """(relative path 'dist/member', text) of the .py members of every pinned wheel, test dirs skipped."""
    import zipfile
    out = []
    for dist, path in fetch_packages(wheels).items():
        with zipfile.ZipFile(path) as z:
            for info in sorted(z.infolist(), key=lambda i: i.filename):
                name = info.filename
                if (name.endswith(".py") and ".dist-info/" not in name and not _skipped(name)
                        and info.file_size <= MAX_FILE_BYTES):
                    out.append((f"{dist}/{name}", _decode(z.read(info))))
    return out


def _lines(text: str):
    return {ln.strip() for ln in text.split("\n") if len(ln.strip()) >= 24}


def drop_duplicates(train, held):
    """Training documents without exact copies of an earlier document and without near copies of a
    held-out one: a training file holding NEAR_DUP_SHARE of a held-out file's rare lines (lines in at
    most 3 documents: licence headers and boilerplate do not count), as vendored or backported
    stdlib modules do. Returns (the kept documents themselves, in order; number dropped)."""
    df = {}
    line_sets = [_lines(t) for _, t in held] + [_lines(t) for _, t in train]
    for ls in line_sets:
        for ln in ls:
            df[ln] = df.get(ln, 0) + 1
    owners, sizes = {}, []                          # rare held-out line -> held-out file indices
    for j in range(len(held)):
        rare = [ln for ln in line_sets[j] if df[ln] <= 3]
        sizes.append(len(rare))
        for ln in rare:
            owners.setdefault(ln, []).append(j)
    seen = {hashlib.sha256(t.encode()).digest() for _, t in held}
    kept, dropped = [], 0
    for doc, ls in zip(train, line_sets[len(held):]):
        h = hashlib.sha256(doc[1].encode()).digest()
        hits = {}
        for ln in ls:
            for j in owners.get(ln, ()):
                hits[j] = hits.get(j, 0) + 1
        if h in seen or any(sizes[j] >= 8 and c >= NEAR_DUP_SHARE * sizes[j] for j, c in hits.items()):
            dropped += 1
            continue
        seen.add(h)
        kept.append(doc)
    return kept, dropped


def load_corpus():
    """The stdlib's (training, held-out) documents; the held-out ones are the model card's benchmark."""
    files = corpus_files()
    train, held = [], []
    for rel, p in files:
        (held if is_heldout(rel) else train).append((rel, read_source(p)))
    return train, held


def load_full_corpus(wheels: str):
    """{'std_train', 'std_held', 'pkg_train', 'pkg_held'}: lists of (relative path, text), split by
    file with is_heldout(relative path), training files deduplicated against everything held out."""
    std_train, std_held = load_corpus()
    pkg = package_docs(wheels)
    pkg_train = [d for d in pkg if not is_heldout(d[0])]
    pkg_held = [d for d in pkg if is_heldout(d[0])]
    # one pass over both training sets, the stdlib first (a package's copy of a stdlib module is the
    # one dropped); drop_duplicates returns the kept documents themselves, so each side is filtered
    kept, dropped = drop_duplicates(std_train + pkg_train, std_held + pkg_held)
    kept_ids = {id(d) for d in kept}
    std_train = [d for d in std_train if id(d) in kept_ids]
    pkg_train = [d for d in pkg_train if id(d) in kept_ids]
    return {"std_train": std_train, "std_held": std_held, "pkg_train": pkg_train, "pkg_held": pkg_held,
            "dropped": dropped}


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

def train_tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOS) == 0 and tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MODEL["max_position_embeddings"],
        "eos_token": EOS,
        "pad_token": EOS,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


def token_stream(tok, docs) -> np.ndarray:
    """Documents encoded and concatenated, each followed by <|endoftext|>."""
    eos = tok.token_to_id(EOS)
    parts = []
    for enc in tok.encode_batch([t for _, t in docs]):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([eos], dtype=np.uint16))
    return np.concatenate(parts)


STREAMS = ("std_train", "pkg_train", "std_held", "pkg_held")


def prepare_data(out: str, wheels: str):
    """(tokenizer, {stream name: uint16 token stream}, corpus manifest), built once and kept in
    OUT.data/ (tokenizer.json, one .npy per stream, corpus.json) so a resumed run reads the very
    same tokens."""
    from tokenizers import Tokenizer
    d = out.rstrip("/") + ".data"
    man_path = os.path.join(d, "corpus.json")
    if os.path.exists(man_path):
        with open(man_path) as f:
            man = json.load(f)
        tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        streams = {k: np.load(os.path.join(d, k + ".npy")) for k in STREAMS}
        log(f"corpus: {d} (prepared earlier)")
        return tok, streams, man
    t0 = time.time()
    c = load_full_corpus(wheels)
    train_docs = c["std_train"] + c["pkg_train"]
    tok = train_tokenizer([t for _, t in train_docs])
    streams = {k: token_stream(tok, c[k]) for k in STREAMS}
    man = {
        "stdlib": stdlib_root(),
        "packages": [{"name": n, "version": v, "license": l} for n, v, l in PACKAGES],
        "heldout_rule": f"int(sha256(relative path)[:8 hex], 16) % 100 < {HELDOUT_PERCENT}",
        "skip_dirs": sorted(SKIP_DIRS),
        "max_file_bytes": MAX_FILE_BYTES,
        "dropped_duplicates": c["dropped"],
        "heldout_files": [r for r, _ in c["std_held"]],
        "files": {k: len(c[k]) for k in STREAMS},
        "megabytes": {k: round(sum(len(t) for _, t in c[k]) / 1e6, 2) for k in STREAMS},
        "tokens": {k: int(len(v)) for k, v in streams.items()},
        "prepare_seconds": round(time.time() - t0, 1),
    }
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    for k, v in streams.items():
        np.save(os.path.join(d, k + ".npy"), v)
    write_json(man_path, man)
    return tok, streams, man


# ----------------------------------------------------------------------------------------------
# Model + MTP head
# ----------------------------------------------------------------------------------------------

def _torch():
    import torch
    return torch


def build_config(attn="eager"):
    from transformers import GlmMoeDsaConfig
    cfg = GlmMoeDsaConfig(**MODEL, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    cfg._attn_implementation = attn
    return cfg


def mtp_config(cfg):
    """The config in which layer NL (the MTP layer) exists: MoE, no indexer ("shared": the caller
    hands it top-k indices that list every key, so only the causal mask applies)."""
    from transformers import GlmMoeDsaConfig
    NL = cfg.num_hidden_layers
    kw = dict(MODEL, num_hidden_layers=NL + 1, indexer_types=list(cfg.indexer_types) + ["shared"])
    m = GlmMoeDsaConfig(**kw, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    m._attn_implementation = cfg._attn_implementation
    m._experts_implementation = "eager"
    assert m.mlp_layer_types[NL] == "sparse" and m.mlp_layer_types[:NL] == cfg.mlp_layer_types
    assert m.indexer_types[:NL] == cfg.indexer_types
    return m


def make_mtp_head(cfg):
    torch = _torch()
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    class MtpHead(torch.nn.Module):
        """The MTP module's own weights; embed_tokens, model.norm and lm_head are the main model's."""

        def __init__(self, mcfg, layer_idx):
            super().__init__()
            D, eps = mcfg.hidden_size, mcfg.rms_norm_eps
            self.mcfg = mcfg
            self.layer_idx = layer_idx
            self.layer = hf.GlmMoeDsaDecoderLayer(mcfg, layer_idx)
            self.eh_proj = torch.nn.Linear(2 * D, D, bias=False)
            self.enorm = hf.GlmMoeDsaRMSNorm(D, eps=eps)
            self.hnorm = hf.GlmMoeDsaRMSNorm(D, eps=eps)
            self.shared_head_norm = hf.GlmMoeDsaRMSNorm(D, eps=eps)

        def init_weights(self, std):
            with torch.no_grad():
                for name, p in self.named_parameters():
                    if p.dim() >= 2:
                        p.normal_(0.0, std)
                    else:
                        p.fill_(1.0)             # RMSNorm weights (no biases anywhere)
                self.layer.mlp.gate.e_score_correction_bias.zero_()

    mcfg = mtp_config(cfg)
    head = MtpHead(mcfg, cfg.num_hidden_layers)
    assert head.layer.self_attn.indexer is None
    return head


def mtp_forward(head, lm, ids_next, hn):
    """MTP logits for rows i = 0..S-1: ids_next[:, i] = t_{i+1}, hn[:, i] = model.norm(h_i).
    Rows sit at positions 0..S-1; causal, dense attention."""
    torch = _torch()
    from transformers.masking_utils import create_causal_mask
    e = head.enorm(lm.model.embed_tokens(ids_next))
    hx = head.eh_proj(torch.cat([e, head.hnorm(hn)], dim=-1))
    B, S, _ = hx.shape
    pos = torch.arange(S, dtype=torch.long)[None].expand(B, S)
    mask = create_causal_mask(config=head.mcfg, inputs_embeds=hx, attention_mask=None, cache=None,
                              position_ids=pos, allow_is_causal_skip=False)
    cos_sin = lm.model.rotary_emb(hx, position_ids=pos)
    all_keys = torch.arange(S, dtype=torch.int32).expand(B, S, S)
    o, _ = head.layer(hx, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin,
                      prev_topk_indices=all_keys)
    return lm.lm_head(head.shared_head_norm(o))


def cross_entropies(logits, mlog, x, reduction="mean"):
    """Main CE of logits [B, T, V] against x[:, 1:] and MTP CE of mlog [B, T-1, V] against x[:, 2:]."""
    F = _torch().nn.functional
    V = logits.shape[-1]
    main = F.cross_entropy(logits.reshape(-1, V).float(), x[:, 1:].reshape(-1), reduction=reduction)
    mtp = F.cross_entropy(mlog.reshape(-1, V).float(), x[:, 2:].reshape(-1), reduction=reduction)
    return main, mtp


def losses(lm, head, x, reduction="mean"):
    """x: [B, T+1] token windows. Main CE over T positions, MTP CE over T-1 positions."""
    inp = x[:, :-1]
    out = lm.model(input_ids=inp, use_cache=False)
    hn = out.last_hidden_state                                   # model.norm(h)
    mlog = mtp_forward(head, lm, inp[:, 1:], hn[:, :-1])
    return cross_entropies(lm.lm_head(hn), mlog, x, reduction)


# The training forward: the same computation as HF's modules (and their weights), faster on CPU.
# HF's eager path materialises [B, H, S, S] masks and scores, and runs the DSA indexer (no_grad;
# with index_topk >= the context it selects every key, so it changes nothing); this path uses
# SDPA's flash kernel (values zero-padded to the q/k head dim) with the causal mask, a float32
# router outside autocast, and per-expert slices of the tokens sorted by expert.
# fast_losses(...) == losses(...) is checked at the start and end of training (check_fast_path).

def _fast_attn(a, x, cos, sin):
    torch = _torch()
    F = torch.nn.functional
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave
    B, S, _ = x.shape
    H, nope, rope, vd = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
    q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x))).view(B, S, H, nope + rope).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [nope, rope], dim=-1)
    kv_pass, k_rot = torch.split(a.kv_a_proj_with_mqa(x), [a.kv_lora_rank, rope], dim=-1)
    k_rot = k_rot.reshape(B, 1, S, rope)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    kv = a.kv_b_proj(a.kv_a_layernorm(kv_pass)).view(B, S, H, nope + vd).transpose(1, 2)
    k_nope, v = torch.split(kv, [nope, vd], dim=-1)
    k = torch.cat([k_nope, k_rot.expand(B, H, S, rope).to(k_nope.dtype)], dim=-1)
    q = torch.cat([q_pass, q_rot.to(q_pass.dtype)], dim=-1)
    dq = nope + rope
    vp = F.pad(v, (0, dq - vd)) if dq > vd else v
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), vp.to(q.dtype), is_causal=True, scale=a.scaling)
    o = o[..., :vd].transpose(1, 2).reshape(B, S, H * vd)
    return a.o_proj(o)


def _fast_moe(mlp, x, mon):
    torch = _torch()
    F = torch.nn.functional
    B, S, D = x.shape
    xs = x.reshape(-1, D)
    gate, ex = mlp.gate, mlp.experts
    E, K = gate.num_experts, gate.top_k
    with torch.autocast("cpu", enabled=False):
        rl = F.linear(xs.float(), gate.weight.float())
        scores = rl.sigmoid()
        idx = torch.topk(scores.detach() + gate.e_score_correction_bias, K, dim=-1).indices
        w = scores.gather(1, idx)
        if gate.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * gate.routed_scaling_factor
    if mon is not None:
        mon.record(gate, rl, idx)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = torch.bincount(flat, minlength=E).tolist()
    # split (not slicing): its backward is one concatenation, where each slice's backward would
    # zero-fill and add a full [N*K, D] buffer per expert.
    segs = xs[tok].split(counts)
    outs = []
    I = ex.intermediate_dim
    gate_up, down = ex.gate_up_proj.unbind(0), ex.down_proj.unbind(0)   # one gradient buffer each
    for e, c in enumerate(counts):
        if c == 0:
            continue
        gu = F.linear(segs[e], gate_up[e])
        outs.append(F.linear(F.silu(gu[:, :I]) * gu[:, I:], down[e]))
    y = torch.cat(outs).float() * w.reshape(-1)[order, None]
    out = torch.zeros(xs.shape[0], D, dtype=y.dtype).index_add(0, tok, y)
    return out.view(B, S, D) + mlp.shared_experts(x)


def _fast_layer(layer, x, cos, sin, mon):
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaMoE
    x = x + _fast_attn(layer.self_attn, layer.input_layernorm(x), cos, sin)
    y = layer.post_attention_layernorm(x)
    y = _fast_moe(layer.mlp, y, mon) if isinstance(layer.mlp, GlmMoeDsaMoE) else layer.mlp(y)
    return x + y


def fast_logits(lm, head, x, mon=None):
    """Main logits [B, T, V] for windows x [B, T+1] and the MTP head's logits [B, T-1, V] (token
    t+2 from position t), through the fast layers (the path check_fast_path compares with HF)."""
    torch = _torch()
    inp = x[:, :-1]
    S = inp.shape[1]
    pos = torch.arange(S, dtype=torch.long)[None]
    h = lm.model.embed_tokens(inp)
    cos, sin = lm.model.rotary_emb(h, position_ids=pos)
    for layer in lm.model.layers:
        h = _fast_layer(layer, h, cos, sin, mon)
    hn = lm.model.norm(h)
    logits = lm.lm_head(hn)
    e = head.enorm(lm.model.embed_tokens(inp[:, 1:]))
    hx = head.eh_proj(torch.cat([e.to(hn.dtype), head.hnorm(hn[:, :-1]).to(hn.dtype)], dim=-1))
    o = _fast_layer(head.layer, hx, cos[:, :S - 1], sin[:, :S - 1], mon)
    return logits, lm.lm_head(head.shared_head_norm(o))


def fast_losses(lm, head, x, mon=None, reduction="mean"):
    logits, mlog = fast_logits(lm, head, x, mon)
    return cross_entropies(logits, mlog, x, reduction)


def mtp_kl(logits, mlog):
    """Mean over MTP rows of KL(main || MTP): the main model's distribution of t_{i+2} is its
    prediction at position i+1 (detached: a target for the head), the distribution the head's
    drafts are accepted against. logits [B, T, V], mlog [B, T-1, V]."""
    F = _torch().nn.functional
    logp = F.log_softmax(logits[:, 1:].detach().float(), dim=-1)           # [B, T-1, V]
    return F.kl_div(F.log_softmax(mlog.float(), dim=-1), logp, log_target=True, reduction="none").sum(-1).mean()


def check_fast_path(lm, head, x):
    """max |fast_losses - losses| (HF modules, eager) per token, f32, on the same batch."""
    torch = _torch()
    with torch.no_grad():
        a = losses(lm, head, x, reduction="none")
        b = fast_losses(lm, head, x, reduction="none")
    return max(float((a[0] - b[0]).abs().max()), float((a[1] - b[1]).abs().max()))


class RouterMonitor:
    """Expert loads of every router (for the bias update) and the batch-wise balance loss,
    recorded by the training forward."""

    def __init__(self, routers, n_experts, top_k):
        self.routers = list(routers)
        self.E, self.K = n_experts, top_k
        self.reset()

    def reset(self):
        torch = _torch()
        self.loads = [torch.zeros(self.E) for _ in self.routers]
        self.aux = []

    def record(self, gate, router_logits, idx):
        torch = _torch()
        i = next(j for j, r in enumerate(self.routers) if r is gate)
        cnt = torch.bincount(idx.reshape(-1), minlength=self.E).float()
        self.loads[i] += cnt
        if torch.is_grad_enabled():
            s = torch.sigmoid(router_logits.float())
            p = (s / s.sum(-1, keepdim=True)).mean(0)                  # mean normalised affinity
            f = cnt / (idx.shape[0] * self.K) * self.E                 # load fraction x E
            self.aux.append((f * p).sum())

    def update_bias(self, gamma):
        torch = _torch()
        with torch.no_grad():
            for mod, load in zip(self.routers, self.loads):
                mod.e_score_correction_bias += gamma * torch.sign(load.mean() - load)

    def imbalance(self):
        return [float(l.max() / max(float(l.mean()), 1e-9)) for l in self.loads]


# ----------------------------------------------------------------------------------------------
# Checkpoint IO
# ----------------------------------------------------------------------------------------------

EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
MTP_EXTRA = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")


def config_dict(cfg) -> dict:
    d = json.loads(cfg.to_json_string(use_diff=False))
    d.pop("_name_or_path", None)
    d["architectures"] = ["GlmMoeDsaForCausalLM"]
    d["dtype"] = "float32"
    d["num_nextn_predict_layers"] = 1
    return d


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def mtp_state(head) -> dict:
    """model.layers.{NL}.* tensors: the decoder layer (per-expert names, no indexer) + MTP extras."""
    pre = f"model.layers.{head.layer_idx}."
    I = head.mcfg.moe_intermediate_size
    out = {}
    for k, v in head.layer.state_dict().items():
        assert ".indexer." not in k, k
        if k == "mlp.experts.gate_up_proj":
            for e in range(v.shape[0]):
                out[pre + f"mlp.experts.{e}.gate_proj.weight"] = v[e, :I]
                out[pre + f"mlp.experts.{e}.up_proj.weight"] = v[e, I:]
        elif k == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                out[pre + f"mlp.experts.{e}.down_proj.weight"] = v[e]
        else:
            out[pre + k] = v
    out[pre + "eh_proj.weight"] = head.eh_proj.weight
    out[pre + "enorm.weight"] = head.enorm.weight
    out[pre + "hnorm.weight"] = head.hnorm.weight
    out[pre + "shared_head.norm.weight"] = head.shared_head_norm.weight
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def load_mtp_head(cfg, sd: dict):
    """An MTP head filled from checkpoint tensors (per-expert names), bit-exact."""
    torch = _torch()
    head = make_mtp_head(cfg)
    pre = f"model.layers.{head.layer_idx}."
    E = cfg.n_routed_experts
    lsd = {}
    for k in head.layer.state_dict():
        if k == "mlp.experts.gate_up_proj":
            lsd[k] = torch.stack([torch.cat([sd[pre + f"mlp.experts.{e}.gate_proj.weight"],
                                             sd[pre + f"mlp.experts.{e}.up_proj.weight"]]) for e in range(E)])
        elif k == "mlp.experts.down_proj":
            lsd[k] = torch.stack([sd[pre + f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
        else:
            lsd[k] = sd[pre + k]
    head.layer.load_state_dict(lsd, strict=True)
    with torch.no_grad():
        head.eh_proj.weight.copy_(sd[pre + "eh_proj.weight"])
        head.enorm.weight.copy_(sd[pre + "enorm.weight"])
        head.hnorm.weight.copy_(sd[pre + "hnorm.weight"])
        head.shared_head_norm.weight.copy_(sd[pre + "shared_head.norm.weight"])
    back = mtp_state(head)
    for k, v in back.items():
        assert torch.equal(v, sd[k].float()), f"MTP load mismatch {k}"
    return head.eval()


def check_names(names, cfg):
    """Per-expert names for every sparse layer and the MTP layer; MTP extras; no MTP indexer."""
    NL, E = cfg.num_hidden_layers, cfg.n_routed_experts
    assert not any("gate_up_proj" in n for n in names), "fused experts saved"
    sparse = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "sparse"] + [NL]
    found = {(int(m.group(1)), int(m.group(2)), m.group(3)) for m in map(EXPERT_RE.match, names) if m}
    want = {(i, e, p) for i in sparse for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
    assert found == want, sorted(found ^ want)[:5]
    pre = f"model.layers.{NL}."
    for x in MTP_EXTRA:
        assert pre + x in names, x
    assert not any(n.startswith(pre + "self_attn.indexer.") for n in names)
    assert f"{pre}mlp.gate.e_score_correction_bias" in names
    assert not any(n.startswith(f"model.layers.{NL + 1}.") for n in names)


def save_checkpoint(lm, head, tok, out, meta):
    """save_pretrained (main model) + the MTP layer merged into model.safetensors, config with
    num_nextn_predict_layers = 1, tokenizer files, and a bit-exact reload check."""
    torch = _torch()
    from safetensors.torch import load_file, save_file
    os.makedirs(out, exist_ok=True)
    lm.save_pretrained(out, safe_serialization=True)
    st = os.path.join(out, "model.safetensors")
    sd = load_file(st)
    extra = mtp_state(head)
    assert not set(extra) & set(sd)
    sd.update(extra)
    assert all(v.dtype == torch.float32 for v in sd.values())
    save_file(sd, st, metadata={"format": "pt"})
    check_names(list(sd), lm.config)
    write_json(os.path.join(out, "config.json"), config_dict(lm.config))
    tok.save(os.path.join(out, "tokenizer.json"))
    write_json(os.path.join(out, "tokenizer_config.json"), tokenizer_config())
    write_json(os.path.join(out, "train_meta.json"), meta)
    # reload: main model via from_pretrained (layer NL ignored by HF), head from the file
    lm2 = load_main(out)
    want = lm.state_dict()
    got = lm2.state_dict()
    assert set(got) == set(want), set(got) ^ set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), f"reload mismatch {k}"
    load_mtp_head(lm.config, sd)
    return lm2


def load_main(d, attn="eager"):
    """The main model through from_pretrained (it reports layer NL's tensors as unexpected and
    ignores them: HF has no MTP head)."""
    torch = _torch()
    from transformers import GlmMoeDsaForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    m = GlmMoeDsaForCausalLM.from_pretrained(d, attn_implementation=attn, dtype=torch.float32)
    return m.eval()


def load_checkpoint(d, attn="eager"):
    from safetensors.torch import load_file
    lm = load_main(d, attn)
    head = load_mtp_head(lm.config, load_file(os.path.join(d, "model.safetensors")))
    return lm, head


# ----------------------------------------------------------------------------------------------
# Evaluation helpers (torch)
# ----------------------------------------------------------------------------------------------

def windows(stream: np.ndarray, T: int, limit=None):
    """Non-overlapping [T+1]-token windows over a stream (consecutive windows share one token)."""
    n = (len(stream) - 1) // T
    if limit is not None:
        n = min(n, limit)
    return np.stack([stream[i * T: i * T + T + 1] for i in range(n)]).astype(np.int64)


def eval_loss(lm, head, stream, T, limit=None, batch=8, fast=False):
    """Mean per-token CE (nats) of the main model and of the MTP head over held-out windows
    (f32; fast=True: the training forward, else HF's modules)."""
    torch = _torch()
    W = windows(stream, T, limit)
    tot_m = tot_t = 0.0
    n_m = n_t = 0
    with torch.no_grad():
        for i in range(0, len(W), batch):
            x = torch.from_numpy(W[i:i + batch])
            m, t = (fast_losses(lm, head, x, reduction="sum") if fast
                    else losses(lm, head, x, reduction="sum"))
            tot_m += float(m)
            tot_t += float(t)
            n_m += x.shape[0] * (x.shape[1] - 1)
            n_t += x.shape[0] * (x.shape[1] - 2)
    return tot_m / n_m, tot_t / n_t, len(W)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------

def lr_at(step, tr):
    if step < tr["warmup"]:
        return tr["lr"] * (step + 1) / tr["warmup"]
    p = (step - tr["warmup"]) / max(1, tr["steps"] - tr["warmup"])
    return tr["lr"] * (tr["min_lr_frac"] + (1 - tr["min_lr_frac"]) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))


def param_groups(modules, wd):
    decay, no_decay = [], []
    for mod in modules:
        for _, p in mod.named_parameters():
            if not p.requires_grad:
                continue
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def sample_windows(rng, std, pkg, share, B, T):
    """[B, T+1] training windows at random offsets, each from the stdlib stream with probability share."""
    torch = _torch()
    src = [std if u < share else pkg for u in rng.random(B)]
    starts = [int(rng.integers(0, len(a) - T - 1)) for a in src]
    return torch.from_numpy(np.stack([a[s:s + T + 1] for a, s in zip(src, starts)]).astype(np.int64))


def joint_objective(lm, head, x, mon, tr, bf16=False):
    """(loss, main CE, MTP CE, MTP KL, balance loss) of windows x [B, T+1]: the training objective."""
    torch = _torch()
    mon.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits, mlog = fast_logits(lm, head, x, mon)
        main, mtp = cross_entropies(logits, mlog, x)
        kl = mtp_kl(logits, mlog) if tr["mtp_distill"] else torch.zeros(())
    aux = torch.stack(mon.aux).mean() if mon.aux else torch.zeros(())
    loss = main + tr["mtp_lambda"] * mtp + tr["balance_alpha"] * aux + tr["mtp_distill"] * kl
    return loss, main, mtp, kl, aux


def optimizer_step(opt, loss, clip, after_backward=None):
    """backward, gradient clipping, AdamW step; returns the gradient norm before clipping.
    after_backward() runs between the backward and the step (QuantMirror.restore_)."""
    torch = _torch()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if after_backward is not None:
        after_backward()
    gn = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
    opt.step()
    return gn


def save_state(path, lm, head, opt, rng, step, elapsed, **extra):
    """The resumable state (weights, optimizer, rng, step, wall time so far, extra) written atomically."""
    torch = _torch()
    st = {"lm": lm.state_dict(), "head": head.state_dict(), "opt": opt.state_dict(),
          "rng": rng.bit_generator.state, "step": step, "elapsed": elapsed, **extra}
    torch.save(st, path + ".tmp")
    os.replace(path + ".tmp", path)
    if os.environ.get("TRAIN_TINY_STOP_AT") == str(step):      # test hook for --resume
        raise SystemExit(f"stopped at step {step} (TRAIN_TINY_STOP_AT)")


def load_state(path, lm, head, opt, rng) -> dict:
    torch = _torch()
    st = torch.load(path, weights_only=False)
    lm.load_state_dict(st["lm"])
    head.load_state_dict(st["head"])
    opt.load_state_dict(st["opt"])
    rng.bit_generator.state = st["rng"]
    log(f"resumed from {path} at step {st['step']} ({st['elapsed'] / 60:.1f} min so far)")
    return st


def cmd_train(args):
    torch = _torch()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)          # subnormal floats (tiny Adam moments) are very slow on CPU
    from transformers import GlmMoeDsaForCausalLM
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    tr = dict(TRAIN)
    for k in ("steps", "batch", "seq_len", "lr", "max_minutes", "stdlib_share", "mtp_distill"):
        if getattr(args, k) is not None:
            tr[k] = getattr(args, k)
    t_all = time.time()

    # 1. corpus and tokenizer (trained on the training files only)
    tok, streams, man = prepare_data(args.out, args.wheels)
    train_std, train_pkg, held_ids = streams["std_train"], streams["pkg_train"], streams["std_held"]
    n_train = len(train_std) + len(train_pkg)
    log(f"corpus: stdlib {man['files']['std_train']} + packages {man['files']['pkg_train']} training files "
        f"({man['megabytes']['std_train'] + man['megabytes']['pkg_train']:.1f} MB, {n_train / 1e6:.2f}M tokens), "
        f"held-out stdlib {man['files']['std_held']} files ({len(held_ids)} tokens), "
        f"packages {man['files']['pkg_held']} files ({len(streams['pkg_held'])} tokens); "
        f"{man['dropped_duplicates']} duplicates dropped")

    # 3. model
    torch.manual_seed(SEED)
    cfg = build_config(args.attn)
    lm = GlmMoeDsaForCausalLM(cfg)
    head = make_mtp_head(cfg)
    head.init_weights(cfg.initializer_range)
    lm.train()
    head.train()
    n_main = sum(p.numel() for p in lm.parameters())
    n_head = sum(p.numel() for p in head.parameters())
    n_idx = sum(p.numel() for n, p in lm.named_parameters() if ".indexer." in n)
    D, I, E, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    n_inactive = sum(1 for t in cfg.mlp_layer_types if t == "sparse") * (E - K) * 3 * D * I
    log(f"model: {n_main / 1e6:.2f}M params main ({(n_main - n_inactive - n_idx) / 1e6:.2f}M active per token, "
        f"{n_idx / 1e6:.3f}M indexer), MTP head {n_head / 1e6:.2f}M; mlp {cfg.mlp_layer_types}, "
        f"indexer {cfg.indexer_types}")

    routers = [m for m in list(lm.modules()) + list(head.modules()) if isinstance(m, hf.GlmMoeDsaTopkRouter)]
    mon = RouterMonitor(routers, E, K)
    opt = torch.optim.AdamW(param_groups([lm, head], tr["weight_decay"]), lr=tr["lr"], betas=tr["betas"],
                            eps=1e-8)
    rng = np.random.default_rng(SEED)
    T, B = tr["seq_len"], tr["batch"]
    probe = torch.from_numpy(windows(held_ids, T, 2))
    d0 = check_fast_path(lm, head, probe)
    log(f"training forward vs HF modules (f32, 2 held-out windows, at init): max |dloss| {d0:.2e}")
    assert d0 < 1e-3, d0
    share = tr["stdlib_share"]             # windows drawn from the stdlib stream, the rest from packages
    eval_stream = held_ids
    curve = []
    t_train = time.time()
    tok_seen = 0
    steps = tr["steps"] if args.bench is None else args.bench
    stopped_early = None
    state_path = args.out.rstrip("/") + ".state.pt"
    first = 0
    if args.resume and os.path.exists(state_path):
        st = load_state(state_path, lm, head, opt, rng)
        first, tok_seen, curve = st["step"], st["tok_seen"], st["curve"]
        t_train = time.time() - st["elapsed"]
    for step in range(first, steps):
        if args.bench is None and step > first and step % tr["save_every"] == 0:
            save_state(state_path, lm, head, opt, rng, step, time.time() - t_train, tok_seen=tok_seen, curve=curve)
        if time.time() - t_train > 60 * tr["max_minutes"]:
            stopped_early = step
            log(f"WARNING: wall-clock cap of {tr['max_minutes']} min reached at step {step}; stopping")
            break
        x = sample_windows(rng, train_std, train_pkg, share, B, T)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tr)
        loss, main, mtp, kl, aux = joint_objective(lm, head, x, mon, tr, args.bf16)
        gn = optimizer_step(opt, loss, tr["grad_clip"])
        mon.update_bias(tr["bias_update"])
        tok_seen += B * T
        if step % tr["log_every"] == 0 or step == steps - 1 or args.bench is not None:
            el = time.time() - t_train
            imb = mon.imbalance()
            log(f"step {step:5d} | loss {main.item():.4f} mtp {mtp.item():.4f} kl {kl.item():.3f} aux {aux.item():.3f} | "
                f"lr {lr_at(step, tr):.2e} gn {float(gn):.2f} | max/mean load {max(imb):.2f} | "
                f"{tok_seen / el:.0f} tok/s, {el / 60:.1f} min")
            curve.append({"step": step, "loss": round(main.item(), 4), "mtp_loss": round(mtp.item(), 4),
                          "mtp_kl": round(kl.item(), 4),
                          "elapsed_s": round(el, 1)})
        if args.bench is None and ((step + 1) % tr["eval_every"] == 0 and step + 1 < steps):
            lm.eval(); head.eval()
            hm, ht, nw = eval_loss(lm, head, eval_stream, T, limit=tr["eval_windows"], fast=True)
            lm.train(); head.train()
            log(f"  held-out ({nw} windows): main {hm:.4f} mtp {ht:.4f}")
            curve[-1].update({"heldout_subset_loss": round(hm, 4), "heldout_subset_mtp": round(ht, 4)})
    train_s = time.time() - t_train
    if stopped_early is not None:
        steps = stopped_early
    log(f"trained {steps} steps ({tok_seen / 1e6:.2f}M tokens, {tok_seen / n_train:.2f} epochs) "
        f"in {train_s / 60:.1f} min")
    lm.eval(); head.eval()
    d1 = check_fast_path(lm, head, probe)
    log(f"training forward vs HF modules (f32, 2 held-out windows, trained): max |dloss| {d1:.2e}")
    assert d1 < 1e-3, d1
    if args.bench is not None:
        return 0

    # 4. save + evaluate the saved checkpoint
    meta = {
        "seed": SEED,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": sys.version.split()[0],
        "corpus": man,
        "train_files": man["files"]["std_train"] + man["files"]["pkg_train"],
        "heldout_files": man["heldout_files"],
        "train_tokens": int(n_train),
        "heldout_tokens": int(len(held_ids)),
        "train": {k: v for k, v in tr.items()},
        "params_main": n_main,
        "params_mtp": n_head,
        "params_indexer": n_idx,
        "steps": steps,
        "stopped_early_at": stopped_early,
        "tokens_seen": tok_seen,
        "train_seconds": round(train_s, 1),
        "threads": args.threads,
        "bf16_autocast": args.bf16,
        "fast_path_check": {"init": d0, "trained": d1},
        "curve": curve,
    }
    lm2 = save_checkpoint(lm, head, tok, args.out, meta)
    _, head2 = load_checkpoint(args.out)
    hm, ht, nw = eval_loss(lm2, head2, held_ids, T, fast=True)
    meta["heldout_loss"] = round(hm, 4)
    meta["heldout_mtp_loss"] = round(ht, 4)
    meta["heldout_windows"] = nw
    meta["total_seconds"] = round(time.time() - t_all, 1)
    write_json(os.path.join(args.out, "train_meta.json"), meta)
    log(f"held-out ({nw} windows of {T}): main loss {hm:.4f} (ppl {math.exp(hm):.2f}), "
        f"MTP (t+2) loss {ht:.4f} (ppl {math.exp(ht):.2f})")
    log(f"saved {args.out}; total {meta['total_seconds'] / 60:.1f} min")
    return 0


# ----------------------------------------------------------------------------------------------
# Containers: conversion and dequantization
# ----------------------------------------------------------------------------------------------

CONTAINER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "colibri_convert.json")


def colibri_cli(*args, check=True, timeout=900, env=None):
    env = dict(os.environ, **(env or {}))
    env.pop("OMP_WAIT_POLICY", None)         # the engine runs as it would for a user
    p = subprocess.run([sys.executable, "-m", "colibri", *map(str, args)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"colibri {' '.join(map(str, args))}: exit {p.returncode}\n{p.stderr}")
    return p


def convert_container(src, dst, bits, mtp_bits=8):
    """``python -m colibri convert`` into a fresh folder, then moved to dst (MODEL_CARD.md kept)."""
    tmp = dst.rstrip("/") + ".converting"
    shutil.rmtree(tmp, ignore_errors=True)
    colibri_cli("convert", src, tmp, "--expert-bits", bits, "--dense-bits", bits, "--io-bits", 8,
                "--mtp-bits", mtp_bits)
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(dst):
        if f in CONTAINER_FILES or re.match(r"^out-\d+\.safetensors$", f):
            os.remove(os.path.join(dst, f))
    for f in sorted(os.listdir(tmp)):
        shutil.move(os.path.join(tmp, f), os.path.join(dst, f))
    os.rmdir(tmp)
    return container_bytes(dst)


def container_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))


def dequantized_state(container, f32_dir) -> dict:
    """The container's tensors under HF names, quantized matrices dequantized (v * s) to f32 exactly
    as the engine's float path reads them; shapes from the f32 checkpoint."""
    from safetensors.numpy import load_file

    from colibri.quant import dequantize
    ref = load_file(os.path.join(f32_dir, "model.safetensors"))
    cont = {}
    for f in sorted(os.listdir(container)):
        if f.endswith(".safetensors"):
            cont.update(load_file(os.path.join(container, f)))
    out = {}
    for k, v in ref.items():
        if k + ".qs" in cont:
            out[k] = dequantize(cont[k], cont[k + ".qs"], v.shape[0], v.shape[1], name=k)
        else:
            assert cont[k].dtype == np.float32 and cont[k].shape == v.shape, k
            out[k] = cont[k]
    used = set(out) | {k + ".qs" for k in out}
    assert used >= set(cont), sorted(set(cont) - used)[:5]
    return out


# HF's fused expert tensors ([E, 2I, H] gate+up, [E, H, I] down); the container and the f32
# checkpoint hold them per expert (model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight)
FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def models_from_state(f32_dir, sd: dict):
    """HF main model (eager, f32) + MTP head with the given HF-named state (per-expert names)."""
    torch = _torch()
    lm = load_main(f32_dir)
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}
    E, I = lm.config.n_routed_experts, lm.config.moe_intermediate_size
    lsd = {}
    for k in lm.state_dict():
        m = FUSED_EXPERTS.match(k)
        if m and m.group(2) == "gate_up_proj":
            lsd[k] = torch.stack([torch.cat([t[f"{m.group(1)}.{e}.gate_proj.weight"],
                                             t[f"{m.group(1)}.{e}.up_proj.weight"]]) for e in range(E)])
        elif m:
            lsd[k] = torch.stack([t[f"{m.group(1)}.{e}.down_proj.weight"] for e in range(E)])
        else:
            lsd[k] = t[k]
    lm.load_state_dict(lsd, strict=True)
    assert lm.model.layers[1].mlp.experts.gate_up_proj.shape[1] == 2 * I
    head = load_mtp_head(lm.config, t)
    return lm.eval(), head


def load_tokenizer(d):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(d, "tokenizer.json"))


def heldout_prompts(n=N_PROMPTS):
    """(file, prompt): the first top-level 'def NAME(...):' line of held-out files, sorted by path,
    each prompt once (the codec modules share their getregentry())."""
    _, held = load_corpus()
    out, seen = [], set()
    for rel, text in held:
        for line in text.split("\n"):
            if re.match(r"^def \w+\(.*\):$", line) and len(line) <= 72:
                if line not in seen:
                    seen.add(line)
                    out.append((rel, line))
                break
        if len(out) == n:
            break
    return out


# ----------------------------------------------------------------------------------------------
# Fine-tuning against greedy loops: sequence-level unlikelihood (Welleck et al., 2019)
# ----------------------------------------------------------------------------------------------
#
# A small model's greedy decoding falls into loops (`import os` x26): at each step its argmax
# repeats an n-gram it produced before. Half of the fine-tuning steps are the training objective
# on corpus windows; the other half continue top-level `def`/`class` lines of the training files
# greedily with the current weights and penalise, at every continuation token inside a 4-gram
# that occurred earlier in the sequence, the probability the model gave it:
#
#     UL = -1/N * sum_{t in continuation, t in a repeated 4-gram} log(1 - p(x_t | x_<t))
#
# (N: continuation tokens). Only the repeats the model itself would decode greedily are pushed
# down; the corpus steps keep the held-out loss. The MTP head follows the main model on both
# (its KL term), so its drafts stay accepted.

TUNE = dict(
    steps=420,
    lr=3e-4,
    min_lr_frac=0.1,
    warmup=20,
    ul_share=0.5,                       # share of steps that are unlikelihood steps
    ul_batch=8,                         # greedy continuations per unlikelihood step
    ul_new=128,                         # tokens generated per continuation (the eval's length)
    ul_ngram=4,
    ul_max_prefix=32,                   # longest def/class line used as a prefix (tokens)
    ul_window_share=0.25,               # unlikelihood prefixes taken at a random corpus offset instead
    ul_alpha=1.0,                       # weight of the unlikelihood term
    anti_loop="unlikelihood",           # what the ul_share steps are: "unlikelihood" or "ditto"
    ul_kl=0.0,                          # weight of KL(start model || model) on the unpenalised continuation tokens
    ditto_lambda=0.5,                   # DITTO: a repeat's probability is pushed to lambda x the last one's
    ditto_len=256,                      # DITTO sequences: a corpus prefix, then one span repeated to this length
    ditto_span=(4, 24),                 # ... the repeated span's length in tokens (inclusive)
    qat=False,                          # train the container's quantized image (QuantMirror)
    val_prompts=16,                     # held-out *package* def lines whose greedy loops are watched
    keep_best=False,                    # save the evaluation with the fewest validation loops
    keep_best_slack=0.05,               # ... among those within this of the start's package loss
    keep_best_max_ref_nll=3.0,          # ... whose continuations the start model finds likely enough
    keep_best_heldout_slack=None,       # ... and within this of the start's held-out stdlib subset loss
                                        #     (None: no bound; with a bound the start itself is a candidate)
    keep_best_by_loop_free=False,       # best = most prompts >= DISTINCT_OK (then the mean), not the mean
    eval_every=60,
    log_every=10,
    max_minutes=60,
)

# The rounds the shipped model went through (`tune --round N`): each tunes the container the round
# before it converted, with TUNE updated by its entries.
# quantization-aware, unlikelihood anchored by KL to the round's start (only the repeats move)
QAT_UL_ROUND = {"qat": True, "ul_kl": 1.0, "lr": 2e-4, "steps": 240, "ul_share": 0.65, "eval_every": 40,
                "val_prompts": 24, "keep_best": True, "keep_best_max_ref_nll": 2.5, "keep_best_by_loop_free": True}
# round 3 is round 2's recipe once more, on round 2's container (its own prefixes: the seed moves with the round)
# rounds 4-: the same, anchored harder (KL weight 2, half the steps on the corpus, lower lr) and kept
# only where the held-out stdlib subset loss moved by at most 0.006 (the full held-out loss moves ~2x that)
QAT_UL_ANCHORED = dict(QAT_UL_ROUND, ul_kl=2.0, ul_share=0.5, lr=1.5e-4, keep_best_heldout_slack=0.006)
TUNE_ROUNDS = [{}, QAT_UL_ROUND, QAT_UL_ROUND, QAT_UL_ANCHORED, QAT_UL_ANCHORED]


def line_prefixes(tok, stream, max_len):
    """{length: array of start offsets} of the top-level `def` / `class` lines of a token stream:
    the keyword token right after a newline (or <|endoftext|>), up to the first token holding a
    newline; lines of 3..max_len tokens."""
    vocab = tok.get_vocab_size()
    has_nl = np.array(["\u010a" in (tok.id_to_token(i) or "") for i in range(vocab)])   # byte-level '\n'
    kw = [tok.token_to_id(w) for w in ("def", "class")]
    eos = tok.token_to_id(EOS)
    s = stream.astype(np.int64)
    at_kw = np.isin(s[1:], kw) & (has_nl[s[:-1]] | (s[:-1] == eos))
    starts = np.flatnonzero(at_kw) + 1
    nl = np.flatnonzero(has_nl[s])
    ends = nl[np.minimum(np.searchsorted(nl, starts), len(nl) - 1)]
    lens = ends - starts
    out = {}
    for L in range(3, max_len + 1):
        sel = starts[lens == L]
        if len(sel) >= 8:
            out[L] = sel
    return out


def repeat_marks(x, start, n):
    """x [B, S] int -> [B, S] bool: positions >= start that lie inside an n-gram which occurred
    earlier in the same row (the tokens a loop repeats)."""
    B, S = x.shape
    m = np.zeros((B, S), dtype=bool)
    for b in range(B):
        seen = set()
        row = x[b].tolist()
        for t in range(n - 1, S):
            g = tuple(row[t - n + 1:t + 1])
            if g in seen and t >= start:
                m[b, max(start, t - n + 1):t + 1] = True
            seen.add(g)
    return m


def greedy_continue(lm, prefix, n):
    """prefix [B, P] -> [B, P + n]: greedy continuations by transformers' generate (KV cache),
    never stopping early (<|endoftext|> is just a token here)."""
    torch = _torch()
    with torch.no_grad():
        x = lm.generate(input_ids=prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=n,
                        do_sample=False, eos_token_id=None, pad_token_id=0)
    assert x.shape == (prefix.shape[0], prefix.shape[1] + n), x.shape
    return x


def ul_prefixes(rng, lines, std, pkg, share, tu):
    """[B, P] prefixes for one unlikelihood step: B top-level def/class lines of one length (so the
    batch needs no padding), or B random corpus windows of a random length."""
    torch = _torch()
    B = tu["ul_batch"]
    if rng.random() < tu["ul_window_share"]:
        P = int(rng.integers(8, tu["ul_max_prefix"] + 1))
        return sample_windows(rng, std, pkg, share, B, P - 1)
    src = int(rng.random() >= share)
    L = int(rng.choice(sorted(lines[src])))
    starts = rng.choice(lines[src][L], size=B, replace=len(lines[src][L]) < B)
    a = (std, pkg)[src]
    return torch.from_numpy(np.stack([a[s:s + L] for s in starts]).astype(np.int64))


def unlikelihood_objective(lm, head, x, P, mon, tr, tu, ref=None):
    """(loss, UL, share of continuation tokens in repeated n-grams, MTP KL) for sequences x [B, S]
    whose first P tokens are the prefix. With tu["ul_kl"] and ref (the round's starting model),
    plus ul_kl x KL(ref || model) at the continuation tokens UL leaves alone: the anchor that keeps
    a small model from escaping its loops into rare-token soup (only the repeats move)."""
    torch = _torch()
    F = torch.nn.functional
    marks = torch.from_numpy(repeat_marks(x.numpy(), P, tu["ul_ngram"]))
    mon.reset()
    logits, mlog = fast_logits(lm, head, x, mon)                  # [B, S-1, V] predicts x[:, 1:]
    lp = F.log_softmax(logits.float(), dim=-1).gather(-1, x[:, 1:, None])[..., 0]
    one_minus = (-torch.expm1(lp)).clamp_min(1e-5)                 # 1 - p(x_t), without cancellation
    m = marks[:, 1:].float()
    n_cont = x.shape[0] * (x.shape[1] - P)
    ul = -(torch.log(one_minus) * m).sum() / n_cont
    kl = mtp_kl(logits, mlog) if tr["mtp_distill"] else torch.zeros(())
    aux = torch.stack(mon.aux).mean() if mon.aux else torch.zeros(())
    loss = tu["ul_alpha"] * ul + tr["mtp_distill"] * kl + tr["balance_alpha"] * aux
    if tu["ul_kl"] and ref is not None:
        with torch.no_grad():
            rlog, _ = fast_logits(ref[0], ref[1], x)
        rl = F.log_softmax(rlog.float(), dim=-1)[:, P - 1:]         # [B, S-P, V] continuation positions
        ml = F.log_softmax(logits.float(), dim=-1)[:, P - 1:]
        keep = 1.0 - m[:, P - 1:]
        akl = ((rl.exp() * (rl - ml)).sum(-1) * keep).sum() / keep.sum().clamp_min(1.0)
        loss = loss + tu["ul_kl"] * akl
    return loss, ul, float(m.sum()) / n_cont, kl


def ditto_batch(rng, std, pkg, share, tu):
    """(x [B, ditto_len], P, L) for one DITTO step: a corpus prefix of P tokens, then the L tokens
    that follow it in the corpus repeated to the end (the "sentence" repeated N times of Xu et
    al., 2022)."""
    torch = _torch()
    B, S = tu["ul_batch"], tu["ditto_len"]
    P = int(rng.integers(16, 65))
    L = int(rng.integers(tu["ditto_span"][0], tu["ditto_span"][1] + 1))
    w = sample_windows(rng, std, pkg, share, B, P + L - 1)           # [B, P + L]
    reps = -(-(S - P) // L)
    return torch.cat([w[:, :P], w[:, P:].repeat(1, reps)], dim=1)[:, :S], P, L


def ditto_objective(lm, head, x, P, L, mon, tr, tu):
    """(loss, DITTO term, MTP KL) on a repeated span (Xu et al., 2022, "Learning to break the
    loop"): a small model's probability of repeating a span grows with each repetition (the
    self-reinforcement that makes greedy decoding loop). For every token of the 2nd, 3rd, ...
    copy, with p_n its probability there and p_{n-1} (held fixed) at the same token of the copy
    before,

        DITTO = mean -log(1 - max(p_n - lambda * p_{n-1}, 0))

    so a repetition's probability decays by lambda with each copy instead of growing (one-sided:
    the paper's |p_n - lambda p_{n-1}| would also raise a repeat's probability where it is below). The text the
    model continues stays the corpus's (no generated junk is rewarded, unlike unlikelihood on
    its own continuations, which a small model escapes into rare-token soup)."""
    torch = _torch()
    F = torch.nn.functional
    mon.reset()
    logits, mlog = fast_logits(lm, head, x, mon)                  # [B, S-1, V] predicts x[:, 1:]
    p = F.softmax(logits.float(), dim=-1).gather(-1, x[:, 1:, None])[..., 0]     # [B, S-1]
    t = torch.arange(P + L, x.shape[1])                            # tokens of the 2nd copy on
    pn, prev = p[:, t - 1], p[:, t - 1 - L].detach()
    d = -torch.log((1 - (pn - tu["ditto_lambda"] * prev).clamp_min(0)).clamp_min(1e-5)).mean()
    kl = mtp_kl(logits, mlog) if tr["mtp_distill"] else torch.zeros(())
    aux = torch.stack(mon.aux).mean() if mon.aux else torch.zeros(())
    loss = tu["ul_alpha"] * d + tr["mtp_distill"] * kl + tr["balance_alpha"] * aux
    return loss, d, float(pn.detach().mean()), kl


def models_from_container(container, work):
    """HF main model + MTP head holding a container's weights dequantized to f32 (the tensor names and
    shapes from a freshly initialised checkpoint of MODEL written to WORK first)."""
    from transformers import GlmMoeDsaForCausalLM
    _torch().manual_seed(SEED)
    cfg = build_config()
    lm, head = GlmMoeDsaForCausalLM(cfg), make_mtp_head(cfg)
    head.init_weights(cfg.initializer_range)      # not torch.empty's garbage (a NaN fails the bit-exact check)
    save_checkpoint(lm, head, load_tokenizer(container), work, meta={})
    return models_from_state(work, dequantized_state(container, work))


def fake_quant(w, bits):
    """w [..., I] -> its quantize-dequantize image under the converter's per-row scheme
    (colibri.quant.quantize_rows): s = max(amax / qmax, 1e-8), v = clip(rint(w / s), -qmax-1, qmax),
    w' = v * s, all in f32, so the container built from w holds exactly w'."""
    torch = _torch()
    qmax = (1 << (bits - 1)) - 1
    s = (w.abs().amax(dim=-1, keepdim=True) / qmax).clamp_min(1e-8)
    return torch.round(w / s).clamp_(-qmax - 1, qmax).mul_(s)


class QuantMirror:
    """Quantization-aware tuning, straight-through: from quantize_() to restore_() (or inside
    quantized()), every main-model
    matrix the container stores quantized holds its fake_quant image, so the greedy continuations,
    losses and gradients are those of the model the container ships; restore_() puts the f32
    masters back before the optimizer steps them with those gradients. (The MTP head stays f32:
    it changes no emitted token, and its int8 image is close.)"""

    def __init__(self, lm, container):
        from safetensors import safe_open

        from colibri.quant import infer_format
        fmt_bits = {"int8": 8, "int4": 4}
        stored = {}
        for f in sorted(os.listdir(container)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(container, f), "np") as sf:
                    for k in sf.keys():
                        stored[k] = sf.get_slice(k).get_shape()
        self.params = []                                  # (parameter, bits)
        for name, p in lm.named_parameters():
            m = FUSED_EXPERTS.match(name)
            keys = ([f"{m.group(1)}.{e}.{w}.weight" for e in range(p.shape[0])
                     for w in (("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",))]
                    if m else [name])
            if keys[0] + ".qs" not in stored:
                continue
            O, I = p.shape[-2], p.shape[-1]
            if m and m.group(2) == "gate_up_proj":
                O //= 2
            bits = set()
            for k in keys:
                if len(stored[k + ".qs"]) != 1:
                    raise SystemExit(f"{container}: {k} has group scales; QuantMirror does per-row only")
                bits.add(fmt_bits[infer_format(stored[k][0], O, I, k)])
            if len(bits) != 1:
                raise SystemExit(f"{container}: {name}'s experts are stored in mixed formats")
            self.params.append((p, bits.pop()))
        self.masters = None

    def quantize_(self):
        torch = _torch()
        with torch.no_grad():
            self.masters = [p.detach().clone() for p, _ in self.params]
            for p, bits in self.params:
                p.copy_(fake_quant(p, bits))

    def restore_(self):
        torch = _torch()
        with torch.no_grad():
            for (p, _), m in zip(self.params, self.masters):
                p.copy_(m)
        self.masters = None

    @contextlib.contextmanager
    def quantized(self):
        self.quantize_()
        try:
            yield
        finally:
            if self.masters is not None:
                self.restore_()


def val_prompts(tok, stream, n, max_len):
    """n greedy-validation prefixes [n/2, L] x 2: top-level def/class lines of the held-out *package*
    files (never the model card's held-out stdlib prompts), the two most common line lengths, spread
    evenly over the stream."""
    torch = _torch()
    lines = line_prefixes(tok, stream, max_len)
    out = []
    for L in sorted(lines, key=lambda L: -len(lines[L]))[:2]:
        sel = lines[L][np.linspace(0, len(lines[L]) - 1, n // 2).astype(int)]
        out.append(torch.from_numpy(np.stack([stream[s:s + L] for s in sel]).astype(np.int64)))
    return out


def val_distinct(lm, prompts, n_new, ref):
    """(mean, min, share >= DISTINCT_OK) distinct 4-gram ratio of greedy continuations of the
    validation prompts, and the continuations' mean NLL under ref (the round's starting model):
    loops score low there, rare-token soup (a small model's escape from a too strong anti-loop
    term) high."""
    torch = _torch()
    F = torch.nn.functional
    d, nll, n = [], 0.0, 0
    for pr in prompts:
        x = greedy_continue(lm, pr, n_new)
        d += [distinct_ngrams(r) for r in x[:, pr.shape[1]:].tolist()]
        with torch.no_grad():
            logits, _ = fast_logits(ref[0], ref[1], x)
            lp = F.log_softmax(logits.float(), dim=-1).gather(-1, x[:, 1:, None])[..., 0]
        nll -= float(lp[:, pr.shape[1] - 1:].sum())
        n += lp[:, pr.shape[1] - 1:].numel()
    return float(np.mean(d)), float(np.min(d)), float(np.mean(np.array(d) >= DISTINCT_OK)), nll / n


def tune_rounds(meta) -> list:
    """The tuning rounds recorded in a train_meta.json, oldest first (one dict in older files)."""
    tn = meta.get("tune") or []
    return [tn] if isinstance(tn, dict) else list(tn)


def base_meta(args) -> dict:
    """The training metadata of the model being tuned (--base-meta, else the container's), with the
    rounds that made it and its held-out figures; this round is appended to meta["tune"]."""
    for d in (args.base_meta, os.path.join(args.model, "train_meta.json")):
        if d and os.path.exists(d):
            with open(d) as f:
                meta = json.load(f)
            meta["tune"] = tune_rounds(meta)[:args.round - 1]
            if len(meta["tune"]) != args.round - 1:
                raise SystemExit(f"--round {args.round}: {d} records {len(meta['tune'])} earlier rounds, "
                                 f"not {args.round - 1} (tune the container of round {args.round - 1})")
            return meta
    raise SystemExit(f"no training metadata: give --base-meta (the train_meta.json of {args.model}'s training)")


def cmd_tune(args):
    """Fine-tune a container's weights (dequantized) against greedy loops; f32 checkpoint in --out."""
    torch = _torch()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf
    if not 1 <= args.round <= len(TUNE_ROUNDS):
        raise SystemExit(f"--round: 1..{len(TUNE_ROUNDS)} (TUNE_ROUNDS), not {args.round}")
    tr, tu = dict(TRAIN), dict(TUNE, **TUNE_ROUNDS[args.round - 1])
    for k in ("steps", "lr", "ul_share", "max_minutes"):
        if getattr(args, k) is not None:
            tu[k] = getattr(args, k)
    meta = base_meta(args)
    tok, streams, man = prepare_data(args.out, args.wheels)
    if tok.to_str() != load_tokenizer(args.model).to_str():
        raise SystemExit(f"{args.model}'s tokenizer is not the one prepare_data trains: not this corpus's model")
    std, pkg, held = streams["std_train"], streams["pkg_train"], streams["std_held"]
    lines = [line_prefixes(tok, a, tu["ul_max_prefix"]) for a in (std, pkg)]
    log(f"unlikelihood prefixes: {sum(len(v) for v in lines[0].values())} stdlib and "
        f"{sum(len(v) for v in lines[1].values())} package def/class lines")
    lm, head = models_from_container(args.model, args.out.rstrip("/") + ".init")
    mirror = QuantMirror(lm, args.model) if tu["qat"] else None
    quantized = mirror.quantized if mirror else contextlib.nullcontext
    if mirror:
        with torch.no_grad():
            drift = max(float((fake_quant(p, b) - p).abs().max()) for p, b in mirror.params)
        log(f"quantization-aware: {len(mirror.params)} matrices as the container stores them "
            f"(requantizing its own weights moves them by at most {drift:.2e})")
    vals = val_prompts(tok, streams["pkg_held"], tu["val_prompts"], tu["ul_max_prefix"])
    ref = (copy.deepcopy(lm).eval(), copy.deepcopy(head).eval())   # the start (== its quantized image)
    lm.train(); head.train()
    E, K = lm.config.n_routed_experts, lm.config.num_experts_per_tok
    routers = [m for m in list(lm.modules()) + list(head.modules()) if isinstance(m, hf.GlmMoeDsaTopkRouter)]
    mon = RouterMonitor(routers, E, K)
    opt = torch.optim.AdamW(param_groups([lm, head], tr["weight_decay"]), lr=tu["lr"], betas=tr["betas"], eps=1e-8)
    rng = np.random.default_rng(SEED + args.round)                # each round its own prefixes
    T, B = tr["seq_len"], tr["batch"]

    def evaluate():
        """held-out stdlib subset (main, MTP), held-out package subset, validation loops; all of
        the model as it ships (quantized) when QAT is on."""
        lm.eval(); head.eval()
        with quantized():
            hm, ht, _ = eval_loss(lm, head, held, T, limit=tr["eval_windows"], fast=True)
            pm, _, _ = eval_loss(lm, head, streams["pkg_held"], T, limit=tr["eval_windows"], fast=True)
            vd, vmin, vok, vref = val_distinct(lm, vals, tu["ul_new"], ref)
        lm.train(); head.train()
        return dict(heldout_subset_loss=round(hm, 4), heldout_subset_mtp=round(ht, 4),
                    pkg_subset_loss=round(pm, 4), val_distinct=round(vd, 4), val_distinct_min=round(vmin, 4),
                    val_loop_free=round(vok, 4), val_ref_nll=round(vref, 4))

    ev0 = evaluate()
    h0 = ev0["heldout_subset_loss"]

    def keepable(row) -> bool:
        """may this evaluation be the one the round keeps (keep_best)?"""
        hs = tu["keep_best_heldout_slack"]
        return (row["pkg_subset_loss"] <= ev0["pkg_subset_loss"] + tu["keep_best_slack"]
                and row["val_ref_nll"] <= tu["keep_best_max_ref_nll"]
                and (hs is None or row["heldout_subset_loss"] <= h0 + hs))

    def keep_score(row):
        return (row["val_loop_free"], row["val_distinct"]) if tu["keep_best_by_loop_free"] else row["val_distinct"]

    log(f"start ({args.model}, dequantized): " + " ".join(f"{k} {v}" for k, v in ev0.items()))
    curve, first, t_run = [{"step": 0, **ev0}], 0, time.time()
    best = None                                          # (step, keep score, lm state, head state)
    if tu["keep_best"] and tu["keep_best_heldout_slack"] is not None:
        best = (0, keep_score(ev0), copy.deepcopy(lm.state_dict()), copy.deepcopy(head.state_dict()))
    state_path = args.out.rstrip("/") + ".state.pt"
    if args.resume and os.path.exists(state_path):
        st = load_state(state_path, lm, head, opt, rng)
        first, curve, t_run, best = st["step"], st["curve"], time.time() - st["elapsed"], st.get("best")
    sched = dict(tr, lr=tu["lr"], min_lr_frac=tu["min_lr_frac"], warmup=tu["warmup"], steps=tu["steps"])
    recent = {"ce": [], "ul": [], "rep": []}
    steps = tu["steps"]
    for step in range(first, tu["steps"]):
        if step > first and step % tr["save_every"] == 0:
            save_state(state_path, lm, head, opt, rng, step, time.time() - t_run, curve=curve, best=best)
        if time.time() - t_run > 60 * tu["max_minutes"]:
            log(f"WARNING: wall-clock cap of {tu['max_minutes']} min reached at step {step}; stopping")
            steps = step
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, sched)
        if mirror:
            mirror.quantize_()
        anti_loop = rng.random() < tu["ul_share"]
        if anti_loop and tu["anti_loop"] == "ditto":
            x, P, L = ditto_batch(rng, std, pkg, tr["stdlib_share"], tu)
            loss, ul, rep, kl = ditto_objective(lm, head, x, P, L, mon, tr, tu)
            recent["ul"].append(float(ul.detach())); recent["rep"].append(rep)
        elif anti_loop:
            prefix = ul_prefixes(rng, lines, std, pkg, tr["stdlib_share"], tu)
            lm.eval()
            x = greedy_continue(lm, prefix, tu["ul_new"])
            lm.train()
            loss, ul, rep, kl = unlikelihood_objective(lm, head, x, prefix.shape[1], mon, tr, tu, ref)
            recent["ul"].append(float(ul.detach())); recent["rep"].append(rep)
        else:
            x = sample_windows(rng, std, pkg, tr["stdlib_share"], B, T)
            loss, main, mtp, kl, aux = joint_objective(lm, head, x, mon, tr)
            recent["ce"].append(float(main.detach()))
            mon.update_bias(tr["bias_update"])              # router loads of corpus text only
        optimizer_step(opt, loss, tr["grad_clip"], after_backward=mirror.restore_ if mirror else None)
        last = step == tu["steps"] - 1
        if (step + 1) % tu["log_every"] == 0 or last:
            el = time.time() - t_run
            row = {"step": step + 1, "elapsed_s": round(el, 1)}
            for k in recent:
                if recent[k]:
                    row[k] = round(float(np.mean(recent[k])), 4)
            recent = {k: [] for k in recent}
            if (step + 1) % tu["eval_every"] == 0 or last:
                row.update(evaluate())
                if tu["keep_best"] and keepable(row) and (best is None or keep_score(row) > best[1]):
                    best = (step + 1, keep_score(row), copy.deepcopy(lm.state_dict()),
                            copy.deepcopy(head.state_dict()))
            curve.append(row)
            log(f"step {step + 1:4d} | " + " ".join(f"{k} {v}" for k, v in row.items() if k != "step")
                + f" | lr {lr_at(step, sched):.2e} | {el / 60:.1f} min")
    tune_s = time.time() - t_run
    if best is not None and best[0] != steps:
        log(f"keeping step {best[0]} (validation score {best[1]}, the best evaluation keepable() allowed)")
        lm.load_state_dict(best[2]); head.load_state_dict(best[3])
    lm.eval(); head.eval()
    rnd = {"round": args.round, "from": os.path.relpath(os.path.abspath(args.model), ROOT), "params": tu,
           "steps": steps, "seconds": round(tune_s, 1), "curve": curve, "seed": SEED + args.round,
           "start_heldout_subset_loss": round(h0, 4), "kept_step": best[0] if best else steps}
    meta["tune"].append(rnd)
    lm2 = save_checkpoint(lm, head, tok, args.out, meta)
    _, head2 = load_checkpoint(args.out)
    hm, ht, nw = eval_loss(lm2, head2, held, T, fast=True)
    rnd.update(heldout_loss=round(hm, 4), heldout_mtp_loss=round(ht, 4), heldout_windows=nw)
    if mirror:                                           # what the container will hold
        with mirror.quantized():
            hq, _, _ = eval_loss(lm, head, held, T, fast=True)
        rnd["heldout_loss_quantized"] = round(hq, 4)
        log(f"held-out loss of the quantized image: {hq:.4f}")
    write_json(os.path.join(args.out, "train_meta.json"), meta)
    log(f"tuned {steps} steps in {tune_s / 60:.1f} min; held-out ({nw} windows): main {hm:.4f} "
        f"(ppl {math.exp(hm):.2f}), MTP {ht:.4f}; saved {args.out}")
    return 0


# ----------------------------------------------------------------------------------------------
# Reference for the test suite: transformers on the container's dequantized weights
# ----------------------------------------------------------------------------------------------

REF_NEW = 64
CLI_PROMPT = "def fibonacci(n):"
CLI_TOKENS = 24


def _oracle():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_oracle
    return make_oracle


ROUTE_MIN_GAP = 5e-5    # the parity prompt's smallest gap between a router's k-th and (k+1)-th choice


def routing_gaps(lm, ids):
    """[S] per position of ids (teacher-forced, no cache): over the main model's MoE layers, the
    smallest gap between the k-th and the (k+1)-th expert's score for choice (sigmoid + bias).
    Where it is tiny, the int8-activation engine (~2e-4 of a logit off f32) may pick the other
    expert, and every later logit moves by more than the numerics do: no place for a parity test."""
    torch = _torch()
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf
    gaps = []

    def hook(mod, inp, out):
        h = inp[0].reshape(-1, mod.hidden_dim).float()
        sc = torch.sigmoid(h @ mod.weight.float().t()) + mod.e_score_correction_bias
        top = sc.topk(mod.top_k + 1, dim=-1)[0]
        gaps.append(top[:, -2] - top[:, -1])
    hs = [m.register_forward_hook(hook) for m in lm.modules() if isinstance(m, hf.GlmMoeDsaTopkRouter)]
    try:
        with torch.no_grad():
            lm(input_ids=torch.tensor([ids]))
    finally:
        for h in hs:
            h.remove()
    return torch.stack(gaps).min(0)[0].numpy()


def cmd_ref(args):
    torch = _torch()
    torch.set_num_threads(args.threads)
    mo = _oracle()
    tok = load_tokenizer(args.model)
    lm, _ = models_from_state(args.src, dequantized_state(args.model, args.src))
    eos = lm.config.eos_token_id
    # the parity reference: a held-out prompt whose greedy continuation has no <|endoftext|> (the
    # engine's generate() would not stop there, the CLI would), no near-tie at the argmax and none
    # between a router's k-th and (k+1)-th expert
    chosen = None
    for rel, text in heldout_prompts(N_PROMPTS):
        prompt = tok.encode(text).ids
        ref = mo.compute_ref(lm, prompt, REF_NEW)
        d = ref["diagnostics"]
        gap = float(routing_gaps(lm, ref["full_ids"]).min())
        log(f"  {rel}: {text!r}: {len(prompt)} + {REF_NEW} tokens, min margin "
            f"{min(d['tf_min_argmax_margin'], d['greedy_min_argmax_margin']):.2e}, eos {d['eos_token_in_continuation']}, "
            f"generate==cacheless {ref['generate_matches_cacheless']}, min routing gap {gap:.2e}")
        if (not d["eos_token_in_continuation"] and ref["generate_matches_cacheless"]
                and ref["tf_consistent_with_greedy"] and gap >= ROUTE_MIN_GAP):
            d["min_routing_gap"] = gap
            chosen = (rel, text, ref)
            break
    assert chosen is not None, "no usable held-out prompt"
    rel, text, ref = chosen
    # the CLI reference: greedy continuation of CLI_PROMPT (cache-less argmax loop)
    cli_ids = tok.encode(CLI_PROMPT).ids
    ids, margins = list(cli_ids), []
    with torch.no_grad():
        for _ in range(CLI_TOKENS):
            lg = mo.tf_forward(lm, ids)[-1]
            margins.append(mo.top2_gap(lg))
            nxt = int(torch.argmax(lg))
            if nxt == eos:
                break
            ids.append(nxt)
    cont = ids[len(cli_ids):]
    manifest = json.load(open(os.path.join(args.model, "colibri_convert.json")))
    rec = {
        "transformers_version": __import__("transformers").__version__,
        "torch_version": torch.__version__,
        "model": "colibri/models/default (the embedded default model)",
        "weights": "the container's quantized payloads dequantized (v * row scale) to f32; every other tensor "
                   "as stored; run by transformers GlmMoeDsaForCausalLM, eager attention, f32",
        "container_bits": manifest["bits"],
        "attn_implementation": "eager",
        "prompt_source": f"first top-level def line of held-out file {rel}",
        "prompt_text": text,
        "n_new": REF_NEW,
        "generate_matches_cacheless": ref["generate_matches_cacheless"],
        "tf_consistent_with_greedy": ref["tf_consistent_with_greedy"],
        "diagnostics": ref["diagnostics"],
        "logits_format": "float32, shortest round-trip decimal; logits[i] = teacher-forced logits at position i "
                         "of full_ids (no cache); tf_pred[i] = argmax(logits[i])",
        "cli": {"prompt": CLI_PROMPT, "max_tokens": CLI_TOKENS, "prompt_ids": cli_ids, "ids": cont,
                "text": tok.decode(cont), "how": "transformers, cache-less greedy argmax loop, same weights",
                "min_argmax_margin": min(margins)},
        "prompt_ids": ref["prompt_ids"],
        "full_ids": ref["full_ids"],
        "tf_pred": ref["tf_pred"],
        "greedy_logits_last": ref["greedy_logits_last"],
        "logits": ref["logits"],
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    mo.write_ref(args.out, rec)
    log(f"wrote {args.out}: prompt {text!r} ({len(ref['prompt_ids'])} tokens) + {REF_NEW}; CLI reference "
        f"{CLI_PROMPT!r} -> {tok.decode(cont)!r}")
    # the engine against it, as the test suite checks
    import colibri
    from colibri.parity import check, load_ref
    res = check(colibri.model_init(args.model), load_ref(args.out))
    log(f"engine vs reference: teacher forcing {res['tf_match']}/{res['tf_total']}, greedy "
        f"{res['greedy_match']}/{res['greedy_total']}, max |dlogit| {res['max_abs_logit_diff']:.3g}")
    log(f"CLI reference: min argmax margin {min(margins):.3g}")
    for isa in ("", "avx2", "scalar"):
        env = {"COLIBRI_ISA": isa} if isa else {}
        p = colibri_cli("run", CLI_PROMPT, "--model", args.model, "--max-tokens", CLI_TOKENS, "--temperature", 0,
                        "--quiet", env=env)
        log(f"engine CLI ({isa or 'native'} kernels): {p.stdout!r} "
            f"({'equal' if p.stdout == rec['cli']['text'] + chr(10) else 'DIFFERENT'})")
    return 0


# ----------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------

def _detail(lm, head, W, batch=8):
    """Per-position main/MTP CE and argmax over windows W [N, T+1] (f32, the checked fast path)."""
    torch = _torch()
    F = torch.nn.functional
    ce_m, ce_t, am_m, am_t = [], [], [], []
    with torch.no_grad():
        for i in range(0, len(W), batch):
            x = torch.from_numpy(W[i:i + batch])
            lg, ml = fast_logits(lm, head, x)
            V = lg.shape[-1]
            ce_m.append(F.cross_entropy(lg.reshape(-1, V), x[:, 1:].reshape(-1), reduction="none").numpy())
            ce_t.append(F.cross_entropy(ml.reshape(-1, V), x[:, 2:].reshape(-1), reduction="none").numpy())
            am_m.append(lg.argmax(-1).reshape(-1).numpy())
            am_t.append(ml.argmax(-1).reshape(-1).numpy())
    return [np.concatenate(a) for a in (ce_m, ce_t, am_m, am_t)]


def eval_quant(args, res):
    """Held-out loss and top-1 agreement with f32 of int8 and int4 containers (torch, dequantized)."""
    torch = _torch()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    _, held = load_corpus()
    tok = load_tokenizer(args.src)
    W = windows(token_stream(tok, held), TRAIN["seq_len"], args.windows)
    lm, head = load_checkpoint(args.src)
    d = check_fast_path(lm, head, torch.from_numpy(W[:2]))
    base = _detail(lm, head, W)
    out = {"windows": int(len(W)), "positions_main": int(base[0].size), "fast_path_check": d,
           "f32": {"loss": float(base[0].mean()), "mtp_loss": float(base[1].mean()),
                   "bytes": os.path.getsize(os.path.join(args.src, "model.safetensors"))}}
    log(f"f32: held-out loss {out['f32']['loss']:.4f}, MTP {out['f32']['mtp_loss']:.4f}")
    for name, bits in (("int8", 8), ("int4", 4)):
        dst = f"/tmp/colibri_tiny_q{bits}"
        size = convert_container(args.src, dst, bits)
        lm_q, head_q = models_from_state(args.src, dequantized_state(dst, args.src))
        q = _detail(lm_q, head_q, W)
        out[name] = {"container": dst, "bytes": size, "loss": float(q[0].mean()), "mtp_loss": float(q[1].mean()),
                     "top1_agree_f32": float((q[2] == base[2]).mean()),
                     "mtp_top1_agree_f32": float((q[3] == base[3]).mean())}
        log(f"{name}: {size / 1e6:.2f} MB, held-out loss {out[name]['loss']:.4f}, MTP {out[name]['mtp_loss']:.4f}, "
            f"top-1 agreement with f32 {100 * out[name]['top1_agree_f32']:.2f}% (MTP "
            f"{100 * out[name]['mtp_top1_agree_f32']:.2f}%)")
    res["quant"] = out


def eval_engine_loss(args, res):
    """The shipped container run by the engine: held-out loss on the first windows (a subset)."""
    import colibri
    _, held = load_corpus()
    tok = load_tokenizer(args.model)
    W = windows(token_stream(tok, held), TRAIN["seq_len"], args.engine_windows)
    m = colibri.model_init(args.model)
    tot, n, t0 = 0.0, 0, time.time()
    for w in W:
        _, lg = m.forward_all(w[:-1].tolist())
        lg = lg.astype(np.float64)
        mx = lg.max(-1, keepdims=True)
        lse = (mx[:, 0] + np.log(np.exp(lg - mx).sum(-1)))
        tot += float((lse - lg[np.arange(len(w) - 1), w[1:]]).sum())
        n += len(w) - 1
    res["engine_loss"] = {"model": args.model, "windows": int(len(W)), "loss": tot / n,
                          "seconds": round(time.time() - t0, 1)}
    log(f"engine, {args.model}: held-out loss {tot / n:.4f} on the first {len(W)} windows "
        f"({n / (time.time() - t0):.0f} tok/s prefill)")


def run_stats(model, prompt, draft, n=64, temperature=0, seed=None, threads=0):
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    a = ["run", prompt, "--model", model, "--max-tokens", n, "--temperature", temperature, "--draft", draft,
         "--stats-json", path, "--quiet"]
    if seed is not None:
        a += ["--seed", seed]
    if threads:
        a += ["--threads", threads]
    p = colibri_cli(*a)
    with open(path) as f:
        st = json.load(f)
    os.remove(path)
    st["text"] = p.stdout[:-1] if p.stdout.endswith("\n") else p.stdout
    return st


def distinct_ngrams(ids, n=4) -> float:
    """Distinct n-grams over all n-grams of a token sequence (1.0: no n-gram repeats; loops -> 0)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


SAMPLED_T = 0.7


def draft_summary(stats, base, depth, greedy):
    """One --draft DEPTH row from the per-prompt run stats: acceptance, acceptance by draft
    position (pooled over prompts), tokens per forward, decode tok/s, and (greedy) whether every
    output equals --draft 0's (base)."""
    prop = sum(s["drafts_proposed"] for s in stats)
    acc = sum(s["drafts_accepted"] for s in stats)
    toks = sum(s["decode_tokens"] for s in stats)
    ver, hit = np.zeros(depth), np.zeros(depth)
    for s in stats:
        v = np.asarray(s.get("drafts_verified_by_position", []), dtype=float)
        ver[:len(v)] += v
        hit[:len(v)] += np.asarray(s.get("acceptance_by_position", []), dtype=float) * v
    return {"proposed": prop, "accepted": acc, "acceptance": acc / max(prop, 1),
            "tokens_per_forward": toks / max(sum(s["decode_forwards"] for s in stats), 1),
            "acceptance_by_position": [round(float(h / v), 3) if v else None for h, v in zip(hit, ver)],
            "lossless": all(s["tokens"] == b["tokens"] for s, b in zip(stats, base)) if greedy else None,
            "decode_tok_s": toks / sum(s["decode_s"] for s in stats)}


def eval_mtp(args, res):
    """On the held-out prompts, --tokens each, the shipped container: greedy --draft 0 (its distinct
    4-gram ratio per prompt: does greedy decoding loop?), then --draft 1..4 greedy (acceptance,
    tokens per forward, acceptance by draft position, output = --draft 0's) and sampled at
    SAMPLED_T with a fixed seed per prompt (acceptance of the exact rejection-sampling test)."""
    prompts = heldout_prompts(args.prompts)
    seeds = [1000 + i for i in range(len(prompts))]
    out = {"prompts": [p for _, p in prompts], "files": [f for f, _ in prompts], "n": args.tokens,
           "temperature_sampled": SAMPLED_T, "modes": {}}

    def runs(depth, temp):
        return [run_stats(args.model, p, depth, args.tokens, temperature=temp, seed=sd)
                for (_, p), sd in zip(prompts, seeds)]

    for mode, temp in (("greedy", 0), ("sampled", SAMPLED_T)):
        base = runs(0, temp)
        if mode == "greedy":
            out["distinct4"] = [{"prompt": p, "tokens": len(st["tokens"]), "distinct4": round(distinct_ngrams(st["tokens"]), 3),
                                 "text": st["text"]} for (_, p), st in zip(prompts, base)]
            d4 = [r["distinct4"] for r in out["distinct4"]]
            log(f"greedy, {len(prompts)} prompts x {args.tokens} tokens: distinct 4-grams min {min(d4):.3f}, "
                f"mean {np.mean(d4):.3f}: {d4}")
        rows = {}
        for depth in (1, 2, 3, 4):
            r = rows[depth] = draft_summary(runs(depth, temp), base, depth, greedy=mode == "greedy")
            log(f"{mode}, --draft {depth}: acceptance {100 * r['acceptance']:.1f}% ({r['accepted']}/{r['proposed']}), "
                f"by position {r['acceptance_by_position']}, {r['tokens_per_forward']:.2f} tokens/forward"
                + (f", same output as --draft 0: {r['lossless']}" if r["lossless"] is not None else ""))
        out["modes"][mode] = {"depths": rows, "draft0_decode_tok_s": sum(s["decode_tokens"] for s in base)
                              / sum(s["decode_s"] for s in base)}
    res["mtp"] = out


def eval_speed(args, res):
    """Decode tok/s, --draft auto vs --draft 0, interleaved per prompt (one run, same conditions)."""
    prompts = heldout_prompts(args.prompts)
    rows = []
    for rep in range(args.repeats):
        for _, p in prompts:
            s0 = run_stats(args.model, p, 0, args.tokens)
            sa = run_stats(args.model, p, "auto", args.tokens)
            rows.append({"prompt": p, "tok_s_draft0": s0["decode_tok_s"], "tok_s_auto": sa["decode_tok_s"],
                         "auto_tokens_per_forward": sa["tokens_per_forward"],
                         "auto_acceptance": sa["acceptance"], "same_output": s0["tokens"] == sa["tokens"],
                         "t0": (s0["decode_tokens"], s0["decode_s"]), "ta": (sa["decode_tokens"], sa["decode_s"])})
    agg0 = sum(r["t0"][0] for r in rows) / sum(r["t0"][1] for r in rows)
    agga = sum(r["ta"][0] for r in rows) / sum(r["ta"][1] for r in rows)
    res["speed"] = {"runs": rows, "decode_tok_s_draft0": agg0, "decode_tok_s_auto": agga,
                    "median_ratio": float(np.median([r["tok_s_auto"] / r["tok_s_draft0"] for r in rows])),
                    "all_same_output": all(r["same_output"] for r in rows), "nproc": os.cpu_count()}
    log(f"decode: --draft 0 {agg0:.1f} tok/s, --draft auto {agga:.1f} tok/s "
        f"(median per-prompt ratio {res['speed']['median_ratio']:.2f}); outputs identical: "
        f"{res['speed']['all_same_output']}")


def eval_parity(args, res):
    """The shipped container against transformers on its dequantized weights (tests/data/default_ref.json):
    the engine's float path (--idot 0: f32 dots on the dequantized rows, so an f32 parity check of
    the shipped weights) with the absorbed attention path forced, disabled and automatic, and the
    default integer numerics."""
    import colibri
    from colibri.parity import check, load_ref
    ref = load_ref(args.ref)
    out = {}
    for name, kw in (("f32 (--idot 0)", dict(idot=0)), ("f32, absorbed always", dict(idot=0, absorb=1)),
                     ("f32, absorbed never", dict(idot=0, absorb=0)), ("default (--idot 2)", {})):
        r = check(colibri.model_init(args.model, **kw), ref)
        out[name] = {k: r[k] for k in ("tf_match", "tf_total", "greedy_match", "greedy_total", "max_abs_logit_diff")}
        log(f"parity {name}: teacher forcing {r['tf_match']}/{r['tf_total']}, greedy {r['greedy_match']}/"
            f"{r['greedy_total']}, max |dlogit| {r['max_abs_logit_diff']:.3g}")
    res["parity"] = out


SAMPLE_TOKENS = 64
SAMPLE_PROMPTS = ["def fibonacci(n):", "class Stack:", "def read_config(path):", "import os\nimport sys\n\n\ndef main("]


def eval_samples(args, res):
    out = []
    for p in SAMPLE_PROMPTS:
        g = run_stats(args.model, p, 0, SAMPLE_TOKENS)["text"]
        t = run_stats(args.model, p, 0, SAMPLE_TOKENS, temperature=0.7, seed=1)["text"]
        out.append({"prompt": p, "greedy": g, "t0.7_seed1": t})
        log(f"--- {p!r}\n[greedy]\n{p}{g}\n[temperature 0.7, seed 1]\n{p}{t}")
    res["samples"] = out


def cmd_eval(args):
    res = {}
    if os.path.exists(args.results):
        with open(args.results) as f:
            res = json.load(f)
    parts = args.parts.split(",")
    for name, fn in (("quant", eval_quant), ("engine", eval_engine_loss), ("parity", eval_parity), ("mtp", eval_mtp),
                     ("speed", eval_speed), ("samples", eval_samples)):
        if name in parts or "all" in parts:
            t0 = time.time()
            fn(args, res)
            log(f"[{name}: {time.time() - t0:.0f}s]")
            with open(args.results, "w") as f:
                json.dump(res, f, indent=1)
    return 0


def cmd_convert(args):
    size = convert_container(args.src, args.dst, args.bits, args.mtp_bits)
    log(f"{args.dst}: {size / 1e6:.2f} MB of safetensors (experts/dense int{args.bits}, io int8, "
        f"MTP int{args.mtp_bits})")
    return 0


# ----------------------------------------------------------------------------------------------
# Model card
# ----------------------------------------------------------------------------------------------

def _md_table(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _fence(text):
    return "```python\n" + text.rstrip("\n") + "\n```"


def render_tune(meta, tr) -> list:
    """The model card's fine-tuning section, one part per round (none when the model was not tuned)."""
    rounds = tune_rounds(meta)
    if not rounds:
        return []
    L = ["\n## Fine-tuning against greedy loops\n"]
    pu = rounds[0]["params"]
    L.append(f"`tools/train_tiny.py tune` fine-tunes an int4 container, dequantized to f32. Its unlikelihood steps "
             f"are sequence-level unlikelihood (Welleck et al., 2019): {pu['ul_batch']} prefixes from the training "
             f"files (top-level `def`/`class` lines, or with probability {pu['ul_window_share']} a random corpus "
             f"window) are continued greedily by the current weights for {pu['ul_new']} tokens, and every "
             f"continuation token inside a {pu['ul_ngram']}-gram that occurred earlier in its sequence adds "
             "−log(1 − p(token)) to the loss; the MTP head follows the main model on those sequences (its KL "
             f"term). The other steps are the training objective above on corpus windows of {tr['batch']} × "
             f"{tr['seq_len']}. `rep` is the share of continuation tokens inside a repeated 4-gram (training "
             f"prefixes, the tuned weights of that moment); held-out loss on the first {tr['eval_windows']} "
             "held-out windows.")
    qat_first = None                    # the first quantization-aware round (described once)
    for rn in rounds:
        pu = rn["params"]
        L.append(f"\n### Round {rn.get('round', 1)}\n")
        qat = pu.get("qat", False)
        ditto = pu.get("anti_loop") == "ditto"
        L.append(f"From the int4 container of {'the training above' if rn.get('round', 1) == 1 else 'the round before'}: "
                 f"{rn['steps']} steps ({rn['seconds'] / 60:.1f} min, AdamW lr {pu['lr']} cosine to "
                 f"{pu['min_lr_frac']}×, seed {rn['seed']}), a share of {pu['ul_share']} of them "
                 f"{'DITTO' if ditto else 'unlikelihood'} steps (weight {pu.get('ul_alpha', 1.0)})" +
                 (f", anchored by KL(round's start ‖ model) on the continuation tokens they leave alone (weight "
                  f"{pu['ul_kl']})" if pu.get("ul_kl") else "") + ".")
        if ditto:
            lo, hi = pu["ditto_span"]
            L.append(f"\nDITTO steps (Xu et al., 2022, \"Learning to break the loop\") replace the unlikelihood "
                     f"steps: {pu['ul_batch']} corpus windows, each a prefix of 16–64 tokens followed by the next "
                     f"{lo}–{hi} tokens repeated to {pu['ditto_len']} tokens; at every token of the second and later "
                     "copies, with p_n its probability there and p_(n−1) (held fixed) at the same token one copy "
                     f"earlier, the loss is −log(1 − max(p_n − {pu['ditto_lambda']}·p_(n−1), 0)): a repeat grows "
                     "less likely with each copy instead of more (the self-reinforcement that makes greedy "
                     "decoding loop), and no generated text is rewarded. (Unlikelihood on the quantized model's "
                     "own continuations, tried first for this round, broke its loops by emitting rare-token "
                     "soup.) `DITTO` is that loss, `p(repeat)` the mean p_n.")
        if qat and qat_first is not None:
            L.append(f"\nQuantization-aware, as round {qat_first}.")
        elif qat:
            qat_first = rn.get("round", 1)
            L.append("\nQuantization-aware (straight-through): every forward, greedy continuation and gradient of "
                     "this round ran on the int4/int8 image of the weights, exactly as the converter quantizes "
                     "them (per-row symmetric, round to nearest even), and the optimizer stepped the f32 masters; so "
                     "the container holds the very model the round tuned. (Round 1 tuned f32 weights, and int4 "
                     "requantization keeps only ~84% of f32's top-1 tokens: its greedy paths were not the ones tuned.)")
        if pu.get("keep_best"):
            L.append(f"\nEvery {pu['eval_every']} steps, {pu['val_prompts']} top-level `def`/`class` lines of the "
                     f"held-out *package* files (not the prompts below) were continued greedily for {pu['ul_new']} "
                     "tokens (`val distinct`: their mean distinct 4-gram ratio; `val NLL under the start`: those "
                     "continuations' mean NLL under the round's starting model, which loops make low and rare-token "
                     "soup high; `val loop-free`: the share of them with at least " + f"{DISTINCT_OK}" + "); the round "
                     "keeps the evaluation with " + ("the most loop-free continuations (then the highest val distinct)"
                     if pu.get("keep_best_by_loop_free") else "the highest val distinct") + ", among those within "
                     f"{pu['keep_best_slack']} of the start's held-out package loss" +
                     (f", within {pu['keep_best_heldout_slack']} of its held-out stdlib subset loss (the start "
                      "itself a candidate)" if pu.get("keep_best_heldout_slack") is not None else "") +
                     f" and with a val NLL of at most "
                     f"{pu.get('keep_best_max_ref_nll', '–')}: step {rn.get('kept_step', rn['steps'])}.")
        held = (f"all {rn['heldout_windows']} windows, {'the quantized image' if qat else 'f32'}")
        loss = rn.get("heldout_loss_quantized", rn["heldout_loss"]) if qat else rn["heldout_loss"]
        L.append(f"\n- Held-out stdlib loss after the round ({held}): main "
                 f"**{loss:.4f} (perplexity {math.exp(loss):.1f})**" +
                 (f", MTP (t+2) {rn['heldout_mtp_loss']:.4f}.\n" if not qat else
                  f"; the f32 masters {rn['heldout_loss']:.4f}.\n"))
        cols = [("step", "step"), ("corpus CE", "ce"), ("DITTO" if ditto else "unlikelihood", "ul"),
                ("p(repeat)" if ditto else "rep", "rep"), ("held-out (subset)", "heldout_subset_loss")]
        if any("val_distinct" in c for c in rn["curve"]):
            cols += [("package held-out (subset)", "pkg_subset_loss"), ("val distinct", "val_distinct"),
                     ("val distinct min", "val_distinct_min")]
            if any("val_loop_free" in c for c in rn["curve"]):
                cols.append(("val loop-free", "val_loop_free"))
            cols.append(("val NLL under the start", "val_ref_nll"))
        rows = [[c.get(k, "–") for _, k in cols] + [f"{c.get('elapsed_s', 0) / 60:.1f}"] for c in rn["curve"]
                if "heldout_subset_loss" in c or c is rn["curve"][-1]]
        L.append(_md_table([h for h, _ in cols] + ["minutes"], rows))
    return L


def rebuild_commands(meta) -> str:
    """The model card's rebuild recipe: training, conversion, each tuning round, reference, eval, card."""
    L = ["pip install torch==2.13.0 transformers",
         "nice -n 5 python tools/train_tiny.py train --out /tmp/colibri_tiny_f32   # --resume continues a stopped run",
         "python tools/train_tiny.py convert --src /tmp/colibri_tiny_f32 --bits 4"]
    src = "/tmp/colibri_tiny_f32"
    for rn in tune_rounds(meta):
        n = rn.get("round", 1)
        prev, src = src, f"/tmp/colibri_tiny_tuned{n}"
        L.append(f"nice -n 5 python tools/train_tiny.py tune --round {n} --out {src} "
                 f"--base-meta {prev}/train_meta.json   # --resume too")
        L.append(f"python tools/train_tiny.py convert --src {src} --bits 4")
    L += [f"python tools/train_tiny.py ref --src {src}",
          f"python tools/train_tiny.py eval --src {src} --results /tmp/eval.json",
          f"python tools/train_tiny.py card --src {src} --results /tmp/eval.json",
          "# or all of it: python tools/train_tiny.py all --out /tmp/colibri_tiny_f32"]
    return "```sh\n" + "\n".join(L) + "\n```\n"


def render_card(meta, res, cfg, manifest, model_bytes) -> str:
    """MODEL_CARD.md from train_meta.json, the eval results and the container's config/manifest."""
    L = []
    ppl = lambda x: f"{x:.4f} (perplexity {math.exp(x):.1f})"
    L.append("# colibri default model\n")
    L.append("A small but real `glm_moe_dsa` (GLM-5 architecture) mixture-of-experts language model with a "
             "native MTP head, trained from scratch on Python code (the standard library and permissively "
             "licensed packages from PyPI) by `tools/train_tiny.py`. `python -m colibri run` uses it when no "
             "`--model` is given. It completes Python code; it knows nothing else. It exists so that the engine "
             "can be tried from one command and so that MTP speculative decoding can be measured on a head "
             "that was actually trained.\n")
    L.append("## Architecture\n")
    L.append(_md_table(["", ""], [
        ["layers", f"{cfg['num_hidden_layers']} ({cfg['first_k_dense_replace']} dense, "
                   f"{cfg['num_hidden_layers'] - cfg['first_k_dense_replace']} MoE) + 1 MTP layer (MoE)"],
        ["hidden / dense intermediate / expert intermediate",
         f"{cfg['hidden_size']} / {cfg['intermediate_size']} / {cfg['moe_intermediate_size']}"],
        ["attention", f"MLA, {cfg['num_attention_heads']} heads, q_lora {cfg['q_lora_rank']}, kv_lora "
                      f"{cfg['kv_lora_rank']}, nope {cfg['qk_nope_head_dim']} + rope {cfg['qk_rope_head_dim']}, "
                      f"v {cfg['v_head_dim']}; DSA indexer in every layer ({cfg['index_n_heads']} heads of "
                      f"{cfg['index_head_dim']}, top-{cfg['index_topk']} = the whole context)"],
        ["experts", f"{cfg['n_routed_experts']} routed (sigmoid router + correction bias, top-"
                    f"{cfg['num_experts_per_tok']}, routed scaling {cfg['routed_scaling_factor']}) + "
                    f"{cfg['n_shared_experts']} shared"],
        ["vocabulary / context", f"{cfg['vocab_size']} (byte-level BPE) / {cfg['max_position_embeddings']}"],
        ["parameters", f"{meta['params_main'] / 1e6:.2f} M main + {meta['params_mtp'] / 1e6:.2f} M MTP head"],
        ["container", f"experts and dense int{manifest['bits']['expert']}, embeddings and lm_head int"
                      f"{manifest['bits']['io']}, indexer int{manifest['bits']['indexer']}, MTP head int"
                      f"{manifest['bits']['mtp']}; {model_bytes / 1e6:.1f} MB"],
    ]))
    L.append("\nThe indexer is part of the architecture but is not trained (transformers runs it under "
             "`no_grad`); the context equals `index_topk`, so its selection never drops a key.\n")
    tr = meta["train"]
    L.append("## Training\n")
    cm = meta["corpus"]
    f, tk = cm["files"], cm["tokens"]
    L.append(f"- Corpus: the `.py` files of the Python {meta['python']} standard library (tests, idlelib and "
             f"site-packages left out) and of the {len(cm['packages'])} PyPI distributions listed below (their "
             f"wheels' `.py` files, test folders and files over {cm['max_file_bytes'] >> 20} MB left out), split "
             f"by file with `{cm['heldout_rule']}`. Training: {f['std_train']} stdlib files "
             f"({tk['std_train'] / 1e6:.2f} M tokens) and {f['pkg_train']} package files "
             f"({tk['pkg_train'] / 1e6:.2f} M tokens), **{meta['train_tokens'] / 1e6:.1f} M tokens**; "
             f"{cm['dropped_duplicates']} training files dropped as exact copies or near copies of a held-out "
             f"file (vendored or backported modules). Held out: {f['std_held']} stdlib files "
             f"({tk['std_held'] / 1e3:.0f} k tokens, the benchmark below: the same files as the first "
             f"edition's) and {f['pkg_held']} package files ({tk['pkg_held'] / 1e6:.2f} M tokens).")
    L.append(f"- Mixture: each training window comes from the stdlib with probability {tr['stdlib_share']}, "
             "otherwise from the packages.")
    L.append(f"- Tokenizer: byte-level BPE, {cfg['vocab_size']} tokens, trained with `tokenizers` on the training "
             "files; `<|endoftext|>` separates files.")
    L.append(f"- Objective: next token + {tr['mtp_lambda']} × next-next token through the MTP layer (DeepSeek-V3 / "
             f"GLM-5 convention), aux-loss-free expert balancing (bias step {tr['bias_update']}) plus a "
             f"{tr['balance_alpha']} balance loss" + (
                 f"; plus {tr['mtp_distill']} × KL(main model's distribution of t+2 at position t+1 ‖ the MTP "
                 "head's), which teaches the head the distribution its drafts are accepted against"
                 if tr.get("mtp_distill") else "") + ".")
    L.append(f"- {meta['steps']} steps of {tr['batch']} × {tr['seq_len']} tokens ({meta['tokens_seen'] / 1e6:.2f} M "
             f"tokens), AdamW lr {tr['lr']} cosine to {tr['min_lr_frac']}×, seed {meta['seed']}, f32, torch "
             f"{meta['torch']}, transformers {meta['transformers']}, {meta['threads']} CPU threads: "
             f"**{meta['train_seconds'] / 60:.1f} min** of training.")
    L.append(f"- Held-out stdlib loss (all {meta['heldout_windows']} windows of {tr['seq_len']}, f32): main "
             f"**{ppl(meta['heldout_loss'])}**, MTP (t+2) {ppl(meta['heldout_mtp_loss'])}.\n")
    pts = [c for c in meta["curve"] if c["step"] % 100 == 0 or c is meta["curve"][-1]]
    L.append(_md_table(["step", "train loss", "MTP loss", "minutes"],
                       [[c["step"], c["loss"], c["mtp_loss"], f"{c['elapsed_s'] / 60:.1f}"] for c in pts]))
    L.extend(render_tune(meta, tr))
    L.append("\nThe packages (name, version, license as their metadata states it):\n")
    L.append(_md_table(["package", "version", "license"],
                       [[x["name"], x["version"], x["license"]] for x in cm["packages"]]))
    q = res.get("quant")
    if q:
        L.append("\n## Quantization\n")
        L.append(f"Held-out loss over {q['windows']} windows ({q['positions_main']} positions), transformers on the "
                 "containers' dequantized weights:\n")
        rows = [["f32 checkpoint", f"{q['f32']['bytes'] / 1e6:.1f}", f"{q['f32']['loss']:.4f}",
                 f"{q['f32']['mtp_loss']:.4f}", "–", "–"]]
        for n in ("int8", "int4"):
            r = q[n]
            rows.append([f"{n} experts and dense", f"{r['bytes'] / 1e6:.1f}", f"{r['loss']:.4f}", f"{r['mtp_loss']:.4f}",
                         f"{100 * r['top1_agree_f32']:.2f}%", f"{100 * r['mtp_top1_agree_f32']:.2f}%"])
        L.append(_md_table(["weights", "MB", "loss", "MTP loss", "top-1 = f32", "MTP top-1 = f32"], rows))
        d4 = q["int4"]["loss"] - q["int8"]["loss"]
        smaller = f"{100 * (1 - q['int4']['bytes'] / q['int8']['bytes']):.0f}% less on disk"
        if tune_rounds(meta) and tune_rounds(meta)[-1].get("params", {}).get("qat"):
            L.append(f"\nShipped: int{manifest['bits']['expert']} ({smaller} than int8); the MTP head stays int8. "
                     "The last tuning round was quantization-aware: it tuned the int4 image, so its f32 masters "
                     "(the first row) are not a model of their own and the int8 row requantizes those masters; the "
                     "int4 container is the model the round made, and the only row to compare.")
        else:
            L.append(f"\nShipped: int{manifest['bits']['expert']}. int4 costs {d4:+.4f} nats of held-out loss against "
                     f"int8 ({100 * d4 / q['int8']['loss']:+.2f}%) for {smaller}; the MTP head stays int8 in both."
                     + (" (The tuning started from the int4 container's dequantized weights; requantized, they score "
                        "below the f32 tuned weights on the held-out files.)" if meta.get("tune") and d4 < 0 else ""))
    par = res.get("parity")
    if par:
        L.append("\n## Parity with transformers\n")
        L.append("`tests/data/default_ref.json`: transformers `GlmMoeDsaForCausalLM` (eager, f32) on the shipped "
                 "container's dequantized weights, a held-out prompt plus 64 greedy tokens (the test suite checks "
                 "the engine against it):\n")
        L.append(_md_table(["engine numerics", "teacher forcing", "greedy", "max abs logit diff"],
                           [[n, f"{r['tf_match']}/{r['tf_total']}", f"{r['greedy_match']}/{r['greedy_total']}",
                             f"{r['max_abs_logit_diff']:.2g}"] for n, r in par.items()]))
    m = res.get("mtp")
    if m:
        L.append("\n## Greedy decoding without loops\n")
        L.append(f"Greedy, {len(m['prompts'])} held-out prompts (the first top-level `def` line of held-out stdlib "
                 f"files), {m['n']} tokens each: distinct 4-grams over all 4-grams of the generated tokens "
                 "(1.0: no 4-gram repeats; a loop drives it towards 0).\n")
        L.append(_md_table(["prompt", "tokens", "distinct 4-grams"],
                           [[f"`{r['prompt']}`", r["tokens"], f"{r['distinct4']:.3f}"] for r in m["distinct4"]]))
        d4 = [r["distinct4"] for r in m["distinct4"]]
        L.append(f"\nMinimum {min(d4):.3f}, mean {np.mean(d4):.3f}.")
        L.append("\n## MTP speculative decoding\n")
        L.append(f"The same prompts, {m['n']} tokens each, the shipped container (int8 MTP head): greedy, and "
                 f"sampled at temperature {m['temperature_sampled']} with a fixed seed per prompt (the head's drafts raced from its own "
                 "distribution with the position's key, accepted when the model's race at that position draws them). Acceptance by position: of the iterations that "
                 "verified an i-th draft, the share that accepted it.\n")
        rows = []
        for mode in ("greedy", "sampled"):
            for d, r in sorted(m["modes"][mode]["depths"].items(), key=lambda kv: int(kv[0])):
                pos = " / ".join("–" if a is None else f"{100 * a:.0f}%" for a in r["acceptance_by_position"])
                same = "–" if r["lossless"] is None else ("yes" if r["lossless"] else "**NO**")
                rows.append([mode, d, f"{100 * r['acceptance']:.1f}% ({r['accepted']}/{r['proposed']})", pos,
                             f"{r['tokens_per_forward']:.2f}", same])
        L.append(_md_table(["decoding", "--draft", "acceptance", "by position", "tokens / forward",
                            "= --draft 0"], rows))
    sp = res.get("speed")
    if sp:
        L.append("\n## Decode speed, `--draft auto` vs `--draft 0`\n")
        L.append(f"Held-out prompts, greedy, one fresh process per run, the two settings interleaved per prompt "
                 f"({sp['nproc']} CPUs): `--draft 0` **{sp['decode_tok_s_draft0']:.0f} tok/s**, `--draft auto` "
                 f"**{sp['decode_tok_s_auto']:.0f} tok/s** (median per-prompt ratio {sp['median_ratio']:.2f}); "
                 f"outputs identical: {'yes' if sp['all_same_output'] else 'NO'}.")
        L.append(f"\nThis model is {model_bytes / 1e6:.0f} MB with every expert in RAM, so a token costs a few "
                 "milliseconds of multiply-adds and no disk reads: a verify of 1 + d rows routes to more experts "
                 "and the head's own pass costs about a layer, which the accepted drafts must pay for. The auto "
                 f"policy measures that; per-prompt ratios spread from "
                 f"{min(r['tok_s_auto'] / r['tok_s_draft0'] for r in sp['runs']):.2f} to "
                 f"{max(r['tok_s_auto'] / r['tok_s_draft0'] for r in sp['runs']):.2f}. Speculation pays most "
                 "where a token costs disk reads (GLM-5.2 streaming its experts).")
    sm = res.get("samples")
    if sm:
        L.append("\n## Samples\n")
        L.append("Greedy and at temperature 0.7 (seed 1), 64 tokens, `python -m colibri run PROMPT --temperature T "
                 "--seed 1`:\n")
        for x in sm:
            L.append(f"**{x['prompt']!r}**, greedy:\n\n{_fence(x['prompt'] + x['greedy'])}\n")
            L.append(f"temperature 0.7:\n\n{_fence(x['prompt'] + x['t0.7_seed1'])}\n")
    L.append("## Rebuild\n")
    L.append(rebuild_commands(meta))
    L.append("`train` downloads the pinned wheels (no dependencies) with pip into `--wheels` and keeps the "
             "tokenizer and token streams in `OUT.data/` and the training state in `OUT.state.pt` (every "
             f"{tr['save_every']} steps), so an interrupted run continues where it stopped. The weights depend "
             "on the interpreter's standard library, the pinned wheels and torch's CPU kernels; the same versions "
             "on the same kind of machine give the same model.\n")
    return "\n".join(L)


def cmd_card(args):
    with open(os.path.join(args.src, "train_meta.json")) as f:
        meta = json.load(f)
    with open(args.results) as f:
        res = json.load(f)
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(args.model, "colibri_convert.json")) as f:
        manifest = json.load(f)
    text = render_card(meta, res, cfg, manifest, container_bytes(args.model))
    path = os.path.join(args.model, "MODEL_CARD.md")
    with open(path, "w") as f:
        f.write(text)
    # The package keeps its training metadata beside the card: a later `tune` starts from it.
    write_json(os.path.join(args.model, "train_meta.json"), meta)
    log(f"wrote {path} and train_meta.json")
    return 0


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------

def cmd_all(args):
    """train (or --resume), convert, each tuning round (or --resume) and its convert, ref, eval, card:
    the whole rebuild.

    Each round of TUNE_ROUNDS fine-tunes the int4 container the step before converted (so it starts
    from the weights users get) into OUT.tuned<N>; the package, its reference and its card are then
    made from the last round's checkpoint.
    """
    res = args.out.rstrip("/") + ".eval.json"
    resume = ["--resume"] if args.resume else []
    train = ["train", "--out", args.out, "--wheels", args.wheels] + resume
    if args.steps is not None:
        train += ["--steps", str(args.steps)]
    steps, src = [train, ["convert", "--src", args.out]], args.out
    for n in range(1, len(TUNE_ROUNDS) + 1):
        prev, src = src, args.out.rstrip("/") + f".tuned{n}"
        steps += [["tune", "--round", str(n), "--out", src, "--wheels", args.wheels,
                   "--base-meta", os.path.join(prev, "train_meta.json")] + resume,
                  ["convert", "--src", src]]
    steps += [["ref", "--src", src],
              ["eval", "--src", src, "--results", res],
              ["card", "--src", src, "--results", res]]
    for argv in steps:
        t0 = time.time()
        log(f"=== train_tiny.py {' '.join(argv)}")
        rc = main(argv)
        log(f"=== {argv[0]}: {(time.time() - t0) / 60:.1f} min")
        if rc:
            return rc
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="corpus, tokenizer, training, f32 checkpoint")
    t.add_argument("--out", default=DEFAULT_OUT)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--wheels", default=DEFAULT_WHEELS, help="where the corpus's pinned wheels are (downloaded if missing)")
    t.add_argument("--attn", default="eager", choices=("eager", "sdpa"))
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False,
                   help="bf16 autocast for the training matmuls (weights and optimizer stay f32)")
    t.add_argument("--resume", action="store_true",
                   help="continue from OUT.state.pt (saved every save_every steps), bit-exact")
    t.add_argument("--bench", type=int, default=None, metavar="STEPS", help="time STEPS steps, save nothing")
    for k, typ in (("steps", int), ("batch", int), ("seq_len", int), ("lr", float), ("max_minutes", float),
                   ("stdlib_share", float), ("mtp_distill", float)):
        t.add_argument("--" + k.replace("_", "-"), dest=k, type=typ, default=None)
    c = sub.add_parser("convert", help="convert the f32 checkpoint into the package (or --dst)")
    c.add_argument("--src", default=DEFAULT_OUT)
    c.add_argument("--dst", default=PKG_MODEL)
    c.add_argument("--bits", type=int, default=4, choices=(4, 8), help="expert and dense bits")
    c.add_argument("--mtp-bits", type=int, default=8)
    r = sub.add_parser("ref", help="tests/data/default_ref.json from the container's dequantized weights")
    r.add_argument("--src", default=DEFAULT_OUT, help="the f32 checkpoint (tensor shapes)")
    r.add_argument("--model", default=PKG_MODEL)
    r.add_argument("--out", default=REF_PATH)
    r.add_argument("--threads", type=int, default=2)
    e = sub.add_parser("eval", help="measurements for the model card")
    e.add_argument("--src", default=DEFAULT_OUT)
    e.add_argument("--model", default=PKG_MODEL)
    e.add_argument("--parts", default="all", help="comma list of quant,engine,parity,mtp,speed,samples (or all)")
    e.add_argument("--results", default="/tmp/colibri_tiny_eval.json")
    e.add_argument("--ref", default=REF_PATH, help="the parity reference written by 'ref'")
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--windows", type=int, default=None, help="held-out windows for quant (default all)")
    e.add_argument("--engine-windows", type=int, default=40)
    e.add_argument("--prompts", type=int, default=N_PROMPTS)
    e.add_argument("--tokens", type=int, default=128)
    e.add_argument("--repeats", type=int, default=1)
    k = sub.add_parser("card", help="MODEL_CARD.md from train_meta.json and the eval results")
    k.add_argument("--src", default=DEFAULT_OUT)
    k.add_argument("--model", default=PKG_MODEL)
    k.add_argument("--results", default="/tmp/colibri_tiny_eval.json")
    u = sub.add_parser("tune", help="fine-tune a container's weights against greedy loops (unlikelihood)")
    u.add_argument("--model", default=PKG_MODEL, help="the container whose weights are tuned")
    u.add_argument("--out", default="/tmp/colibri_tiny_tuned", help="the tuned f32 checkpoint")
    u.add_argument("--base-meta", default=None,
                   help="train_meta.json of the model's training (default: the container's own)")
    u.add_argument("--wheels", default=DEFAULT_WHEELS)
    u.add_argument("--threads", type=int, default=2)
    u.add_argument("--resume", action="store_true", help="continue from OUT.state.pt")
    u.add_argument("--round", type=int, default=1,
                   help="which of TUNE_ROUNDS (its settings; --model is the container of the round before)")
    for k, typ in (("steps", int), ("lr", float), ("ul_share", float), ("max_minutes", float)):
        u.add_argument("--" + k.replace("_", "-"), dest=k, type=typ, default=None,
                       help=f"default {TUNE[k]}")
    a = sub.add_parser("all", help="train, convert, tune, convert, ref, eval and card in one go (--resume)")
    a.add_argument("--out", default=DEFAULT_OUT)
    a.add_argument("--wheels", default=DEFAULT_WHEELS)
    a.add_argument("--resume", action="store_true")
    a.add_argument("--steps", type=int, default=None, help=f"training steps (default {TRAIN['steps']})")
    args = ap.parse_args(argv)
    return {"all": cmd_all, "train": cmd_train, "convert": cmd_convert, "ref": cmd_ref, "eval": cmd_eval,
            "card": cmd_card, "tune": cmd_tune}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
