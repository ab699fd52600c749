"""Weight quantizers, packers and dequantizers (numpy), engine spec sections 3.1 and 2.3.

Scheme: symmetric scales, one per output row (the whole row is the group), or one per group of
``gs`` inputs of each row (group-scaled: colibrì's converter default since mid-2026, gs = 64; the
last group of a row is partial when gs does not divide I). For each group ``w`` (a whole row, or
``gs`` consecutive inputs of one) and ``qmax = 2**(bits-1) - 1``:

* ``amax = max |w|``                      (float32)
* ``s = max(amax / qmax, 1e-8)``          (float32 division, float32 floor; the floor keeps an
  all-zero row or group finite: colibrì's rule "group amax / 7" with our existing 1e-8 floor)
* ``v = clip(rint(w / s), -qmax-1, qmax)`` (float32 division, round-half-even)
* dequantized value = ``v * s``.

Scales in the container: ``NAME.qs`` F32 with O values (per row) or O·ceil(I/gs) values, row
after row (shape [O, G] or flat [O·G]); the group size is inferred from the count
(:func:`scale_group_size`, the one validator of scale counts).

Containers (the payload written for a matrix, row-major, rows back to back):

* int8: one signed byte per value (its two's-complement bit pattern);
* int4: ceil(I/2) bytes per row; byte j holds element 2j in the low nibble and
  element 2j+1 in the high nibble, each stored as v+8; an odd row ends with a
  pad nibble written as 0 (as colibri's converter does);
* int2: ceil(I/4) bytes per row; element 4j+k sits in bits 2k..2k+1 stored as
  v+2; missing tail elements are 0 bits.

Bits -> container: >= 16 keep float32, 5..8 int8, 3..4 int4, 2 int2.
The engine infers the container of a payload from its size only
(:func:`infer_format`), so :func:`quantize` never emits a payload whose size
would be read as a different container (possible only for rows of <= 2 values).

Everything here is bit-exact with the reference C quantizer and converter.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from .st import ContainerError

__all__ = [
    "SCALE_FLOOR",
    "qmax_for_bits",
    "container_format",
    "payload_nbytes",
    "infer_format",
    "storage_format",
    "GROUP_BASE",
    "n_groups",
    "check_group_size",
    "scale_group_size",
    "row_scales",
    "group_scales",
    "quantize_with_scales",
    "quantize_rows",
    "quantize_groups",
    "pack_int8",
    "pack_int4",
    "pack_int2",
    "pack",
    "unpack_int8",
    "unpack_int4",
    "unpack_int2",
    "unpack",
    "quantize",
    "dequantize",
]

#: Lower bound of a row scale (keeps all-zero rows finite).
SCALE_FLOOR = np.float32(1e-8)

_FORMATS = ("int8", "int4", "int2")

#: Group sizes are GROUP_BASE · 2^k (64, 128, 256, ...): the engine's activation blocks are
#: multiples of 64 too, and distinct such sizes give distinct group counts for one row length
#: (unless the row is a single group, which is per-row anyway), so a count names its size.
GROUP_BASE = 64

#: Containers whose kernels apply per-group scales (int2 has only per-row kernels).
_GROUPED_FORMATS = ("int8", "int4")


def qmax_for_bits(bits: int) -> int:
    """Largest positive quantized value for ``bits`` (8 -> 127, 4 -> 7, 3 -> 3, 2 -> 1)."""
    bits = int(bits)
    if not 2 <= bits <= 8:
        raise ValueError(f"quantization bits must be 2..8, got {bits}")
    return (1 << (bits - 1)) - 1


def container_format(bits: int) -> str:
    """'f32' (bits >= 16), 'int8' (5..8), 'int4' (3..4) or 'int2' (2)."""
    bits = int(bits)
    if bits >= 16:
        return "f32"
    if 5 <= bits <= 8:
        return "int8"
    if 3 <= bits <= 4:
        return "int4"
    if bits == 2:
        return "int2"
    raise ValueError(f"unsupported bit width {bits} (use 2..8, or >= 16 to keep float32)")


def payload_nbytes(fmt: str, O: int, I: int) -> int:
    """Size in bytes of a packed [O, I] payload in container ``fmt``."""
    if fmt == "int8":
        return O * I
    if fmt == "int4":
        return O * ((I + 1) // 2)
    if fmt == "int2":
        return O * ((I + 3) // 4)
    raise ValueError(f"unknown container format {fmt!r}")


def infer_format(nbytes: int, O: int, I: int, name: str = "tensor") -> str:
    """Container of a payload from its size, checked in the order int8, int4, int2.

    Any other size raises :class:`ContainerError` naming the tensor.
    """
    for fmt in _FORMATS:
        if nbytes == payload_nbytes(fmt, O, I):
            return fmt
    raise ContainerError(
        f"{name}: payload of {nbytes} bytes matches no container for [{O}, {I}] "
        f"(int8 {O * I}, int4 {payload_nbytes('int4', O, I)}, int2 {payload_nbytes('int2', O, I)})"
    )


def storage_format(bits: int, O: int, I: int) -> str:
    """Container actually written for ``bits``: the nominal one unless its payload
    size would be inferred as a wider container (rows of 1-2 values), in which
    case the wider container is used (the values fit it unchanged)."""
    fmt = container_format(bits)
    if fmt == "f32":
        return fmt
    return infer_format(payload_nbytes(fmt, O, I), O, I)


def _is_group_size(gs: int) -> bool:
    return gs >= GROUP_BASE and gs % GROUP_BASE == 0 and ((gs // GROUP_BASE) & (gs // GROUP_BASE - 1)) == 0


def check_group_size(gs, what: str = "group size") -> int:
    """``gs`` as an int if it is 0 (per row) or 64·2^k, else ValueError naming ``what``."""
    try:
        g = int(gs)
    except (TypeError, ValueError):
        g = -1
    if g != gs or not (g == 0 or _is_group_size(g)):
        raise ValueError(f"{what} {gs!r}: use 0 (one scale per row) or 64, 128, 256, ... (64 times a power of 2)")
    return g


def n_groups(I: int, gs: int) -> int:
    """Scales per row of length I: ceil(I / gs), or 1 for gs = 0 (per row)."""
    return 1 if gs == 0 else -(-int(I) // int(gs))


def scale_group_size(shape, fmt: str, O: int, I: int, name: str = "tensor") -> int:
    """The group size of the scales ``NAME.qs`` of an [O, I] payload in container ``fmt``.

    ``shape`` is the scales' shape (or their count, an int): O values (or [O, 1]) mean one scale
    per row (returns 0); O·ceil(I/gs) values, flat or [O, G], mean groups of gs = 64·2^k inputs
    (returns gs). A row of at most gs inputs is one group, so its O scales read as per-row. Any
    other count or shape, or groups on a container without grouped kernels (int2), raises
    :class:`ContainerError` naming the tensor. This is the one check of scale counts (engine
    loading, load-time expert checks and ``plan`` call it).
    """
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
    count = 1
    for d in shape:
        count *= d
    where = f"{name}.qs"
    if len(shape) > 2 or (len(shape) == 2 and shape[0] != O):
        raise ContainerError(f"{where}: scales of shape {list(shape)} for {O} rows "
                             f"(expected [{O}] per row, or [{O}, G] / [{O}·G] for groups)")
    if count == O:
        return 0
    if O > 0 and count % O == 0 and count > O:
        G = count // O
        gs = GROUP_BASE
        while n_groups(I, gs) > G:
            gs *= 2
        if n_groups(I, gs) == G:
            if fmt not in _GROUPED_FORMATS:
                raise ContainerError(f"{where}: {G} scales per row (groups of {gs}) on an {fmt} payload; "
                                     "group scales are supported for int4 and int8 only")
            return gs
    raise ContainerError(f"{where}: {count} scales for {O} rows (expected {O} per-row scales, or "
                         f"{O}·ceil({I}/gs) for groups of gs = 64, 128, 256, ... inputs)")


def _as_rows(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {w.shape}")
    if w.dtype != np.float32:
        w = w.astype(np.float32)
    return w


def row_scales(w: np.ndarray, bits: int) -> np.ndarray:
    """Per-row scales ``max(amax / qmax, 1e-8)`` in float32, shape [O]."""
    w = _as_rows(w)
    qmax = qmax_for_bits(bits)
    O, I = w.shape
    if I == 0:
        raise ValueError("cannot quantize rows of length 0")
    amax = np.max(np.abs(w), axis=1) if O else np.zeros(0, np.float32)
    if not np.all(np.isfinite(amax)):
        raise ValueError("cannot quantize a matrix containing NaN or Inf")
    s = amax / np.float32(qmax)
    return np.maximum(s, SCALE_FLOOR).astype(np.float32, copy=False)


def _group_pad(w: np.ndarray, gs: int) -> np.ndarray:
    """w [O, I] as [O, G, gs], the last group padded with zeros (which change no amax)."""
    O, I = w.shape
    G = n_groups(I, gs)
    if G * gs != I:
        w = np.concatenate([w, np.zeros((O, G * gs - I), np.float32)], axis=1)
    return w.reshape(O, G, gs)


def group_scales(w: np.ndarray, bits: int, gs: int) -> np.ndarray:
    """Scales ``max(amax / qmax, 1e-8)`` of each group of gs inputs, float32 [O, ceil(I/gs)]
    (gs = 0: the per-row scales as [O, 1])."""
    w = _as_rows(w)
    gs = check_group_size(gs)
    if gs == 0:
        return row_scales(w, bits).reshape(-1, 1)
    O, I = w.shape
    if I == 0:
        raise ValueError("cannot quantize rows of length 0")
    amax = np.max(np.abs(_group_pad(w, gs)), axis=2) if O else np.zeros((0, n_groups(I, gs)), np.float32)
    if not np.all(np.isfinite(amax)):
        raise ValueError("cannot quantize a matrix containing NaN or Inf")
    s = amax / np.float32(qmax_for_bits(bits))
    return np.maximum(s, SCALE_FLOOR).astype(np.float32, copy=False)


def quantize_with_scales(w: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """``clip(rint(w / s), -qmax-1, qmax)`` as int8 [O, I] with given scales: [O] per row, or
    [O, G] per group (G = ceil(I/gs) for a gs of 64·2^k, inferred from G)."""
    w = _as_rows(w)
    qmax = qmax_for_bits(bits)
    O, I = w.shape
    s = np.asarray(scales, dtype=np.float32)
    if s.ndim == 2 and s.shape[0] == O and s.shape[1] > 1:
        gs = scale_group_size(s.shape, "int8", O, I, "scales")
        per_elem = np.repeat(s, gs, axis=1)[:, :I]          # [O, I]: each input's group scale
    else:
        s = s.reshape(-1)
        if s.shape[0] != O:
            raise ValueError(f"{s.shape[0]} scales for {O} rows")
        per_elem = s[:, None]
    v = np.rint(w / per_elem)
    np.clip(v, -qmax - 1, qmax, out=v)
    return v.astype(np.int8)


def quantize_rows(w: np.ndarray, bits: int) -> Tuple[np.ndarray, np.ndarray]:
    """Quantize a float matrix [O, I]; returns (values int8 [O, I], scales f32 [O])."""
    s = row_scales(w, bits)
    return quantize_with_scales(w, s, bits), s


def quantize_groups(w: np.ndarray, bits: int, gs: int) -> Tuple[np.ndarray, np.ndarray]:
    """Quantize [O, I] with one scale per group of gs inputs of each row; returns (values int8
    [O, I], scales f32 [O, ceil(I/gs)]). gs = 0 is :func:`quantize_rows` (scales [O]). The
    values pack as usual (:func:`pack`): only the scales differ from per-row."""
    gs = check_group_size(gs)
    if gs == 0:
        return quantize_rows(w, bits)
    s = group_scales(w, bits, gs)
    return quantize_with_scales(w, s, bits), s


# ---------------------------------------------------------------------------
# packing


def _int_rows(v: np.ndarray, lo: int, hi: int, fmt: str) -> np.ndarray:
    v = np.asarray(v)
    if v.ndim != 2:
        raise ValueError(f"expected a 2-D array of quantized values, got shape {v.shape}")
    if v.size and (int(v.min()) < lo or int(v.max()) > hi):
        raise ValueError(f"{fmt} values must lie in [{lo}, {hi}]")
    return v


def pack_int8(v: np.ndarray) -> np.ndarray:
    """int8 values [O, I] -> uint8 [O, I] (bit patterns)."""
    v = _int_rows(v, -128, 127, "int8")
    return np.ascontiguousarray(v.astype(np.int8).view(np.uint8))


def pack_int4(v: np.ndarray) -> np.ndarray:
    """Values in [-8, 7], [O, I] -> uint8 [O, ceil(I/2)] (low nibble = even element)."""
    v = _int_rows(v, -8, 7, "int4")
    O, I = v.shape
    u = (v.astype(np.int16) + 8).astype(np.uint8)
    if I % 2:
        u = np.concatenate([u, np.zeros((O, 1), np.uint8)], axis=1)  # pad nibble = 0
    return np.ascontiguousarray(u[:, 0::2] | (u[:, 1::2] << np.uint8(4)))


def pack_int2(v: np.ndarray) -> np.ndarray:
    """Values in [-2, 1], [O, I] -> uint8 [O, ceil(I/4)] (element 4j+k in bits 2k..2k+1)."""
    v = _int_rows(v, -2, 1, "int2")
    O, I = v.shape
    u = (v.astype(np.int16) + 2).astype(np.uint8)
    pad = (-I) % 4
    if pad:
        u = np.concatenate([u, np.zeros((O, pad), np.uint8)], axis=1)  # tail bits = 0
    out = u[:, 0::4] | (u[:, 1::4] << np.uint8(2)) | (u[:, 2::4] << np.uint8(4)) | (u[:, 3::4] << np.uint8(6))
    return np.ascontiguousarray(out)


def pack(v: np.ndarray, fmt: str) -> np.ndarray:
    """Pack int values [O, I] into container ``fmt``; returns uint8 [O, row_bytes]."""
    if fmt == "int8":
        return pack_int8(v)
    if fmt == "int4":
        return pack_int4(v)
    if fmt == "int2":
        return pack_int2(v)
    raise ValueError(f"unknown container format {fmt!r}")


def _payload_rows(payload: np.ndarray, O: int, row_bytes: int, fmt: str) -> np.ndarray:
    p = np.asarray(payload, dtype=np.uint8).reshape(-1)
    if p.size != O * row_bytes:
        raise ValueError(f"{fmt} payload of {p.size} bytes does not hold {O} rows of {row_bytes} bytes")
    return p.reshape(O, row_bytes)


def unpack_int8(payload: np.ndarray, O: int, I: int) -> np.ndarray:
    return _payload_rows(payload, O, I, "int8").view(np.int8).copy()


def unpack_int4(payload: np.ndarray, O: int, I: int) -> np.ndarray:
    p = _payload_rows(payload, O, (I + 1) // 2, "int4")
    out = np.empty((O, 2 * p.shape[1]), dtype=np.int8)
    out[:, 0::2] = (p & np.uint8(0xF)).astype(np.int8) - np.int8(8)
    out[:, 1::2] = (p >> np.uint8(4)).astype(np.int8) - np.int8(8)
    return np.ascontiguousarray(out[:, :I])


def unpack_int2(payload: np.ndarray, O: int, I: int) -> np.ndarray:
    p = _payload_rows(payload, O, (I + 3) // 4, "int2")
    out = np.empty((O, 4 * p.shape[1]), dtype=np.int8)
    for k in range(4):
        out[:, k::4] = ((p >> np.uint8(2 * k)) & np.uint8(3)).astype(np.int8) - np.int8(2)
    return np.ascontiguousarray(out[:, :I])


def unpack(payload: np.ndarray, fmt: str, O: int, I: int) -> np.ndarray:
    if fmt == "int8":
        return unpack_int8(payload, O, I)
    if fmt == "int4":
        return unpack_int4(payload, O, I)
    if fmt == "int2":
        return unpack_int2(payload, O, I)
    raise ValueError(f"unknown container format {fmt!r}")


# ---------------------------------------------------------------------------
# whole-matrix helpers


def quantize(w: np.ndarray, bits: int, group_size: int = 0) -> Tuple[np.ndarray, np.ndarray, str]:
    """Quantize and pack a matrix [O, I] for the container.

    Returns ``(payload uint8 1-D, scales f32, fmt)``: scales [O] per row (group_size 0), or
    [O, ceil(I/gs)] for groups of ``group_size`` inputs (int8 / int4 containers; rows of at most
    one group keep per-row scales [O], which is what their count means). ``bits`` must be 2..8
    (use float32 directly for >= 16).
    """
    w = _as_rows(w)
    O, I = w.shape
    fmt = storage_format(bits, O, I)
    if fmt == "f32":
        raise ValueError(f"bits={bits} keeps float32; nothing to quantize")
    gs = check_group_size(group_size)
    if gs and fmt not in _GROUPED_FORMATS:
        raise ValueError(f"group scales are supported for int4 and int8 only, not {fmt} (bits={bits})")
    if n_groups(I, gs) == 1:
        gs = 0
    v, s = quantize_groups(w, bits, gs)
    return pack(v, fmt).reshape(-1), s, fmt


def dequantize(payload: np.ndarray, scales: np.ndarray, O: int, I: int,
               name: str = "tensor", fmt: Optional[str] = None) -> np.ndarray:
    """float32 [O, I] = v * s, with the container inferred from the payload size and the group
    size from the scale count (:func:`scale_group_size`)."""
    p = np.asarray(payload, dtype=np.uint8).reshape(-1)
    if fmt is None:
        fmt = infer_format(p.size, O, I, name)
    s = np.asarray(scales, dtype=np.float32)
    gs = scale_group_size(s.shape, fmt, O, I, name)
    v = unpack(p, fmt, O, I).astype(np.float32)
    if gs == 0:
        return v * s.reshape(O, 1)
    return v * np.repeat(s.reshape(O, -1), gs, axis=1)[:, :I]
