"""Crash-safe persistence of a conversation's KV cache (colibri/kvstore.py): round trips that
continue bit for bit, conversations restarted between turns, damaged files refused before the
model is touched, and a writer killed with SIGKILL at random moments."""
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from colibri import _core, model_init
from colibri.draft import DraftPolicy
from colibri.kvstore import SessionError, load_session, save_session
from conftest import DATA

MTP = DATA / "tiny_mtp"
DSA = DATA / "tiny_dsa"
PREFIX, TRAILER = 24, 56


def _prompt(seed, n, vocab):
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def _greedy(m):
    return _core.Sampler(m.cfg.vocab, 0.0, 1.0, None)


def _assert_same_state(a, b, n):
    """Everything a continuation can read at positions < n is identical in a and b."""
    NL = a.cfg.n_layers
    assert list(b.kv_start) == list(a.kv_start)
    assert b.mtp_next == a.mtp_next
    assert a.hlast.tobytes() == b.hlast.tobytes()
    for i in range(NL):
        assert a.Lc[i][:n].tobytes() == b.Lc[i][:n].tobytes()
        assert a.Rc[i][:n].tobytes() == b.Rc[i][:n].tobytes()
        assert (a.Ic[i] is None) == (b.Ic[i] is None)
        if a.Ic[i] is not None:
            assert a.Ic[i][:n].tobytes() == b.Ic[i][:n].tobytes()
    if a.has_mtp and a.kv_start[NL] >= 0:
        k0 = a.kv_start[NL]
        assert a.Lc[NL][k0:n].tobytes() == b.Lc[NL][k0:n].tobytes()
        assert a.Rc[NL][k0:n].tobytes() == b.Rc[NL][k0:n].tobytes()


def _snapshot(m):
    if m.Lc is None:
        return {"max_t": m.max_t, "kv": None, "hlast": m.hlast}
    return {"max_t": m.max_t, "kv_start": list(m.kv_start), "mtp_next": m.mtp_next,
            "hlast": m.hlast.tobytes(), "ids": [id(x) for x in m.Lc],
            "kv": [x.tobytes() for x in list(m.Lc) + list(m.Rc) + [y for y in m.Ic if y is not None]]}


# ---------------------------------------------------------------------------------------------
# 1. round trip
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny_dsa", "tiny_mtp"])
def test_round_trip_continues_bit_identically(tmp_path, name):
    a = model_init(DATA / name)
    a.kv_alloc(96)
    hist = _prompt(1, 20, a.cfg.vocab)          # longer than tiny_dsa's index_topk: DSA selects
    logits = a.step(hist, 0, absorb_mtp=True)
    for _ in range(5):                          # greedy decode, every token forwarded
        t = int(np.argmax(logits))
        logits = a.step([t], len(hist))
        hist.append(t)
    pending = int(np.argmax(logits))            # chosen, not forwarded yet: kept in meta
    meta = {"pending": [pending], "text": "h\u00e9llo \u2713 <|user|>"}
    p = tmp_path / "chat.colikv"
    nbytes = save_session(p, a, hist, meta)
    assert nbytes == p.stat().st_size
    assert a.kv_bytes(len(hist)) < nbytes < a.kv_bytes(len(hist)) + 8192
    assert sorted(os.listdir(tmp_path)) == ["chat.colikv"]          # no .tmp left behind

    b = model_init(DATA / name)                 # a fresh process, as after a restart
    assert b.Lc is None
    got = load_session(p, b, reserve=40)
    assert got == (hist, meta)
    assert b.max_t == len(hist) + 40
    _assert_same_state(a, b, len(hist))
    assert b.forwards == 0

    ta = tb = pending
    pos = len(hist)
    for _ in range(16):
        la, lb = a.step([ta], pos), b.step([tb], pos)
        assert la.tobytes() == lb.tobytes()     # bit-identical logits
        ta, tb = int(np.argmax(la)), int(np.argmax(lb))
        assert ta == tb
        pos += 1
    assert b.forwards == 16                     # only the 16 new single-token forwards: no re-prefill


