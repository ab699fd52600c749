"""Read-only access to a directory of safetensors files (the weight container).

This is the Python side of the container reader described in the engine spec
(section 2.1).  A model directory holds one or more ``*.safetensors`` files; every
file is indexed, in byte order of the file names (like C ``strcmp``), and a
tensor name that appears in several files resolves to the alphabetically first
file.

Every header is validated when the directory is opened, so a truncated or
corrupt file is reported immediately, naming the file (and the tensor where one
is involved), instead of failing later in the middle of inference.

A folder holding an HF ``model.safetensors.index.json`` (a sharded checkpoint) is
checked against it at open: every shard the index names must be there and hold
the tensors the index puts in it, and only those shards are read (another
``.safetensors`` file, an adapter say, is skipped and listed in
:attr:`SafeTensorsDir.skipped`).  A folder without an index (colibri's own
containers) is read whole: every ``.safetensors`` file, whatever its name.

Tensor data are read with ``os.pread`` on file descriptors that stay open for
the lifetime of the :class:`SafeTensorsDir`; the engine may use the same
descriptors (:meth:`SafeTensorsDir.fileno`) for its own reads, or map a file
read-only (:meth:`SafeTensorsDir.map`) and use its tensors in place.

Only numpy is needed.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

__all__ = [
    "ContainerError",
    "MissingTensorError",
    "TensorInfo",
    "SafeTensorsDir",
    "DTYPE_SIZES",
    "FLOAT_DTYPES",
    "MAX_HEADER_BYTES",
    "INDEX_NAME",
    "read_index",
    "scan_file",
    "decode_f32",
    "e4m3_table",
]

#: Largest JSON header accepted (same limit as the safetensors library).
MAX_HEADER_BYTES = 100_000_000

#: The shard index of a sharded HF checkpoint (tensor name -> shard file name).
INDEX_NAME = "model.safetensors.index.json"

#: Item size in bytes of every safetensors dtype this reader understands.
#: (Sub-byte dtypes such as F4 or F6_* are not supported and count as unknown.)
DTYPE_SIZES: Dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

#: Dtypes that :func:`decode_f32` / :meth:`SafeTensorsDir.read_f32` convert.
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F64"})

# Largest single read handed to the kernel (Linux caps one read near 2 GiB).
_READ_CHUNK = 1 << 30


class ContainerError(ValueError):
    """A problem with a container file or directory.

    Messages always name the file (or directory) and, where relevant, the tensor.
    """


class MissingTensorError(ContainerError, KeyError):
    """A tensor name that the container does not hold (also a ``KeyError``)."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives on disk."""

    name: str
    path: str
    file_index: int
    offset: int  # absolute byte offset of the first data byte in the file
    nbytes: int
    dtype: str  # safetensors dtype string ("F32", "BF16", "U8", ...)
    shape: Tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


# ---------------------------------------------------------------------------
# dtype decoding


