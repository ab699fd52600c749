"""Tests for colibri.st (safetensors directory reader)."""

import json
import os
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from colibri.st import (
    ContainerError,
    MissingTensorError,
    SafeTensorsDir,
    TensorInfo,
    decode_f32,
    e4m3_table,
    scan_file,
)


# -- helpers -----------------------------------------------------------------

def write_raw(path, entries, header_extra=None):
    """Minimal safetensors writer: entries = [(name, dtype, shape, bytes)]."""
    header, off, blobs = {}, 0, []
    for name, dtype, shape, data in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    if header_extra:
        header.update(header_extra)
    hb = json.dumps(header).encode()
    hb += b" " * ((-len(hb)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))


def write_header_bytes(path, hb, data=b""):
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + data)


def bf16_bytes(x):
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()


# -- reading -----------------------------------------------------------------

def test_read_all_dtypes(tmp_path):
    f32 = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    f16 = np.array([1.5, -2.25, 65504.0, 6.1e-5], np.float16)
    bfv = np.array([1.0, -2.0, 3.140625, 0.0], np.float32)  # exact in bf16
    fp8 = np.array([0x38, 0xB8, 0x7E, 0x01], np.uint8)  # 1, -1, 448, 2^-9
    u8 = np.arange(5, dtype=np.uint8)
    write_raw(tmp_path / "m.safetensors", [
        ("a.f32", "F32", (2, 3), f32.tobytes()),
        ("b.f16", "F16", (4,), f16.tobytes()),
        ("c.bf16", "BF16", (2, 2), bf16_bytes(bfv)),
        ("d.fp8", "F8_E4M3", (4,), fp8.tobytes()),
        ("e.u8", "U8", (5,), u8.tobytes()),
    ])
    with SafeTensorsDir(tmp_path) as d:
        assert d.names() == ["a.f32", "b.f16", "c.bf16", "d.fp8", "e.u8"]
        assert "a.f32" in d and "zz" not in d
        x = d.read_f32("a.f32")
        assert x.dtype == np.float32 and x.shape == (2, 3)
        np.testing.assert_array_equal(x, f32)
        np.testing.assert_array_equal(d.read_f32("b.f16"), f16.astype(np.float32))
        np.testing.assert_array_equal(d.read_f32("c.bf16"), bfv.reshape(2, 2))
        np.testing.assert_array_equal(d.read_f32("d.fp8"), np.array([1, -1, 448, 2.0 ** -9], np.float32))
        raw = d.read_raw("e.u8")
        assert raw.dtype == np.uint8 and raw.tobytes() == u8.tobytes()
        np.testing.assert_array_equal(d.read_raw_range("a.f32", 4, 8).view(np.float32), f32.reshape(-1)[1:3])
        with pytest.raises(ContainerError, match="e.u8.*U8"):
            d.read_f32("e.u8")
        info = d.info("b.f16")
        assert isinstance(info, TensorInfo)
        assert (info.dtype, info.shape, info.nbytes, info.file_index) == ("F16", (4,), 8, 0)
        # absolute offset: reading there by hand gives the same bytes
        with open(info.path, "rb") as f:
            f.seek(info.offset)
            assert f.read(info.nbytes) == f16.tobytes()
        fd = d.fileno(0)
        assert os.pread(fd, info.nbytes, info.offset) == f16.tobytes()
    with pytest.raises(ContainerError):
        d.fileno(0)  # closed


def test_reads_files_written_by_safetensors(tmp_path):
    t = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
         "p": np.arange(7, dtype=np.uint8), "i": np.array([-3, 4], np.int8)}
    save_file(t, str(tmp_path / "x.safetensors"), metadata={"k": "v"})
    with SafeTensorsDir(str(tmp_path)) as d:
        np.testing.assert_array_equal(d.read_f32("w"), t["w"])
        assert d.read_raw("p").tobytes() == t["p"].tobytes()
        assert d.info("i").dtype == "I8"
        with pytest.raises(ContainerError, match="I8"):
            d.read_f32("i")