def test_round_trip_restores_the_mtp_head(tmp_path):
    """After speculative decoding, the restored head drafts exactly what the original drafts."""
    a = model_init(MTP)
    a.kv_alloc(128)
    ids = _prompt(2, 24, a.cfg.vocab)
    logits = a.step(ids, 0, absorb_mtp=True)   # as the CLI does with a fixed draft depth
    out, kv = a.spec_decode(ids, len(ids), 12, logits, _greedy(a), DraftPolicy(2))
    NL = a.cfg.n_layers
    assert len(out) == 12 and len(ids) == kv + 1
    assert 0 <= a.kv_start[NL] < a.mtp_next <= kv          # a non-empty MTP window to restore
    hist, pending = ids[:kv], ids[kv:]
    p = tmp_path / "s.colikv"
    save_session(p, a, hist, {"pending": pending})

    b = model_init(MTP)
    assert load_session(p, b, reserve=64) == (hist, {"pending": pending})
    _assert_same_state(a, b, kv)
    assert b.h_all is None
    da, db = a.mtp_draft(pending[0], kv, 3), b.mtp_draft(pending[0], kv, 3)
    assert da == db and len(da) == 3
    for x, y in zip(a.mtp_logits, b.mtp_logits):
        assert x.tobytes() == y.tobytes()
    la, lb = a.step(pending, kv), b.step(pending, kv)
    assert la.tobytes() == lb.tobytes()
    ia, ib, tra, trb = hist + pending, hist + pending, [], []
    oa, ka = a.spec_decode(ia, kv + 1, 16, la, _greedy(a), DraftPolicy(2), trace=tra)
    ob, kb = b.spec_decode(ib, kv + 1, 16, lb, _greedy(b), DraftPolicy(2), trace=trb)
    assert (oa, ka, ia) == (ob, kb, ib)
    assert tra == trb and tra                   # the same drafts, from the restored head


# ---------------------------------------------------------------------------------------------
# 2. a conversation restarted between turns
# ---------------------------------------------------------------------------------------------

def _turn(m, ids, kv, prompt, trace):
    """One chat turn: prefill the previous turn's pending token and the prompt from kv, then
    greedy speculative decoding of 8 tokens. Returns (ids, kv, reply, prefill logits)."""
    new = ids[kv:] + prompt
    logits = m.step(new, kv, absorb_mtp=True)
    ids = ids[:kv] + new
    out, kv = m.spec_decode(ids, len(ids), 8, logits.copy(), _greedy(m), DraftPolicy(2), trace=trace)
    return ids, kv, out, logits


@pytest.mark.parametrize("name", ["tiny_dsa", "tiny_mtp"])
def test_three_turns_restarted_between_turns_equal_the_uninterrupted_run(tmp_path, name):
    vocab = model_init(DATA / name).cfg.vocab
    prompts = [_prompt(10 + i, n, vocab) for i, n in enumerate((14, 5, 9))]

    m = model_init(DATA / name)
    m.kv_alloc(128)
    ids, kv, ref = [], 0, []
    for pr in prompts:
        trace = []
        ids, kv, out, lg = _turn(m, ids, kv, pr, trace)
        ref.append((out, lg.tobytes(), trace))
    ref_ids = ids

    p = tmp_path / "conv.colikv"
    got = []
    for t, pr in enumerate(prompts):
        m = model_init(DATA / name)             # the process restarted before every turn
        r = load_session(p, m, reserve=64)
        if r is None:
            assert t == 0
            m.kv_alloc(128)
            ids, kv = [], 0
        else:
            hist, meta = r
            assert meta["turn"] == t - 1
            ids, kv = hist + meta["pending"], len(hist)
        fw = m.forwards
        trace = []
        ids, kv, out, lg = _turn(m, ids, kv, pr, trace)
        assert m.forwards - fw == 1 + m.decode_forwards      # one prefill of the new tokens only
        got.append((out, lg.tobytes(), trace))
        save_session(p, m, ids[:kv], {"pending": ids[kv:], "turn": t})
    assert [g[0] for g in got] == [r[0] for r in ref]         # token for token
    assert got == ref                                         # and bit-identical logits, same drafts
    assert ids == ref_ids
    if name == "tiny_mtp":
        assert all(g[2] for g in got)           # every turn drafted from the (restored) head


