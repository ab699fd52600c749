"""Crash-safe persistence of a conversation's KV cache: warm conversations that survive restarts.

:func:`save_session` writes the token history of a conversation together with everything the
engine needs to continue it without re-prefilling a single old token: the KV rows of positions
``0 .. len(history)-1`` of every layer (latent ``Lc``, rotated key ``Rc`` and, on full DSA layers,
the indexer keys ``Ic``), the MTP head's KV window, ``kv_start``, ``mtp_next`` and ``hlast`` (the
residual of the last position, which the MTP head drafts from). :func:`load_session` puts them
back into a model; ``model.step(new_ids, len(history))`` then continues the conversation.

``history`` must be exactly the tokens whose KV rows are in the cache (positions
``0 .. len(history)-1``) and ``hlast`` must be the residual of the last of them. After
``spec_decode`` returns ``(out, kv)``, that is ``ids[:kv]``: the last emitted token is not forwarded
yet, so keep it (``ids[kv:]``) in ``meta`` and prefill it with the next turn's tokens. No logits are
stored: the next forward (of new tokens, or of that pending token) produces them.

File format (version 1, little-endian; the format is colibri's own, not glm.c's ``.coli_kv``)::

    prefix   24 B   magic b"COLIKVS\\0", u32 version, u32 header length J, u64 file size
    header   J B    UTF-8 JSON: n (tokens), model fingerprint, layout (dims, indexer layers, MTP),
                    kv_start of the main layers, mtp_start / mtp_next, hlast present, engine
                    settings (informational), meta
    padding         zeros up to a multiple of 64
    data            in this order, each a C-order array written whole:
                    tokens int32 [n]; hlast f32 [hidden] (if present);
                    per layer i: Lc f32 [n, kv_lora], Rc f32 [n, qk_rope], Ic f32 [n, index_hd]
                    (full DSA layers only); MTP row (if saved): Lc, Rc rows mtp_start .. n-1
    trailer  56 B   magic b"COLIKVE\\0", u64 n (record count), u64 trailer offset,
                    sha256 of every byte before the trailer

Crash safety: a save writes ``PATH.tmp`` in the same folder (data first, the trailer with the
record count and checksum last), fsyncs it, renames it onto ``PATH`` with ``os.replace`` and fsyncs
the folder. ``PATH`` therefore always holds either the previous complete session or the new
complete one, whenever the writer is killed; a stale ``PATH.tmp`` left by a killed writer is never
read and is reused (truncated) by the next save. Concurrent saves to the same path are serialised
with an advisory lock on the temporary file.

A load checks magic, version, file size, trailer, the checksum of the whole file, the model
fingerprint (sha256 of ``config.json`` + names and sizes of the tensor files: a session of another
model or another conversion is refused) and the layout, all before it touches the model. It never
returns partial data: it returns the complete session, ``None`` when ``PATH`` does not exist, or
raises :class:`SessionError` (the caller reports it and discards the file) with the model's KV cache
unchanged. Data are read straight into the model's KV arrays after the verification pass (two reads
of the file, the second normally from the page cache; no second copy of the session in memory).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import sys

import numpy as np

from .usage import fsync_dir, unlink_quietly

try:                                    # advisory locking of PATH.tmp (POSIX)
    import fcntl
except ImportError:                     # pragma: no cover
    fcntl = None

__all__ = ["SessionError", "save_session", "load_session", "model_fingerprint", "FORMAT_VERSION"]

MAGIC = b"COLIKVS\0"
TRAILER_MAGIC = b"COLIKVE\0"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIIQ")       # magic, version, header length, file size
_TRAILER = struct.Struct("<8sQQ32s")    # magic, record count, trailer offset, sha256
_ALIGN = 64
_CHUNK = 8 << 20                        # read size of the verification pass
_MAX_HEADER = 1 << 30
_F32 = np.dtype("<f4")
_I32 = np.dtype("<i4")


class SessionError(Exception):
    """A session file that is damaged, incomplete, or belongs to another model or layout.

    ``path`` is the file, ``reason`` what is wrong with it; ``str()`` gives both."""

    def __init__(self, path, reason):
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


# ---------------------------------------------------------------------------------------------
# model identity and layout
# ---------------------------------------------------------------------------------------------

def model_fingerprint(model) -> dict:
    """Identity of the model's files: sha256 of its config.json and the names and sizes of its
    tensor files (a re-conversion with other bit widths changes the sizes)."""
    d = os.fspath(model.path)
    with open(os.path.join(d, "config.json"), "rb") as f:
        cfg_sha = hashlib.sha256(f.read()).hexdigest()
    st = getattr(model, "st", None)
    paths = list(getattr(st, "paths", None) or [])
    if not paths:
        paths = sorted((os.path.join(d, n) for n in os.listdir(d) if n.endswith(".safetensors")),
                       key=os.fsencode)
    return {"config_sha256": cfg_sha,
            "files": [[os.path.basename(p), os.stat(p).st_size] for p in paths]}


def _layout(model) -> dict:
    c = model.cfg
    return {"n_layers": int(c.n_layers), "hidden": int(c.hidden), "vocab": int(c.vocab),
            "kv_lora": int(c.kv_lora), "qk_rope": int(c.qk_rope), "index_hd": int(c.index_hd),
            "ic_layers": model.kv_index_layers(), "mtp": bool(model.has_mtp)}


def _sections(lay, n, mtp_start, has_hlast, with_mtp=True):
    """(kind, layer, dtype, shape) of the data sections, in file order."""
    out = [("tokens", -1, _I32, (n,))]
    if has_hlast:
        out.append(("hlast", -1, _F32, (lay["hidden"],)))
    ic = set(lay["ic_layers"])
    for i in range(lay["n_layers"]):
        out.append(("Lc", i, _F32, (n, lay["kv_lora"])))
        out.append(("Rc", i, _F32, (n, lay["qk_rope"])))
        if i in ic:
            out.append(("Ic", i, _F32, (n, lay["index_hd"])))
    if with_mtp and lay["mtp"] and mtp_start >= 0:
        NL = lay["n_layers"]
        out.append(("Lc", NL, _F32, (n - mtp_start, lay["kv_lora"])))
        out.append(("Rc", NL, _F32, (n - mtp_start, lay["qk_rope"])))
    return out


def _nbytes(sec):
    return int(np.prod(sec[3], dtype=np.int64)) * sec[2].itemsize


def _align(x):
    return (x + _ALIGN - 1) // _ALIGN * _ALIGN


def _bytes_of(a):
    """Byte view of a C-contiguous array in file byte order (copies only on big-endian hosts)."""
    a = np.ascontiguousarray(a)
    le = a.dtype.newbyteorder("<")
    if a.dtype != le:
        a = a.astype(le)
    return memoryview(a).cast("B")


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------

def _open_locked_tmp(tmp):
    """Open (create) PATH.tmp and hold an exclusive lock on it. A stale file of a killed writer is
    reused; a live writer's is waited for. The inode check guards against locking a file that
    another writer has just renamed onto PATH."""
    while True:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        if fcntl is None:
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            st = os.fstat(fd)
            try:
                cur = os.stat(tmp)
            except FileNotFoundError:
                cur = None
            if cur is not None and (cur.st_ino, cur.st_dev) == (st.st_ino, st.st_dev):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)                    # renamed away under us: start again with a fresh file


def _write_all(fd, mv, h=None):
    if h is not None:
        h.update(mv)
    off, total = 0, len(mv)
    while off < total:
        off += os.write(fd, mv[off:off + (1 << 30)])


def save_session(path, model, history, meta=None) -> int:
    """Write the conversation ``history`` (the tokens whose KV rows are in the cache, positions
    ``0 .. len(history)-1``), its KV rows, ``kv_start``, ``mtp_next``, ``hlast``, the model
    fingerprint and ``meta`` (a JSON-serialisable dict) to ``path``, crash-safely (see the module
    docstring). Returns the bytes written."""
    path = os.fspath(path)
    if meta is not None and not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict or None, got {type(meta).__name__}")
    c = model.cfg
    NL = int(c.n_layers)
    toks = np.asarray(list(history) if not isinstance(history, np.ndarray) else history)
    if toks.ndim != 1 or (toks.size and toks.dtype.kind not in "iu"):
        raise TypeError("history must be a flat sequence of integer token ids")
    n = int(toks.size)
    if n and (int(toks.min()) < 0 or int(toks.max()) >= c.vocab):
        raise ValueError(f"history holds a token id outside the vocabulary [0, {c.vocab})")
    st = model.kv_snapshot(n)                  # ValueError when the cache holds fewer positions
    lay = _layout(model)
    has_hlast = st.hlast is not None
    header = {
        "format": "colibri-kv-session",
        "n": n,
        "fingerprint": model_fingerprint(model),
        "layout": lay,
        "kv_start": st.kv_start,
        "mtp_start": st.mtp_start,
        "mtp_next": st.mtp_next,
        "hlast": bool(has_hlast),
        "engine": {k: int(getattr(model, k)) for k in
                   ("idot", "act_block", "dense_bits", "expert_bits", "absorb")
                   if hasattr(model, k)},
        "model_path": os.fspath(model.path),
        "meta": meta,
    }
    hjson = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    secs = _sections(lay, n, st.mtp_start, has_hlast)
    data_off = _align(_PREFIX.size + len(hjson))
    trailer_off = data_off + sum(_nbytes(s) for s in secs)
    total = trailer_off + _TRAILER.size

    def source(kind, i):
        if kind == "tokens":
            return toks.astype(_I32)
        if kind == "hlast":
            return st.hlast
        return st.rows(kind, i)

    tmp = path + ".tmp"
    folder = os.path.dirname(os.path.abspath(path))
    fd = _open_locked_tmp(tmp)
    try:
        os.ftruncate(fd, 0)
        h = hashlib.sha256()
        _write_all(fd, memoryview(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(hjson), total)), h)
        _write_all(fd, memoryview(hjson + b"\0" * (data_off - _PREFIX.size - len(hjson))), h)
        for kind, i, dt, shape in secs:
            if not _nbytes((kind, i, dt, shape)):
                continue
            a = source(kind, i)
            if tuple(a.shape) != tuple(shape):
                raise RuntimeError(f"internal: section {kind}[{i}] has shape {a.shape}, expected {shape}")
            _write_all(fd, _bytes_of(a.astype(dt, copy=False)), h)
        if os.lseek(fd, 0, os.SEEK_CUR) != trailer_off:
            raise RuntimeError("internal: session data length differs from the planned layout")
        _write_all(fd, memoryview(_TRAILER.pack(TRAILER_MAGIC, n, trailer_off, h.digest())))
        os.fsync(fd)
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        os.close(fd)
        raise
    fsync_dir(folder)
    os.close(fd)                        # releases the lock
    return total


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------

def _read_exact_into(f, mv):
    got = 0
    while got < len(mv):
        k = f.readinto(mv[got:])
        if not k:
            return got
        got += k
    return got


def _check_header(path, hdr, n_trailer, size, data_off, model):
    """Validate the parsed header against the trailer, the file size and the model; returns
    (n, layout, sections, kv_start, mtp_start, mtp_next)."""
    def bad(reason):
        return SessionError(path, reason)

    if not isinstance(hdr, dict) or hdr.get("format") != "colibri-kv-session":
        raise bad("damaged header (not a colibri KV session)")
    n = hdr.get("n")
    if not isinstance(n, int) or n < 0:
        raise bad("damaged header (token count)")
    if n != n_trailer:
        raise bad(f"record count in the trailer ({n_trailer}) disagrees with the header ({n})")
    fp, mine = hdr.get("fingerprint"), model_fingerprint(model)
    if fp != mine:
        if not isinstance(fp, dict):
            raise bad("damaged header (model fingerprint)")
        if fp.get("config_sha256") != mine["config_sha256"]:
            raise bad(f"saved for another model or conversion: its config.json differs from "
                      f"{os.path.join(os.fspath(model.path), 'config.json')} (sha256 "
                      f"{str(fp.get('config_sha256'))[:12]}… vs {mine['config_sha256'][:12]}…; "
                      f"saved from {hdr.get('model_path')!r})")
        raise bad(f"saved for another model or conversion: tensor files {fp.get('files')} "
                  f"differ from this model's {mine['files']} (saved from {hdr.get('model_path')!r})")
    lay, want = hdr.get("layout"), _layout(model)
    if not isinstance(lay, dict):
        raise bad("damaged header (layout)")
    for k in ("n_layers", "hidden", "vocab", "kv_lora", "qk_rope", "index_hd", "ic_layers"):
        if lay.get(k) != want[k]:
            extra = " (the model was loaded with the DSA indexer on/off differently)" \
                if k == "ic_layers" else ""
            raise bad(f"KV layout differs from the model's: {k} = {lay.get(k)!r}, "
                      f"the model has {want[k]!r}{extra}")
    if not isinstance(lay.get("mtp"), bool):
        raise bad("damaged header (layout)")
    NL = want["n_layers"]
    ks = hdr.get("kv_start")
    if not (isinstance(ks, list) and len(ks) == NL and
            all(isinstance(v, int) and 0 <= v <= max(n, 0) for v in ks)):
        raise bad("damaged header (kv_start)")
    a, m = hdr.get("mtp_start"), hdr.get("mtp_next")
    if not (isinstance(a, int) and isinstance(m, int) and (a == -1 or 0 <= a < n) and 0 <= m <= n
            and (a < 0 or lay["mtp"])):
        raise bad("damaged header (MTP window)")
    has_hlast = hdr.get("hlast")
    if not isinstance(has_hlast, bool):
        raise bad("damaged header (hlast)")
    if not (hdr.get("meta") is None or isinstance(hdr.get("meta"), dict)):
        raise bad("damaged header (meta)")
    secs = _sections(lay, n, a, has_hlast)
    if data_off + sum(_nbytes(s) for s in secs) + _TRAILER.size != size:
        raise bad("the data sections disagree with the file length")
    return n, lay, secs, ks, a, m


def load_session(path, model, *, reserve=256):
    """Restore the session saved at ``path`` into ``model``; returns ``(history, meta)``, or
    ``None`` when ``path`` does not exist.

    Everything is verified first (magic, version, lengths, sha256 checksum, model fingerprint,
    layout); on any mismatch :class:`SessionError` is raised and the model is left as it was —
    partial data are never returned or installed. Then, only if the KV cache is absent or holds
    fewer than ``len(history) + reserve`` positions, ``model.kv_alloc`` grows it (to at most the
    model's context limit); the rows are copied back and ``kv_start``, ``mtp_next`` and ``hlast``
    set (``h_all`` is cleared). ``model.step(new_ids, len(history))`` continues the conversation."""
    path = os.fspath(path)
    if reserve < 0:
        raise ValueError(f"reserve must be >= 0, got {reserve}")

    def bad(reason):
        return SessionError(path, reason)

    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise bad(f"cannot open: {e.strerror or e}") from e
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            head = bytearray(min(size, _PREFIX.size))
            got = _read_exact_into(f, memoryview(head))
        except OSError as e:
            raise bad(f"cannot read: {e.strerror or e}") from e
        head = bytes(head[:got])
        if size == 0:
            raise bad("empty file (truncated)")
        if head[:8] != MAGIC[:len(head[:8])]:
            raise bad(f"not a colibri KV session file (magic {head[:8]!r}, expected {MAGIC!r})")
        if size < _PREFIX.size:
            raise bad(f"truncated: {size} bytes, shorter than the file prefix")
        _, version, hlen, total = _PREFIX.unpack(head)
        if version != FORMAT_VERSION:
            raise bad(f"format version {version}, this colibri reads version {FORMAT_VERSION}")
        if total != size:
            if size < total:
                raise bad(f"truncated: {size} bytes, the header announces {total} (incomplete write?)")
            raise bad(f"{size} bytes, the header announces {total} (damaged or appended to)")
        data_off = _align(_PREFIX.size + hlen)
        if hlen > _MAX_HEADER or data_off + _TRAILER.size > size:
            raise bad(f"damaged prefix (header length {hlen} does not fit a file of {size} bytes)")
        # verification pass: checksum of every byte before the trailer
        h = hashlib.sha256(head)
        trailer_off = size - _TRAILER.size
        hjson = bytearray(hlen)
        try:
            if _read_exact_into(f, memoryview(hjson)) != hlen:
                raise bad("truncated while reading (the file shrank)")
            h.update(hjson)
            buf = bytearray(min(_CHUNK, max(trailer_off, 1)))
            mv = memoryview(buf)
            left = trailer_off - _PREFIX.size - hlen
            while left > 0:
                k = _read_exact_into(f, mv[:min(left, len(buf))])
                if k == 0:
                    raise bad("truncated while reading (the file shrank)")
                h.update(mv[:k])
                left -= k
            tr = bytearray(_TRAILER.size)
            if _read_exact_into(f, memoryview(tr)) != _TRAILER.size:
                raise bad("truncated while reading (the file shrank)")
        except OSError as e:
            raise bad(f"cannot read: {e.strerror or e}") from e
        tmagic, n_tr, t_off, digest = _TRAILER.unpack(bytes(tr))
        if tmagic != TRAILER_MAGIC:
            raise bad("damaged trailer (end marker missing: incomplete or damaged file)")
        if t_off != trailer_off:
            raise bad(f"damaged trailer (it records offset {t_off}, it sits at {trailer_off})")
        if digest != h.digest():
            raise bad("checksum mismatch: the file is damaged")
        try:
            hdr = json.loads(bytes(hjson).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise bad(f"damaged header ({e})") from e
        n, lay, secs, ks, mtp_a, mtp_m = _check_header(path, hdr, n_tr, size, data_off, model)
        offs, o = [], data_off
        for s in secs:
            offs.append(o)
            o += _nbytes(s)

        def read_section(j, dest):
            f.seek(offs[j])
            mvd = memoryview(dest).cast("B")
            if _read_exact_into(f, mvd) != len(mvd):
                raise bad("truncated while reading (the file shrank)")
            if sys.byteorder == "big":                      # pragma: no cover
                dest.byteswap(inplace=True)

        # small sections first, into fresh arrays: tokens and hlast
        try:
            toks = np.empty(n, np.int32)
            read_section(0, toks)
            hlast = None
            if hdr["hlast"]:
                hlast = np.empty(lay["hidden"], np.float32)
                read_section(1, hlast)
        except OSError as e:
            raise bad(f"cannot read: {e.strerror or e}") from e
        if n and (int(toks.min()) < 0 or int(toks.max()) >= lay["vocab"]):
            raise bad("damaged data (token id outside the vocabulary)")

        # commit: from here on the model is modified
        c = model.cfg
        NL = lay["n_layers"]
        need = max(n + int(reserve), 1)
        if c.max_positions:
            need = max(min(need, c.max_positions + 64), n)
        model.kv_reserve(need)                         # ValueError (e.g. memory): model untouched
        from ._core import KVState
        st = KVState(n, ks, mtp_a if lay["mtp"] else -1, mtp_m if lay["mtp"] else 0, hlast)
        st._model = model
        try:
            for j, (kind, i, _, shape) in enumerate(secs):
                if kind in ("tokens", "hlast") or not _nbytes(secs[j]):
                    continue
                if i == NL and not model.has_mtp:
                    continue                            # saved with a head this model has not loaded
                dest = st.rows(kind, i)
                if tuple(dest.shape) != tuple(shape) or not dest.flags.c_contiguous:
                    raise bad(f"internal: KV array {kind}[{i}] has shape {dest.shape}, expected {shape}")
                read_section(j, dest)
        except (OSError, SessionError) as e:
            model.kv_clear()                             # never leave a half-restored cache
            why = e.reason if isinstance(e, SessionError) else f"cannot read: {e.strerror or e}"
            raise bad(f"{why}; the KV cache was cleared") from e
        model.kv_restore(st)
    meta = hdr.get("meta")
    return [int(t) for t in toks.tolist()], (meta if meta is not None else {})