def test_decode_special_values():
    bf = np.array([0x3F80, 0xC000, 0x7F80, 0xFF80, 0x7FC0, 0x0001], "<u2").view(np.uint8)
    v = decode_f32(bf, "BF16")
    assert v[0] == 1.0 and v[1] == -2.0 and v[2] == np.inf and v[3] == -np.inf and np.isnan(v[4])
    assert v[5] > 0 and v[5] < 1e-38  # subnormal kept
    h = decode_f32(np.array([0x0001, 0x7C00, 0xFC00], "<u2").view(np.uint8), "F16")
    assert h[0] == np.float32(2.0 ** -24) and h[1] == np.inf and h[2] == -np.inf
    with pytest.raises(ContainerError):
        decode_f32(np.zeros(3, np.uint8), "BF16")  # odd byte count
    with pytest.raises(ContainerError):
        decode_f32(np.zeros(4, np.uint8), "U8")


def test_e4m3_table():
    t = e4m3_table()
    assert t.dtype == np.float32 and t.shape == (256,)
    assert t[0x00] == 0 and np.signbit(t[0x80])
    assert t[0x01] == 2.0 ** -9 and t[0x07] == 7 * 2.0 ** -9     # subnormals
    assert t[0x08] == 2.0 ** -6                                   # smallest normal
    assert t[0x38] == 1.0 and t[0x39] == 1.125 and t[0x40] == 2.0
    assert t[0x7E] == 448.0 and t[0xFE] == -448.0                 # largest finite
    assert np.isnan(t[0x7F]) and np.isnan(t[0xFF])                # the only NaNs
    assert np.isfinite(np.delete(t, [0x7F, 0xFF])).all()          # no infinities
    np.testing.assert_array_equal(t[0x80:0xFF], -t[0x00:0x7F])


def test_e4m3_matches_formula():
    """Every e4m3fn code against the format's definition: sign, 4-bit exponent (bias 7), 3-bit
    mantissa, subnormals at exponent 0, NaN only at S.1111.111 (torch's float8_e4m3fn decodes the
    FP8 oracle that test_cli checks end to end)."""
    t = e4m3_table()
    for code in range(256):
        if code & 0x7F == 0x7F:
            assert np.isnan(t[code])
            continue
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> 3) & 0xF, code & 7
        want = sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
        assert t[code] == np.float32(want), code


def test_duplicates_first_file_wins_byte_order(tmp_path):
    one = np.ones(2, np.float32).tobytes()
    two = (2 * np.ones(2, np.float32)).tobytes()
    # 'B' (0x42) sorts before 'a' (0x61) in byte order, as with strcmp
    write_raw(tmp_path / "a.safetensors", [("x", "F32", (2,), two), ("only_a", "F32", (2,), two)])
    write_raw(tmp_path / "B.safetensors", [("x", "F32", (2,), one)])
    (tmp_path / "notes.txt").write_text("ignored")
    (tmp_path / ".out-00000.safetensors.tmp").write_bytes(b"garbage")  # not indexed
    with SafeTensorsDir(tmp_path) as d:
        assert [os.path.basename(p) for p in d.paths] == ["B.safetensors", "a.safetensors"]
        assert d.read_f32("x").tolist() == [1.0, 1.0]
        assert d.info("x").file_index == 0
        assert d.info("only_a").file_index == 1
        assert [t.name for t in d.shadowed()] == ["x"]
        assert [t.name for t in d.tensors_in_file(1)] == ["only_a"]


def test_missing_tensor(tmp_path):
    write_raw(tmp_path / "m.safetensors", [("x", "F32", (1,), b"\0\0\0\0")])
    with SafeTensorsDir(tmp_path) as d:
        with pytest.raises(ContainerError, match=r"missing tensor nope in .*") as ei:
            d.info("nope")
        assert isinstance(ei.value, KeyError) and isinstance(ei.value, MissingTensorError)
        assert str(ei.value) == f"missing tensor nope in {tmp_path}"
        with pytest.raises(KeyError):
            d.read_raw("nope")


# -- validation at open --------------------------------------------------------

