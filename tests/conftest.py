import os
import pathlib

import pytest

DATA = pathlib.Path(__file__).parent / "data"
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


def decode(m, prompt, n_new, mode, temperature=0.0, seed=None, top_p=1.0):
    """Prefill prompt, then spec_decode n_new tokens with draft mode `mode` -> (tokens, policy)."""
    from colibri import _core
    from colibri.draft import DraftPolicy
    m.kv_alloc(len(prompt) + n_new + 20)
    m.reset_stats()
    pol = DraftPolicy(mode)
    m.mtp_absorb_prefill = m.has_mtp and isinstance(pol.mode, int) and pol.mode > 0     # as the CLI
    ids = list(prompt)
    logits = m.step(ids, 0)
    out, _ = m.spec_decode(ids, len(prompt), n_new, logits,
                           _core.Sampler(m.cfg.vocab, temperature, top_p, seed), pol)
    return out, pol