def _build_e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn codes.

    e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
    infinities; exponent 15 with mantissa 7 (0x7F / 0xFF) is NaN, every other
    code is finite (largest magnitude 448).
    """
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    subnormal = (man / 8.0) * np.exp2(1.0 - 7.0)
    vals = sign * np.where(exp == 0, subnormal, normal)
    vals[(exp == 15) & (man == 7)] = np.nan
    return vals.astype(np.float32)


_E4M3 = _build_e4m3_table()
_E4M3.setflags(write=False)


def e4m3_table() -> np.ndarray:
    """Read-only float32 lookup table: code (0..255) -> e4m3fn value."""
    return _E4M3


def decode_f32(raw: np.ndarray, dtype: str, what: str = "tensor") -> np.ndarray:
    """Convert raw little-endian bytes of a float dtype to a 1-D float32 array.

    ``raw`` is a uint8 array (or anything exposing the buffer protocol).
    BF16, F16, F32, F64, F8_E4M3 (e4m3fn) and F8_E5M2 are supported; U8/I8 and
    the other integer types are rejected (packed payloads are never floats).
    ``what`` names the tensor/file in error messages.
    """
    buf = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1)
    if buf.dtype != np.uint8:
        buf = buf.view(np.uint8)
    if dtype not in FLOAT_DTYPES:
        raise ContainerError(f"{what}: dtype {dtype} cannot be read as float32")
    size = DTYPE_SIZES[dtype]
    if buf.size % size:
        raise ContainerError(f"{what}: {buf.size} bytes is not a whole number of {dtype} items")
    if dtype == "F32":
        return buf.view("<f4").astype(np.float32, copy=True)
    if dtype == "BF16":
        hi = buf.view("<u2").astype(np.uint32)
        return (hi << np.uint32(16)).view(np.float32)
    if dtype == "F16":
        return buf.view("<f2").astype(np.float32)
    if dtype == "F64":
        return buf.view("<f8").astype(np.float32)
    if dtype == "F8_E4M3":
        return _E4M3[buf]
    if dtype == "F8_E5M2":
        # e5m2 is exactly the high byte of an IEEE half.
        half = buf.astype(np.uint16) << np.uint16(8)
        return half.view(np.float16).astype(np.float32)
    raise ContainerError(f"{what}: dtype {dtype} cannot be read as float32")  # pragma: no cover


# ---------------------------------------------------------------------------
# header parsing


def _no_duplicate_keys(pairs):
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise ValueError(f"duplicate key {k!r}")
        obj[k] = v
    return obj


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def scan_file(path: str, file_index: int = 0, fd: Optional[int] = None):
    """Parse and validate the header of one safetensors file.

    Returns ``(tensors, header_len, data_end)``: a dict name -> :class:`TensorInfo`
    (in header order), the JSON header length, and the largest data offset used
    (relative to the start of the data region).  Raises :class:`ContainerError`
    naming the file (and tensor) on any inconsistency.
    """
    own_fd = fd is None
    if own_fd:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise ContainerError(f"{path}: cannot open: {e.strerror}") from e
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise ContainerError(f"{path}: file is {size} bytes, too small for a safetensors header")
        head = os.pread(fd, 8, 0)
        if len(head) != 8:
            raise ContainerError(f"{path}: short read of the header length")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > MAX_HEADER_BYTES:
            raise ContainerError(
                f"{path}: header length {hlen} exceeds the {MAX_HEADER_BYTES}-byte limit "
                "(not a safetensors file?)"
            )
        if 8 + hlen > size:
            raise ContainerError(
                f"{path}: header length {hlen} runs past the end of the {size}-byte file "
                "(truncated or not a safetensors file)"
            )
        raw = _pread_exact(fd, hlen, 8, path)
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
        except (UnicodeDecodeError, ValueError) as e:
            raise ContainerError(f"{path}: header is not valid JSON: {e}") from e
        if not isinstance(header, dict):
            raise ContainerError(f"{path}: header is not a JSON object")
        data_start = 8 + hlen
        data_len = size - data_start
        tensors: Dict[str, TensorInfo] = {}
        ranges: List[Tuple[int, int, str]] = []  # (begin, end, name) of every tensor's data
        data_end = 0
        for name, ent in header.items():
            if name == "__metadata__":
                if ent is not None and not isinstance(ent, dict):
                    raise ContainerError(f"{path}: __metadata__ is not a JSON object")
                continue
            where = f"{path}: tensor {name!r}"
            if not isinstance(ent, dict):
                raise ContainerError(f"{where}: entry is not a JSON object")
            for key in ("dtype", "shape", "data_offsets"):
                if key not in ent:
                    raise ContainerError(f"{where}: missing {key!r}")
            dtype = ent["dtype"]
            if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
                raise ContainerError(f"{where}: unknown dtype {dtype!r}")
            shape = ent["shape"]
            if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
                raise ContainerError(f"{where}: shape {shape!r} is not a list of integers")
            if any(d < 0 for d in shape):
                raise ContainerError(f"{where}: negative dimension in shape {shape}")
            offs = ent["data_offsets"]
            if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
                raise ContainerError(f"{where}: data_offsets {offs!r} is not a pair of integers")
            begin, end = offs
            if begin < 0 or end < begin:
                raise ContainerError(f"{where}: bad data_offsets {offs}")
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * DTYPE_SIZES[dtype]
            if end - begin != nbytes:
                raise ContainerError(
                    f"{where}: data_offsets {offs} hold {end - begin} bytes but "
                    f"{dtype}{shape} needs {nbytes}"
                )
            if end > data_len:
                raise ContainerError(
                    f"{where}: data ends at byte {data_start + end} but the file has only "
                    f"{size} bytes (truncated file)"
                )
            data_end = max(data_end, end)
            ranges.append((begin, end, name))
            tensors[name] = TensorInfo(
                name=name,
                path=path,
                file_index=file_index,
                offset=data_start + begin,
                nbytes=nbytes,
                dtype=dtype,
                shape=tuple(shape),
            )
        _check_no_overlap(path, ranges)
        return tensors, hlen, data_end
    finally:
        if own_fd:
            os.close(fd)


def _check_no_overlap(path: str, ranges: List[Tuple[int, int, str]]) -> None:
    """Refuse two tensors whose data share bytes (the safetensors library refuses them too):
    a write through one would change the other. Empty tensors hold no bytes and overlap nothing."""
    filled = sorted(r for r in ranges if r[1] > r[0])
    for (b0, e0, n0), (b1, e1, n1) in zip(filled, filled[1:]):
        if b1 < e0:
            raise ContainerError(
                f"{path}: tensors {n0!r} (data bytes [{b0}, {e0})) and {n1!r} (data bytes [{b1}, {e1})) "
                "overlap; a safetensors file stores every tensor in its own byte range"
            )


#: alignment of the buffers tensors are read into: one cache line, so a 64-byte SIMD load of a
#: weight row never straddles two lines (numpy's own allocations are 16-byte aligned)
BUFFER_ALIGN = 64


def aligned_empty(nbytes: int) -> np.ndarray:
    """A new uint8 array of ``nbytes`` starting on a BUFFER_ALIGN boundary (a view of a slightly
    larger allocation, which it keeps alive)."""
    raw = np.empty(nbytes + BUFFER_ALIGN, dtype=np.uint8)
    at = (-raw.ctypes.data) % BUFFER_ALIGN
    return raw[at:at + nbytes]


def _pread_into(fd: int, out: np.ndarray, offset: int, what: str) -> None:
    """Fill the uint8 array ``out`` from ``fd`` at ``offset``; short read -> error."""
    mv = memoryview(out).cast("B")
    total = len(mv)
    done = 0
    while done < total:
        want = min(total - done, _READ_CHUNK)
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [mv[done : done + want]], offset + done)
        else:  # pragma: no cover - platforms without preadv
            chunk = os.pread(fd, want, offset + done)
            n = len(chunk)
            mv[done : done + n] = chunk
        if n <= 0:
            raise ContainerError(
                f"{what}: short read ({done} of {total} bytes at offset {offset}); "
                "the file was truncated or changed"
            )
        done += n


def _pread_exact(fd: int, nbytes: int, offset: int, what: str) -> bytes:
    buf = np.empty(nbytes, dtype=np.uint8)
    _pread_into(fd, buf, offset, what)
    return buf.tobytes()


# ---------------------------------------------------------------------------
# shard index


def read_index(directory: str) -> Optional[Dict[str, str]]:
    """The ``weight_map`` of ``DIR/model.safetensors.index.json`` (tensor name -> shard file
    name), or None when the folder has no index."""
    path = os.path.join(directory, INDEX_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            index = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise ContainerError(f"{path}: cannot read: {e.strerror}") from e
    except (UnicodeDecodeError, ValueError) as e:
        raise ContainerError(f"{path}: not valid JSON: {e}") from e
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise ContainerError(f"{path}: has no 'weight_map' object naming the shard of every tensor")
    for name, shard in wmap.items():
        if not (isinstance(shard, str) and shard.endswith(".safetensors")
                and os.path.basename(shard) == shard and shard not in (".", "..")):
            raise ContainerError(f"{path}: weight_map puts tensor {name!r} in {shard!r}, which is not "
                                 "the name of a .safetensors file in this folder")
    return wmap


def _indexed_files(directory: str, names: List[str], wmap: Dict[str, str]) -> Tuple[List[str], List[str]]:
    """(shards the index names, other .safetensors files); a named shard that is missing is an
    error naming it and a tensor the index puts in it."""
    by_shard: Dict[str, List[str]] = {}
    for tensor, shard in wmap.items():
        by_shard.setdefault(shard, []).append(tensor)
    present = set(names)
    missing = sorted((s for s in by_shard if s not in present), key=os.fsencode)
    if missing:
        shard = missing[0]
        tensors = by_shard[shard]
        more = f" and {len(tensors) - 1} more" if len(tensors) > 1 else ""
        also = f" (and {len(missing) - 1} more missing shard(s))" if len(missing) > 1 else ""
        raise ContainerError(
            f"{os.path.join(directory, INDEX_NAME)}: names shard {shard} (tensor {tensors[0]!r}{more}), "
            f"which is missing from {directory}{also}; the checkpoint is incomplete"
        )
    return [n for n in names if n in by_shard], [n for n in names if n not in by_shard]


def _check_index_tensors(directory: str, wmap: Dict[str, str], paths: List[str],
                         per_file: List[Dict[str, "TensorInfo"]]) -> None:
    """Every tensor the index names is in the shard it names."""
    held = {os.path.basename(p): tensors for p, tensors in zip(paths, per_file)}
    absent = [(t, s) for t, s in wmap.items() if t not in held[s]]
    if absent:
        tensor, shard = absent[0]
        more = f" ({len(absent) - 1} more tensor(s) of the index are missing too)" if len(absent) > 1 else ""
        raise ContainerError(
            f"{os.path.join(directory, INDEX_NAME)}: names tensor {tensor!r} in shard {shard}, but "
            f"{os.path.join(directory, shard)} does not hold it{more}; the checkpoint is incomplete"
        )


# ---------------------------------------------------------------------------
# directory


class SafeTensorsDir:
    """Index of every ``*.safetensors`` file in a directory.

    Files are taken in byte order of their names; a duplicated tensor name
    resolves to the entry of the alphabetically first file.  Each file stays
    open (``O_RDONLY``) until :meth:`close`.  With a ``model.safetensors.index.json``
    only the shards it names are read, and they must hold what it says (see the
    module docstring); :attr:`skipped` lists the paths of the files left out.
    """

    def __init__(self, directory):
        directory = os.fspath(directory)
        self.directory = directory
        self._fds: List[int] = []
        self._index: Dict[str, TensorInfo] = {}
        self._per_file: List[Dict[str, TensorInfo]] = []
        self._shadowed: List[TensorInfo] = []
        self._maps: Dict[int, np.ndarray] = {}
        if not os.path.isdir(directory):
            raise ContainerError(f"{directory}: no such directory")
        try:
            entries = os.listdir(directory)
        except OSError as e:
            raise ContainerError(f"{directory}: cannot list directory: {e.strerror}") from e
        names = sorted(
            (n for n in entries
             if n.endswith(".safetensors") and os.path.isfile(os.path.join(directory, n))),
            key=os.fsencode,
        )
        wmap = read_index(directory)
        skipped: List[str] = []
        if wmap is not None:
            names, skipped = _indexed_files(directory, names, wmap)
        if not names:
            raise ContainerError(f"{directory}: no .safetensors file in the directory")
        self.paths: List[str] = [os.path.join(directory, n) for n in names]
        #: .safetensors files of the folder that its index does not name (not read)
        self.skipped: List[str] = [os.path.join(directory, n) for n in skipped]
        try:
            for i, path in enumerate(self.paths):
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise ContainerError(f"{path}: cannot open: {e.strerror}") from e
                self._fds.append(fd)
                tensors, _, _ = scan_file(path, i, fd)
                self._per_file.append(tensors)
                for name, info in tensors.items():
                    if name in self._index:
                        self._shadowed.append(info)  # first file wins
                    else:
                        self._index[name] = info
            if wmap is not None:
                _check_index_tensors(directory, wmap, self.paths, self._per_file)
        except BaseException:
            self.close()
            raise

    # -- lookup -----------------------------------------------------------
    def __contains__(self, name) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self._index)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._index[name]
        except KeyError:
            raise MissingTensorError(f"missing tensor {name} in {self.directory}") from None

    def get(self, name: str) -> Optional[TensorInfo]:
        return self._index.get(name)

    def names(self) -> List[str]:
        """All (winning) tensor names, sorted."""
        return sorted(self._index)

    def tensors_in_file(self, file_index: int) -> List[TensorInfo]:
        """Tensors whose winning entry lives in file ``file_index``, in file-offset order."""
        if not 0 <= file_index < len(self.paths):
            raise ContainerError(f"{self.directory}: no file with index {file_index}")
        out = [t for n, t in self._per_file[file_index].items() if self._index[n] is t]
        out.sort(key=lambda t: (t.offset, t.name))
        return out

    def shadowed(self) -> List[TensorInfo]:
        """Entries hidden by a same-named tensor in an alphabetically earlier file."""
        return list(self._shadowed)

    def fileno(self, file_index: int) -> int:
        if not 0 <= file_index < len(self._fds):
            raise ContainerError(f"{self.directory}: no open file with index {file_index}")
        return self._fds[file_index]

    def map(self, file_index: int) -> np.ndarray:
        """The whole file ``file_index`` as a read-only uint8 array over a shared mapping (made
        once; it lives as long as an array or view of it does): its bytes are those of the OS page
        cache, faulted in on first touch. ``ContainerError`` when the file cannot be mapped."""
        arr = self._maps.get(file_index)
        if arr is not None:
            return arr
        import mmap
        fd = self.fileno(file_index)
        path = self.paths[file_index]
        try:
            mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError) as e:
            raise ContainerError(f"{path}: cannot map the file ({getattr(e, 'strerror', None) or e})") from e
        arr = self._maps[file_index] = np.frombuffer(mm, dtype=np.uint8)
        return arr

    def mapped_size(self, file_index: int) -> int:
        """Bytes of file ``file_index`` mapped by :meth:`map` (0 when it is not mapped)."""
        arr = self._maps.get(file_index)
        return 0 if arr is None else int(arr.shape[0])

    # -- reading ----------------------------------------------------------
    def read_raw(self, name: str, take=aligned_empty) -> np.ndarray:
        """The tensor's bytes as a new uint8 array of exactly ``nbytes``, from ``take(nbytes)``
        (a BUFFER_ALIGN-aligned allocation of its own unless the caller has an arena)."""
        info = self.info(name)
        out = take(info.nbytes)
        _pread_into(self.fileno(info.file_index), out, info.offset, f"{info.path}: tensor {name!r}")
        return out

    def read_raw_range(self, name: str, start: int, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes of the tensor's data starting ``start`` bytes into it."""
        info = self.info(name)
        if start < 0 or nbytes < 0 or start + nbytes > info.nbytes:
            raise ContainerError(
                f"{info.path}: tensor {name!r}: byte range [{start}, {start + nbytes}) "
                f"outside its {info.nbytes} bytes"
            )
        out = np.empty(nbytes, dtype=np.uint8)
        _pread_into(self.fileno(info.file_index), out, info.offset + start,
                    f"{info.path}: tensor {name!r}")
        return out

    def read_f32(self, name: str) -> np.ndarray:
        """The tensor converted to float32, with its shape.

        BF16, F16, F32, F64, F8_E4M3 (e4m3fn) and F8_E5M2 are converted; U8/I8
        (packed quantized payloads) and other integer dtypes raise
        :class:`ContainerError`.
        """
        info = self.info(name)
        what = f"{info.path}: tensor {name!r}"
        if info.dtype not in FLOAT_DTYPES:
            raise ContainerError(f"{what}: dtype {info.dtype} cannot be read as float32")
        raw = self.read_raw(name)
        return decode_f32(raw, info.dtype, what).reshape(info.shape)

    # -- lifetime ---------------------------------------------------------
    def close(self) -> None:
        self._maps = {}                 # each mapping goes when its last view does
        fds, self._fds = self._fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> "SafeTensorsDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"SafeTensorsDir({self.directory!r}, files={len(self.paths)}, tensors={len(self._index)})"
