"""Expert usage learning (spec §7.3) and routing-statistics files (spec §7.2).

File format, shared by ``--pin STATS`` files and the usage history: one record per line,
``layer eid count`` (decimal integers separated by whitespace), only nonzero counts, ascending layer
then expert. On load, ``#`` starts a comment that runs to the end of the line, blank lines are
ignored, and repeated records of one (layer, eid) are added up. Files written by :func:`save_counts`
have no comments, so they stay readable by the reference engine's ``.coli_usage`` reader.

Standard library + numpy only.
"""
from __future__ import annotations

import hashlib
import os
import re

import numpy as np

from .options import switch

__all__ = ["load_counts", "save_counts", "format_counts", "usage_path", "choose_pins",
           "autopin_budget", "autopin_floor", "AUTOPIN_MIN_HISTORY", "AUTOPIN_FULL_HISTORY",
           "AUTOPIN_FRACTION", "AUTOPIN_MIN_BYTES", "USAGE_FILE"]

USAGE_FILE = ".colibri_usage"
AUTOPIN_MIN_HISTORY = 5000          # selections in the history before autopin does anything
AUTOPIN_FULL_HISTORY = 200000       # history at which autopin trusts it fully
AUTOPIN_FRACTION = 0.5              # share of the expert budget autopin may pin
AUTOPIN_MIN_BYTES = 500_000_000     # the spec's 0.5 GB floor (see autopin_floor)
_INT = re.compile(r"[+-]?[0-9]+")