def test_sessions_move_between_models_with_and_without_the_mtp_head(tmp_path):
    """The head is optional: a session saved without it gives a head that starts afresh; a
    head's rows are skipped by a model loaded without it. The main model continues identically."""
    p = tmp_path / "s.colikv"
    for src_mtp, dst_mtp in ((True, False), (False, True)):
        a = model_init(MTP, mtp=src_mtp)
        a.kv_alloc(64)
        hist = _prompt(6, 16, a.cfg.vocab)
        a.step(hist, 0, absorb_mtp=True)
        save_session(p, a, hist)
        b = model_init(MTP, mtp=dst_mtp)
        assert load_session(p, b) == (hist, {})
        if b.has_mtp:
            assert b.kv_start[b.cfg.n_layers] == -1 and b.mtp_next == 0
        assert a.step([7], 16).tobytes() == b.step([7], 16).tobytes()


def test_concurrent_saves_to_one_path_are_serialised(tmp_path):
    import threading
    m = model_init(DSA)
    m.kv_alloc(64)
    m.step(_prompt(7, 40, m.cfg.vocab), 0)
    p = tmp_path / "s.colikv"
    errors = []

    def writer(w):
        try:
            for i in range(12):
                save_session(p, m, list(range(3, 3 + 10 + w * 20 + i)), {"w": w, "i": i})
        except BaseException as e:              # pragma: no cover
            errors.append(e)
    ts = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    hist, meta = load_session(p, model_init(DSA))
    assert meta["i"] == 11 and len(hist) == 10 + meta["w"] * 20 + 11
    assert os.listdir(tmp_path) == ["s.colikv"]


# ---------------------------------------------------------------------------------------------
# 3. damaged and mismatched files
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny_dsa session file's bytes, and its history."""
    d = tmp_path_factory.mktemp("saved")
    a = model_init(DSA)
    a.kv_alloc(64)
    hist = _prompt(3, 30, a.cfg.vocab)
    a.step(hist, 0)
    save_session(d / "s.colikv", a, hist, {"text": "x" * 100})
    return (d / "s.colikv").read_bytes(), hist


@pytest.fixture
def victim():
    """A model with a conversation of its own in a KV cache too small for the session, so a
    loader that allocated or copied before verifying would visibly change it."""
    v = model_init(DSA)
    v.kv_alloc(24)
    v.step(_prompt(4, 12, v.cfg.vocab), 0)
    return v


def _expect(path, model, pattern):
    snap = _snapshot(model)
    with pytest.raises(SessionError, match=pattern) as ei:
        load_session(path, model)
    assert str(ei.value).startswith(str(path) + ": ")
    assert ei.value.path == str(path)
    assert _snapshot(model) == snap, "a failed load changed the model"
    return ei.value


def test_truncated_files_are_refused(tmp_path, saved, victim):
    data, _ = saved
    size = len(data)
    cuts = set(range(0, 160)) | set(range(size - 160, size)) | set(range(0, size, 97))
    q = tmp_path / "cut.colikv"
    for cut in sorted(cuts):
        q.write_bytes(data[:cut])
        _expect(q, victim, "truncated")
    q.write_bytes(data + b"\0")
    _expect(q, victim, "announces")
    q.write_bytes(data)
    assert load_session(q, victim)[0] == saved[1]               # the intact file loads


def test_every_damaged_byte_is_refused(tmp_path, saved, victim):
    data, _ = saved
    size = len(data)
    hlen = struct.unpack_from("<I", data, 12)[0]
    t0 = size - TRAILER

    def region(pos):
        if pos < 8:
            return "magic"
        if pos < 12:
            return "version"
        if pos < 16:
            return "checksum|header length"
        if pos < PREFIX:
            return "truncated|announces"
        if pos < t0:
            return "checksum mismatch"
        if pos < t0 + 8:
            return "trailer"
        if pos < t0 + 16:
            return "record count"
        if pos < t0 + 24:
            return "trailer"
        return "checksum mismatch"

    positions = set(range(0, PREFIX + 64)) | set(range(PREFIX + hlen - 8, PREFIX + hlen + 48)) \
        | set(range(0, size, 53)) | set(range(t0 - 8, size))
    q = tmp_path / "flip.colikv"
    for pos in sorted(positions):
        for mask in (0x01, 0x80):
            b = bytearray(data)
            b[pos] ^= mask
            q.write_bytes(bytes(b))
            _expect(q, victim, region(pos))


