#!/usr/bin/env python3
"""A disk-bound twin of a model: every routed and shared expert zero-padded to a wider
intermediate dimension, the same function at many times the bytes per expert.

gate_proj / up_proj [I, D] get zero rows up to [W, D] and down_proj [D, I] zero columns up to
[D, W] (W = ``--width``; a shared expert of n_shared experts' width: n_shared * I -> n_shared * W).
A padded unit has gate = up = 0, so silu(0) * 0 = 0 enters down_proj, whose padded columns are zero
anyway: the FFN's output is unchanged, and so are the tokens (tests/test_fat_twin.py), while a
token reads W / I times the expert bytes - experts like GLM-5's, streamed from an SSD, on a model
small enough to test with. The MTP layer's experts are padded too; every other tensor and file is
copied as it is (``config.json`` gets the new ``moe_intermediate_size``).

Works on colibri containers (int8 / int4 payloads with per-row or group scales; padded rows get
scale 0 and zero weights, padded groups scale 0) and on F32 / F16 checkpoints (a BF16 one: convert
it first).

Usage::

    python tools/make_fat_twin.py SRC DST --width 4096
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from colibri.convert import save_file_atomic  # noqa: E402
from colibri.st import ContainerError, SafeTensorsDir  # noqa: E402

# model.layers.L.mlp.experts.E.gate_proj.weight / ...shared_experts.down_proj.weight (+ ".qs")
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.(experts\.\d+|shared_experts)\.(gate|up|down)_proj\.weight$")
_NUMPY = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "I8": np.int8, "I32": np.int32,
          "I64": np.int64, "F64": np.float64}     # what safetensors.numpy writes (no BF16)
_FLOATS = ("F32", "F16")
_SKIP_FILES = {"colibri_convert.json", ".colibri_usage", "model.safetensors.index.json"}


class TwinError(ValueError):
    """A source the twin cannot be made of (named in the message)."""


def _int4_zero_row(n: int) -> np.ndarray:
    """The packed int4 row of n zeros: each stored nibble v + 8 = 8, an odd row's pad nibble 0."""
    row = np.full((n + 1) // 2, 0x88, np.uint8)
    if n % 2:
        row[-1] = 0x08
    return row


def _payload_format(name: str, nbytes: int, O: int, I: int) -> str:
    if nbytes == O * I:
        return "int8"
    if nbytes == O * ((I + 1) // 2):
        return "int4"
    raise TwinError(f"{name}: payload of {nbytes} bytes is neither int8 nor int4 for [{O}, {I}] "
                    "(int2 experts are not supported)")


def _typed(name, info, raw):
    """The tensor's bytes as the numpy array safetensors writes back with its dtype and shape."""
    if info.dtype not in _NUMPY:
        raise TwinError(f"{info.path}: {name} is {info.dtype}, which the twin cannot write "
                        "(convert the checkpoint to a container first)")
    return raw.view(_NUMPY[info.dtype]).reshape(info.shape)


def _pad_rows(raw, fmt, O, I, O2):
    """[O, I] -> [O2, I] with zero rows (raw: the payload bytes)."""
    zero = np.zeros(I, np.uint8) if fmt == "int8" else _int4_zero_row(I)
    return np.concatenate([raw, np.tile(zero, O2 - O)])


def _pad_cols(name, raw, fmt, O, I, I2):
    """[O, I] -> [O, I2] with zero columns."""
    if fmt == "int8":
        rows = raw.reshape(O, I)
        return np.concatenate([rows, np.zeros((O, I2 - I), np.uint8)], axis=1).reshape(-1)
    if I % 2:
        raise TwinError(f"{name}: an int4 row of odd width {I} cannot be widened byte by byte")
    rows = raw.reshape(O, I // 2)
    return np.concatenate([rows, np.tile(_int4_zero_row(I2 - I), (O, 1))], axis=1).reshape(-1)


def _pad_scales(name, sc, O, I, O2, I2, kind):
    """Scales [O] (per row) or O*G group scales, laid out row by row, for the padded matrix."""
    n = sc.shape[0]
    if n % O:
        raise TwinError(f"{name}.qs: {n} scales do not divide into {O} rows")
    G = n // O
    if kind != "down":                          # new rows: scale 0
        return np.concatenate([sc, np.zeros((O2 - O) * G, np.float32)])
    if G == 1:                                  # per-row scales of down: unchanged (zeros add nothing)
        return sc
    if I % G or I2 % (I // G):
        raise TwinError(f"{name}.qs: groups of {I // G if I % G == 0 else '?'} inputs do not tile "
                        f"the widths {I} and {I2}")
    G2 = I2 // (I // G)
    return np.concatenate([sc.reshape(O, G), np.zeros((O, G2 - G), np.float32)], axis=1).reshape(-1)


def _widths(cfg: dict, shared: bool, I0: int, W: int):
    k = max(int(cfg.get("n_shared_experts") or 1), 1) if shared else 1
    return k * I0, k * W


def twin_tensors(st: SafeTensorsDir, cfg: dict, W: int, file_index: int) -> dict:
    """name -> numpy array of one source file, its experts padded to width W."""
    D, I0 = int(cfg["hidden_size"]), int(cfg["moe_intermediate_size"])
    out = {}
    for name in st.names():
        info = st.info(name)
        if info.file_index != file_index:
            continue
        base = name[:-3] if name.endswith(".qs") else name
        m = _EXPERT.match(base)
        if m is None:
            out[name] = _typed(name, info, st.read_raw(name))
            continue
        kind = m.group(2)
        I, I2 = _widths(cfg, m.group(1) == "shared_experts", I0, W)
        O, O2, II, II2 = (I, I2, D, D) if kind != "down" else (D, D, I, I2)
        if name.endswith(".qs"):
            if info.dtype != "F32":
                raise TwinError(f"{info.path}: {name} is {info.dtype}, expected F32 scales")
            sc = _pad_scales(base, st.read_raw(name).view(np.float32), O, II, O2, II2, kind)
            out[name] = sc if len(info.shape) == 1 else sc.reshape(O2, -1)
            continue
        raw = st.read_raw(name)
        if base + ".qs" in st:
            fmt = _payload_format(f"{info.path}: {name}", info.nbytes, O, II)
            out[name] = _pad_rows(raw, fmt, O, II, O2) if kind != "down" else _pad_cols(name, raw, fmt, O, II, II2)
        elif info.dtype in _FLOATS and tuple(info.shape) == (O, II):
            pad = ((0, O2 - O), (0, 0)) if kind != "down" else ((0, 0), (0, II2 - II))
            out[name] = np.pad(_typed(name, info, raw), pad)
        else:
            raise TwinError(f"{info.path}: {name} is {info.dtype} {list(info.shape)}, expected a quantized "
                            f"payload with .qs scales or a float [{O}, {II}] matrix")
    return out


def make_twin(src: str, dst: str, width: int, progress=print) -> dict:
    """Write the twin of src to dst (a new or empty directory); returns its config."""
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    I0 = cfg.get("moe_intermediate_size")
    if not isinstance(I0, int) or I0 <= 0 or not cfg.get("n_routed_experts"):
        raise TwinError(f"{src}/config.json: no routed experts (moe_intermediate_size, n_routed_experts)")
    if width < I0:
        raise TwinError(f"--width {width} is below the experts' moe_intermediate_size {I0}")
    if os.path.exists(dst) and os.listdir(dst):
        raise TwinError(f"{dst}: exists and is not empty")
    st = SafeTensorsDir(src)
    try:
        os.makedirs(dst, exist_ok=True)
        weight_map, total = {}, 0
        for fi, path in enumerate(st.paths):
            tensors = twin_tensors(st, cfg, width, fi)
            base = os.path.basename(path)
            save_file_atomic(tensors, os.path.join(dst, base))
            total += sum(a.nbytes for a in tensors.values())
            weight_map.update({n: base for n in tensors})
            progress(f"[twin] {base}: {len(tensors)} tensors")
    finally:
        st.close()
    for entry in sorted(os.listdir(src)):
        p = os.path.join(src, entry)
        if entry.endswith(".safetensors") or entry in _SKIP_FILES or entry == "config.json" or not os.path.isfile(p):
            continue
        shutil.copy2(p, os.path.join(dst, entry))
    if os.path.exists(os.path.join(src, "model.safetensors.index.json")):
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    cfg = dict(cfg, moe_intermediate_size=width)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python tools/make_fat_twin.py colibri/models/default /tmp/twin "
                                        "--width 4096")
    ap.add_argument("src", help="model directory (colibri container, or an F32 / F16 safetensors checkpoint)")
    ap.add_argument("dst", help="new directory for the twin")
    ap.add_argument("--width", type=int, required=True,
                    help="the twin's moe_intermediate_size (>= the source's)")
    args = ap.parse_args(argv)
    try:
        cfg = make_twin(args.src, args.dst, args.width)
    except (TwinError, ContainerError, OSError) as e:
        print(f"make_fat_twin: error: {e}", file=sys.stderr)
        return 2
    print(f"[twin] {args.dst}: moe_intermediate_size {cfg['moe_intermediate_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
