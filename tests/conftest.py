import os
import pathlib
import subprocess
import sys

import pytest

DATA = pathlib.Path(__file__).parent / "data"
FAT_TWIN = pathlib.Path(__file__).resolve().parent.parent / "tools" / "make_fat_twin.py"


def fat_twin(src, dst, width):
    """tools/make_fat_twin.py SRC DST --width WIDTH (experts zero-padded to WIDTH): the process."""
    return subprocess.run([sys.executable, str(FAT_TWIN), str(src), str(dst), "--width", str(width)],
                          capture_output=True, text=True, timeout=300)


def greedy_steps(m, ids, n):
    """Prefill ids, then n greedy steps: (tokens, logits of every step [n + 1, V])."""
    import numpy as np
    ids = list(ids)
    m.kv_alloc(len(ids) + n + 1)
    logits = [m.step(ids, 0)]
    out = []
    for i in range(n):
        out.append(int(np.argmax(logits[-1])))
        logits.append(m.step([out[-1]], len(ids) + i))
    return out, np.stack(logits)
ORACLES = ["tiny_dense", "tiny_dsa"]


@pytest.fixture(scope="session", autouse=True)
def _usage_history_outside_the_checkout(tmp_path_factory):
    """Runs save their routing history next to the model; tests keep it in a temporary folder
    (inherited by the CLI subprocesses) so that nothing is written into tests/data or the package."""
    os.environ["COLIBRI_USAGE_DIR"] = str(tmp_path_factory.mktemp("usage"))
    yield


@pytest.fixture(scope="session")
def data_dir():
    return DATA


def oracle_dir(name):
    return DATA / name


def decode(m, prompt, n_new, mode, temperature=0.0, seed=None, top_p=1.0, **settings):
    """n_new tokens after prompt through the one driver (colibri.session), draft mode `mode`, end-of-
    sequence tokens ignored, the model's cache as the test set it up -> (tokens, draft policy).
    settings: other generation options (top_k, repeat_penalty, ...)."""
    from colibri.options import Options
    from colibri.session import Session, positions_needed
    s = Session(m, Options(draft=mode, ignore_eos=True), context=positions_needed(len(prompt), n_new, mode),
                configure=False)
    g = s.generate(prompt, max_tokens=n_new, temperature=temperature, top_p=top_p, seed=seed, **settings)
    return g.token_ids, s.policy


# A chat template in the style of GLM-5's own (its text is ours): [gMASK]<sop>, <|system|>, <|user|>,
# <|assistant|> with an empty <think></think> on past answers and <think> opened for the new one.
# The block tags sit on their own, indented lines: only trim_blocks + lstrip_blocks (as transformers
# renders templates) leave no stray newlines or spaces.
GLM_STYLE_TEMPLATE = """[gMASK]<sop>
{%- for m in messages %}
    {% if m.role == 'system' %}
<|system|>{{ m.content }}
    {%- elif m.role == 'user' %}
<|user|>{{ m.content }}
    {%- elif m.role == 'assistant' %}
<|assistant|><think></think>{{ m.content | trim }}
    {%- else %}
{{ raise_exception('role ' ~ m.role ~ ' is not supported') }}
    {%- endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>{{ '<think></think>' if enable_thinking is defined and not enable_thinking else '<think>' }}
{%- endif %}
"""


def model_folder(root, files=None):
    """A model folder under root: the embedded default model's files (symlinked), with the files of
    `files` ({name: text}) written instead (text None: the file is left out)."""
    from colibri.models import default_model_dir
    files = files or {}
    src = default_model_dir()
    d = pathlib.Path(root) / "model"
    d.mkdir(parents=True)
    for name in os.listdir(src):
        if name not in files:
            (d / name).symlink_to(os.path.join(src, name))
    for name, text in files.items():
        if text is not None:
            (d / name).write_text(text, encoding="utf-8")
    return d


def tokenizer_json_adding_endoftext() -> str:
    """The default model's tokenizer.json with a post-processor that puts <|endoftext|> before every
    encoding (as a BOS-adding tokenizer does): chat prompts must not get it (their format holds every
    special token, as transformers' apply_chat_template tokenizes)."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    from colibri.models import default_model_dir
    tok = Tokenizer.from_file(os.path.join(default_model_dir(), "tokenizer.json"))
    tok.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                            special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))])
    return tok.to_str()