def test_foreign_files_and_models_are_refused(tmp_path, saved, victim):
    data, hist = saved
    q = tmp_path / "x.colikv"
    q.write_bytes(b"hello, this is not a session file at all" * 10)
    _expect(q, victim, "not a colibri KV session")
    shutil.copy(DSA / "model.safetensors", q)
    _expect(q, victim, "not a colibri KV session")
    q.write_bytes(data[:8] + struct.pack("<I", 99) + data[12:])
    _expect(q, victim, "format version 99")

    # a session of another model (saved with tiny_dsa, loaded into tiny_mtp)
    q.write_bytes(data)
    other = model_init(MTP)
    other.kv_alloc(50)
    other.step(_prompt(5, 8, other.cfg.vocab), 0)
    e = _expect(q, other, "another model")
    assert "config.json" in str(e)

    # another conversion: same weights, a re-serialised config.json
    conv = tmp_path / "conv"
    conv.mkdir()
    shutil.copy(DSA / "model.safetensors", conv)
    (conv / "config.json").write_text(json.dumps(json.loads((DSA / "config.json").read_text()), indent=3))
    _expect(q, model_init(conv), "config.json differs")

    # the same model in another folder: the session is accepted
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(DSA / "model.safetensors", moved)
    shutil.copy(DSA / "config.json", moved)
    assert load_session(q, model_init(moved))[0] == hist

    # the same files loaded without the DSA indexer: another KV layout
    nodsa = model_init(DSA, dsa=False)
    nodsa.kv_alloc(40)
    nodsa.step([5, 6, 7], 0)
    _expect(q, nodsa, "KV layout differs.*ic_layers")


def test_save_validation_and_stale_tmp(tmp_path, saved):
    m = model_init(DSA)
    assert load_session(tmp_path / "absent.colikv", m) is None
    assert m.Lc is None                                  # nothing allocated for an absent file
    m.kv_alloc(16)
    m.step([3, 4, 5, 6], 0)
    p = tmp_path / "s.colikv"
    with pytest.raises(TypeError):
        save_session(p, m, [3, 4, 5, 6], {"bad": object()})
    with pytest.raises(ValueError, match="holds 16 positions"):
        save_session(p, m, list(range(3, 23)))
    with pytest.raises(ValueError, match="vocabulary"):
        save_session(p, m, [3, 4, 5, 100000])
    assert os.listdir(tmp_path) == []                    # a refused save writes nothing

    # a writer killed mid-save leaves PATH.tmp: loads ignore it, the next save replaces it
    (tmp_path / "s.colikv.tmp").write_bytes(saved[0][:1000])
    assert load_session(p, m) is None
    save_session(p, m, [3, 4, 5, 6], None)
    assert os.listdir(tmp_path) == ["s.colikv"]
    (tmp_path / "s.colikv.tmp").write_bytes(b"junk" * 5000)
    snap = _snapshot(m)
    assert load_session(p, m, reserve=4) == ([3, 4, 5, 6], {})
    assert m.max_t == 16 and [id(x) for x in m.Lc] == snap["ids"]   # big enough: no reallocation
    assert m.h_all is None
    save_session(p, m, [3, 4, 5], {"k": 1})              # a shorter history (a prefix) is fine too
    assert load_session(p, m) == ([3, 4, 5], {"k": 1})
    assert os.listdir(tmp_path) == ["s.colikv"]

    # an empty conversation
    save_session(p, m, [], None)
    fresh = model_init(DSA)
    assert load_session(p, fresh, reserve=8) == ([], {}) and fresh.max_t == 8