def test_missing_directory_and_no_files(tmp_path):
    with pytest.raises(ContainerError, match="no such directory"):
        SafeTensorsDir(tmp_path / "nothere")
    (tmp_path / "x.bin").write_bytes(b"1234")
    with pytest.raises(ContainerError, match="no .safetensors file"):
        SafeTensorsDir(tmp_path)


def _expect_open_error(tmp_path, pattern):
    with pytest.raises(ContainerError, match=pattern) as ei:
        SafeTensorsDir(tmp_path)
    assert "bad.safetensors" in str(ei.value)
    return ei.value


def test_truncated_file_detected_at_open(tmp_path):
    p = tmp_path / "bad.safetensors"
    write_raw(p, [("a", "F32", (4,), np.zeros(4, np.float32).tobytes()),
                  ("b", "F32", (4,), np.zeros(4, np.float32).tobytes())])
    data = p.read_bytes()
    p.write_bytes(data[:-3])
    e = _expect_open_error(tmp_path, "truncated")
    assert "'b'" in str(e)


def test_tiny_file(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\x01\x02")
    _expect_open_error(tmp_path, "too small")


def test_header_length_past_end(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 1000) + b"{}")
    _expect_open_error(tmp_path, "past the end")


def test_header_length_too_large(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 200_000_000) + b"{}")
    _expect_open_error(tmp_path, "limit")


def test_header_garbage(tmp_path):
    write_header_bytes(tmp_path / "bad.safetensors", b"\x00\xffnot json at all")
    _expect_open_error(tmp_path, "not valid JSON")


def test_header_not_object(tmp_path):
    write_header_bytes(tmp_path / "bad.safetensors", b"[1, 2, 3]")
    _expect_open_error(tmp_path, "not a JSON object")


def test_header_duplicate_key(tmp_path):
    hb = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    write_header_bytes(tmp_path / "bad.safetensors", hb, b"\0")
    _expect_open_error(tmp_path, "duplicate")