def load_counts(path, n_rows: int, n_experts: int, missing_ok: bool = False, strict: str = ""):
    """Read a counts file -> ``(counts, skipped)``.

    counts: numpy int64 [n_rows, n_experts]. skipped: the number of well-formed records that were
    ignored because their layer or expert lies outside that shape (e.g. a file from another model).
    A line that is not three integers, or has a negative count, raises ``ValueError`` naming the
    file and the line number. A missing file raises ``FileNotFoundError``, or gives zeros when
    ``missing_ok``. ``strict`` (the option the file came from, e.g. ``--pin``): a record outside
    the shape is a ValueError naming it, the file and the line, instead of skipped.
    """
    counts = np.zeros((n_rows, n_experts), np.int64)
    skipped = 0
    path = os.fspath(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        if missing_ok:
            return counts, 0
        raise
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text") from None
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            parts = text.split()
            if len(parts) != 3:
                raise ValueError(f"{path}:{lineno}: expected 'layer eid count', got {line.strip()!r}")
            if not all(_INT.fullmatch(x) for x in parts):
                raise ValueError(f"{path}:{lineno}: expected three decimal integers, got {line.strip()!r}")
            layer, eid, count = (int(x) for x in parts)
            if count < 0:
                raise ValueError(f"{path}:{lineno}: negative count {count}")
            if not (0 <= layer < n_rows and 0 <= eid < n_experts):
                if strict:
                    what = f"layer {layer}" if not 0 <= layer < n_rows else f"expert {eid}"
                    raise ValueError(f"{strict} {path}:{lineno}: {what} does not exist in this model (layers "
                                     f"0..{n_rows - 1}, the MTP head's the last; experts 0..{n_experts - 1})")
                skipped += 1
                continue
            counts[layer, eid] += count
    return counts, skipped


def format_counts(counts) -> str:
    """The file text of a counts array: nonzero records, ascending layer then expert."""
    counts = np.asarray(counts)
    if counts.ndim != 2:
        raise ValueError(f"counts must be 2-D [rows, experts], got shape {counts.shape}")
    if counts.size and counts.min() < 0:
        raise ValueError("counts must be >= 0")
    layers, eids = np.nonzero(counts)          # row-major: ascending layer, then expert
    return "".join(f"{int(l)} {int(e)} {int(counts[l, e])}\n" for l, e in zip(layers, eids))


def save_counts(path, counts) -> None:
    """Write counts atomically (write_bytes_atomic)."""
    write_bytes_atomic(path, format_counts(counts).encode("utf-8"))


def write_bytes_atomic(path, data: bytes, tmp=None) -> None:
    """Write data to path atomically: to a temporary file in the same folder (tmp, default
    ``path.tmp``), fsync it, rename it over path and fsync the folder, so the rename itself is
    durable; the temporary file is removed if anything fails."""
    path = os.fspath(path)
    tmp = path + ".tmp" if tmp is None else os.fspath(tmp)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def unlink_quietly(path) -> None:
    """Remove a file if it is there (an atomic writer's temporary, on the way out of an error)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def fsync_dir(folder) -> None:
    """fsync a folder (after a rename in it), best effort: some file systems refuse it."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def usage_path(model_dir) -> str:
    """Where the usage history of the model in ``model_dir`` lives.

    ``model_dir/.colibri_usage`` when that folder exists and is writable; otherwise (e.g. the
    embedded default model inside a read-only site-packages)
    ``$XDG_CACHE_HOME/colibri/usage/<first 16 hex of sha256(absolute model path)>.txt``, with
    ``~/.cache`` when ``XDG_CACHE_HOME`` is unset, empty or relative (XDG rule); that folder is
    created. ``COLIBRI_USAGE_DIR`` forces that folder for every model (tests use it so that no run
    writes into a model folder).
    """
    return model_state_path(model_dir, USAGE_FILE, "usage", ".txt")


def model_state_path(model_dir, filename: str, cache_subdir: str, ext: str) -> str:
    """A file of state kept for a model (routing history, chat session): ``model_dir/filename``
    when that folder is writable, else ``<cache>/colibri/<cache_subdir>/<sha256(model path)[:16]><ext>``
    (``$XDG_CACHE_HOME`` when absolute, else ``~/.cache``; created), or that file name in
    ``COLIBRI_USAGE_DIR`` when it is set."""
    model_dir = os.path.abspath(os.fspath(model_dir))
    forced = switch("USAGE_DIR")
    if not forced and os.path.isdir(model_dir) and os.access(model_dir, os.W_OK | os.X_OK):
        return os.path.join(model_dir, filename)
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not base or not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    folder = forced or os.path.join(base, "colibri", cache_subdir)
    os.makedirs(folder, exist_ok=True)
    digest = hashlib.sha256(model_dir.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(folder, digest + ext)


def choose_pins(counts, budget_bytes, expert_bytes_by_row) -> list:
    """The experts to pin: ``[(layer, eid), ...]``, most used first.

    Ranking: count descending, ties by lower layer, then lower expert; only count > 0, and only
    rows whose expert size ``expert_bytes_by_row[layer]`` is > 0 (dense rows have no experts).
    Walking down the ranking, an expert is taken if it still fits in what is left of
    ``budget_bytes``; one that does not fit is passed over and the walk goes on, so a smaller expert
    further down may still be taken (this matters only when rows differ in size, e.g. the MTP row's
    int8 experts). With equal sizes this is exactly the top ``budget // size`` of the ranking.
    """
    counts = np.asarray(counts)
    if counts.ndim != 2:
        raise ValueError(f"counts must be 2-D [rows, experts], got shape {counts.shape}")
    sizes = [int(b) for b in expert_bytes_by_row]
    if len(sizes) < counts.shape[0]:
        raise ValueError(f"expert_bytes_by_row has {len(sizes)} rows, counts has {counts.shape[0]}")
    left = int(budget_bytes)
    if left <= 0:
        return []
    layers, eids = np.nonzero(counts > 0)
    if layers.size == 0:
        return []
    vals = counts[layers, eids]
    order = np.lexsort((eids, layers, -vals.astype(np.int64)))
    smallest = min((s for s in sizes if s > 0), default=0)
    out = []
    for i in order:
        layer, eid = int(layers[i]), int(eids[i])
        size = sizes[layer]
        if size <= 0 or size > left:
            continue
        out.append((layer, eid))
        left -= size
        if left < smallest:
            break
    return out


def autopin_floor(smallest_expert_bytes: int) -> int:
    """The minimum autopin budget: ``min(0.5 GB, 8 experts)``.

    Deviation from the spec, which uses a fixed 0.5 GB floor: on a small model (the embedded default
    one's experts are a few hundred KB) 0.5 GB is more than all its experts together, so the fixed
    floor would disable autopin on every small model. Eight experts is still enough for the pins to
    be worth a startup read."""
    return int(min(AUTOPIN_MIN_BYTES, 8 * int(smallest_expert_bytes)))


def autopin_budget(history_total: int, expert_avail_bytes: int, min_bytes: int = AUTOPIN_MIN_BYTES) -> int:
    """Bytes autopin may pin (spec §7.3): 0 with fewer than 5000 selections of history; else
    ``expert_avail · 0.5 · min(1, history / 200000)``, and 0 when that is below ``min_bytes``
    (the spec's 0.5 GB by default; pass ``autopin_floor(smallest expert bytes)`` for small models)."""
    history_total = int(history_total)
    expert_avail_bytes = int(expert_avail_bytes)
    if history_total < AUTOPIN_MIN_HISTORY or expert_avail_bytes <= 0:
        return 0
    conf = min(1.0, history_total / AUTOPIN_FULL_HISTORY)
    budget = int(expert_avail_bytes * AUTOPIN_FRACTION * conf)
    return budget if budget >= int(min_bytes) and budget > 0 else 0