# ---------------------------------------------------------------------------------------------
# 4. SIGKILL during saves
# ---------------------------------------------------------------------------------------------

LIB = r'''
import numpy as np

def history(k, vocab):
    n = 40 + (k * 7919) % 700
    return [int(t) for t in (np.arange(n) * 7 + k * 31) % vocab]

def kv_arrays(m):
    return list(m.Lc) + list(m.Rc) + [x for x in m.Ic if x is not None]

def pattern(k, j, n, d):
    """Contents of KV array j in save k: every element depends on k."""
    ramp = np.arange(n * d, dtype=np.float32).reshape(n, d) * np.float32(1e-3)
    return np.float32(k % 9973 + j * 0.125) + ramp

def hlast(k, hidden):
    return np.full(hidden, k % 9973 + 0.5, np.float32)
'''

WRITER = r'''
import sys
from colibri import model_init
from colibri.kvstore import save_session

path, model_dir, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
m = model_init(model_dir)
m.kv_alloc(800)
print("ready", flush=True)
while True:
    h = history(k, m.cfg.vocab)
    for j, a in enumerate(kv_arrays(m)):
        a[:len(h)] = pattern(k, j, len(h), a.shape[1])
    m.hlast = hlast(k, m.cfg.hidden)
    save_session(path, m, h, {"k": k})
    print(k, flush=True)
    k += 1
'''


def test_sigkill_during_saves_leaves_the_last_complete_session(tmp_path):
    lib = {}
    exec(LIB, lib)
    script = tmp_path / "writer.py"
    script.write_text(LIB + WRITER)
    p = tmp_path / "s.colikv"
    env = dict(os.environ, COLIBRI_SPIN="off",
               PYTHONPATH=os.pathsep.join(x or os.getcwd() for x in sys.path))
    reader = model_init(DSA)
    vocab = reader.cfg.vocab
    rng = random.Random(20240601)
    prev = None                         # k of the session at p, None while there is none
    kills = stale = mid_run = 0
    t0 = time.monotonic()
    for run in range(24):
        base = run * 100000
        # unbuffered: readline() must not read ahead into the first save's line, which
        # communicate() (reading the raw pipe) would then never see
        proc = subprocess.Popen([sys.executable, str(script), str(p), str(DSA), str(base)], bufsize=0,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path, env=env)
        try:
            line = proc.stdout.readline()
            if line != b"ready\n":
                proc.kill()
                raise AssertionError(f"writer failed to start: {line!r} {proc.communicate()[1].decode()}")
            time.sleep(rng.uniform(0.0, 0.2) if run % 6 else 0.0)
            os.kill(proc.pid, signal.SIGKILL)
            rest, err = proc.communicate()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL, err.decode()
        kills += 1
        done = [int(x) for x in rest.split(b"\n")[:-1]]          # saves that returned
        assert done == list(range(base, base + len(done)))
        stale += (tmp_path / "s.colikv.tmp").exists()
        # the file holds the last save that returned, or the next one if it was renamed into
        # place just before the kill; before any save of this run returned: the previous
        # session or this run's first
        allowed = {done[-1], done[-1] + 1} if done else {prev, base}
        mid_run += bool(done)
        res = load_session(p, reader, reserve=0)                  # never a SessionError
        if res is None:
            assert prev is None and not done
            continue
        hist, meta = res
        k = meta["k"]
        assert k in allowed, (k, allowed)
        assert hist == lib["history"](k, vocab)
        n = len(hist)
        for j, a in enumerate(lib["kv_arrays"](reader)):
            assert a[:n].tobytes() == lib["pattern"](k, j, n, a.shape[1]).tobytes()
        assert reader.hlast.tobytes() == lib["hlast"](k, reader.cfg.hidden).tobytes()
        prev = k
    assert kills >= 20 and mid_run >= 10 and prev is not None
    assert stale >= 1                   # some kills did land in the middle of a write
    save_session(p, reader, [1, 2, 3], {"k": -1})                # a stale .tmp does not block saving
    assert not (tmp_path / "s.colikv.tmp").exists()
    assert load_session(p, reader)[1] == {"k": -1}
    assert time.monotonic() - t0 < 60