@pytest.mark.parametrize("entry,pattern", [
    ({"shape": [1], "data_offsets": [0, 4]}, "missing 'dtype'"),
    ({"dtype": "F32", "data_offsets": [0, 4]}, "missing 'shape'"),
    ({"dtype": "F32", "shape": [1]}, "missing 'data_offsets'"),
    ({"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}, "unknown dtype 'Q7'"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "negative"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "needs 8"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, "bad data_offsets"),
    ({"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}, "not a list of integers"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "pair"),
])
def test_bad_entries(tmp_path, entry, pattern):
    hb = json.dumps({"__metadata__": {"a": "b"}, "t.weight": entry}).encode()
    write_header_bytes(tmp_path / "bad.safetensors", hb, b"\0" * 8)
    e = _expect_open_error(tmp_path, pattern)
    assert "t.weight" in str(e)


def test_scan_file_reports_header(tmp_path):
    p = tmp_path / "x.safetensors"
    save_file({"a": np.zeros(3, np.float32), "b": np.zeros(2, np.uint8)}, str(p))
    tensors, hlen, end = scan_file(str(p))
    assert set(tensors) == {"a", "b"} and end == 14
    assert os.path.getsize(p) == 8 + hlen + end


def test_short_read_after_open(tmp_path):
    p = tmp_path / "m.safetensors"
    write_raw(p, [("a", "F32", (1024,), np.ones(1024, np.float32).tobytes())])
    with SafeTensorsDir(tmp_path) as d:
        os.truncate(p, os.path.getsize(p) - 100)
        with pytest.raises(ContainerError, match="short read") as ei:
            d.read_raw("a")
        assert "m.safetensors" in str(ei.value) and "'a'" in str(ei.value)


def test_overlapping_byte_ranges_refused(tmp_path):
    """Two tensors sharing data bytes: refused at open, naming the file and both tensors (the
    safetensors library refuses such a file too)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    p = tmp_path / "bad.safetensors"
    hb = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                     "c": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}}).encode()
    write_header_bytes(p, hb, b"\0" * 12)
    with pytest.raises(SafetensorError):
        load_file(str(p))
    e = _expect_open_error(tmp_path, "overlap")
    assert "'a'" in str(e) and "'b'" in str(e) and "'c'" not in str(e)
    with pytest.raises(ContainerError, match=r"'a'.*'b'.*overlap"):
        scan_file(str(p))
    # one tensor nested inside another, with a third in between in header order
    hb = json.dumps({"big": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]},
                     "tail": {"dtype": "U8", "shape": [4], "data_offsets": [16, 20]},
                     "inner": {"dtype": "U8", "shape": [2], "data_offsets": [6, 8]}}).encode()
    write_header_bytes(p, hb, b"\0" * 20)
    e = _expect_open_error(tmp_path, "overlap")
    assert "'big'" in str(e) and "'inner'" in str(e)


def test_adjacent_and_empty_ranges_accepted(tmp_path):
    write_raw(tmp_path / "m.safetensors", [("a", "F32", (2,), b"\0" * 8), ("e", "F32", (0,), b""),
                                           ("b", "U8", (3,), b"\1\2\3")])
    with SafeTensorsDir(tmp_path) as d:
        assert d.names() == ["a", "b", "e"] and d.read_raw("b").tolist() == [1, 2, 3]


# -- the shard index of an HF checkpoint -------------------------------------------

def _sharded(tmp_path, extra_index=None):
    """Two shards and their model.safetensors.index.json."""
    write_raw(tmp_path / "model-00001-of-00002.safetensors", [("x", "F32", (1,), b"\0" * 4),
                                                              ("y", "F32", (1,), b"\0" * 4)])
    write_raw(tmp_path / "model-00002-of-00002.safetensors", [("z", "F32", (1,), b"\0" * 4)])
    wmap = {"x": "model-00001-of-00002.safetensors", "y": "model-00001-of-00002.safetensors",
            "z": "model-00002-of-00002.safetensors"}
    wmap.update(extra_index or {})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 12}, "weight_map": wmap}))
    return tmp_path


def test_index_naming_a_missing_shard(tmp_path):
    _sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ContainerError, match=r"model\.safetensors\.index\.json: names shard "
                                             r"model-00002-of-00002\.safetensors \(tensor 'z'\).*missing"):
        SafeTensorsDir(tmp_path)


def test_index_naming_an_absent_tensor(tmp_path):
    _sharded(tmp_path, {"w": "model-00002-of-00002.safetensors"})
    with pytest.raises(ContainerError, match=r"index\.json: names tensor 'w' in shard "
                                             r"model-00002-of-00002\.safetensors.*does not hold it"):
        SafeTensorsDir(tmp_path)


def test_index_skips_files_it_does_not_name(tmp_path):
    _sharded(tmp_path)
    write_raw(tmp_path / "adapter.safetensors", [("x", "F32", (1,), b"\1" * 4),
                                                 ("lora", "F32", (1,), b"\0" * 4)])
    with SafeTensorsDir(tmp_path) as d:
        assert [os.path.basename(p) for p in d.paths] == ["model-00001-of-00002.safetensors",
                                                          "model-00002-of-00002.safetensors"]
        assert d.skipped == [str(tmp_path / "adapter.safetensors")]
        assert d.names() == ["x", "y", "z"] and d.shadowed() == []


@pytest.mark.parametrize("text,pattern", [
    ("{not json", "not valid JSON"),
    ('{"metadata": {}}', "weight_map"),
    ('{"weight_map": {"x": "../elsewhere.safetensors"}}', "'x'.*not the name of a .safetensors file"),
])
def test_bad_index_file(tmp_path, text, pattern):
    _sharded(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ContainerError, match=r"model\.safetensors\.index\.json: .*" + pattern):
        SafeTensorsDir(tmp_path)


def test_without_index_every_file_is_read(tmp_path):
    """colibri's and colibrì's containers have no index: every .safetensors file counts."""
    for i, n in enumerate(["out-00000.safetensors", "out-mtp-00000.safetensors", "out-idx-00000.safetensors",
                           "anything.safetensors"]):
        write_raw(tmp_path / n, [(f"t{i}", "F32", (1,), b"\0" * 4)])
    with SafeTensorsDir(tmp_path) as d:
        assert len(d.paths) == 4 and d.names() == ["t0", "t1", "t2", "t3"] and d.skipped == []
