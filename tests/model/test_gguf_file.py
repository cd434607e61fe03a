"""GGUF header reader: every value type, the tensor-info table, errors by name, one parse per file."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model import gguf_file
from skippy_zmq.model.gguf_file import ArchKey, GGUFHeader, GGUFKey, GGUFValueType, read_header
from skippy_zmq.model.gguf_model import GGUFModel, ModelHParams
from skippy_zmq.testing.tiny import write_tiny_model
from skippy_zmq.tokens.tokenizer import Tokenizer

V = gguf.GGUFValueType
SCALARS: list[tuple[str, object, gguf.GGUFValueType]] = [
    ("t.u8", 255, V.UINT8), ("t.i8", -128, V.INT8), ("t.u16", 65535, V.UINT16), ("t.i16", -32768, V.INT16),
    ("t.u32", 2**32 - 1, V.UINT32), ("t.i32", -(2**31), V.INT32), ("t.u64", 2**64 - 1, V.UINT64),
    ("t.i64", -(2**63), V.INT64), ("t.f32", 0.5, V.FLOAT32), ("t.f64", 1e-300, V.FLOAT64),
    ("t.bool", True, V.BOOL), ("t.str", "h\u00e9llo", V.STRING),
]


def _write(path: Path, *, alignment: int | None = None) -> Path:
    """A GGUF with one key of every scalar type, arrays of several kinds and two tensors."""
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.data_alignment = alignment
        w.add_uint32(GGUFKey.ALIGNMENT, alignment)
    for key, value, vtype in SCALARS:
        w.add_key_value(key, value, vtype)
    w.add_key_value("t.f32s", [1.5, -2.0], V.ARRAY, sub_type=V.FLOAT32)
    w.add_key_value("t.i16s", [-1, 7], V.ARRAY, sub_type=V.INT16)
    w.add_key_value("t.bools", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    w.add_key_value("t.strs", [b"a", b"\xff\xfe", b""], V.ARRAY, sub_type=V.STRING)
    w.add_key_value("t.nested", [[1, 2], [3]], V.ARRAY, sub_type=V.ARRAY)
    w.add_tensor("a.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("b.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_reads_back(tmp_path: Path) -> None:
    header = read_header(_write(tmp_path / "v.gguf"))
    for key, value, _ in SCALARS:
        assert header.metadata[key] == value and type(header.metadata[key]) is type(value), key
    assert header.integer("t.u64") == 2**64 - 1 and header.number("t.f32") == 0.5
    assert header.flag("t.bool") is True and header.string("t.str") == "h\u00e9llo"
    f32s, i16s, bools = header.array("t.f32s"), header.array("t.i16s"), header.array("t.bools")
    assert f32s.dtype == np.float32 and f32s.tolist() == [1.5, -2.0] and not f32s.flags.writeable
    assert i16s.dtype == np.int16 and i16s.tolist() == [-1, 7]
    assert bools.dtype == np.bool_ and bools.tolist() == [True, False, True]
    assert header.strings("t.strs") == (b"a", b"\xff\xfe", b"")  # raw bytes, even invalid UTF-8
    nested = header.metadata["t.nested"]
    assert isinstance(nested, list) and [inner.tolist() for inner in nested] == [[1, 2], [3]]
    assert header.metadata[GGUFKey.ARCHITECTURE] == "llama"
    assert [int(t) for t in GGUFValueType] == list(range(13))


def test_each_keys_stored_type_is_kept_for_a_copy(tmp_path: Path) -> None:
    header = read_header(_write(tmp_path / "v.gguf"))
    for key, _, vtype in SCALARS:
        assert header.value_types[key] == (GGUFValueType(int(vtype)), None), key
    assert header.value_types["t.f32s"] == (GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    assert header.value_types["t.strs"] == (GGUFValueType.ARRAY, GGUFValueType.STRING)
    assert header.value_types["t.nested"] == (GGUFValueType.ARRAY, GGUFValueType.ARRAY)
    assert set(header.value_types) == set(header.metadata)


def test_tensor_infos_and_alignment_match_the_stock_reader(tmp_path: Path) -> None:
    path = _write(tmp_path / "aligned.gguf", alignment=64)
    header, stock = read_header(path), gguf.GGUFReader(path)
    assert header.alignment == stock.alignment == 64 and header.data_start == stock.data_offset
    assert header.data_start % 64 == 0 and header.version == 3
    a = header.tensor("a.weight")
    assert (a.dims, a.shape, a.n_elements) == ((3, 2), (2, 3), 6)
    assert [(t.name, t.dims, t.ggml_type, t.data_offset) for t in header.tensors.values()] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), t.data_offset) for t in stock.tensors]


def test_typed_access_names_the_key(tmp_path: Path) -> None:
    header = read_header(_write(tmp_path / "v.gguf"))
    assert header.integer("t.absent", None) is None and header.number("t.absent", 2.5) == 2.5
    with pytest.raises(ModelLoadError, match=r"metadata key 't\.absent' is missing"):
        header.integer("t.absent")
    with pytest.raises(ModelLoadError, match=r"metadata key 't\.str' is 'h\u00e9llo'; expected an integer"):
        header.integer("t.str")
    with pytest.raises(ModelLoadError, match=r"metadata key 't\.f32s' is an array of 2; expected an array of strings"):
        header.strings("t.f32s")
    with pytest.raises(ModelLoadError, match=r"tensor 'c\.weight' is missing"):
        header.tensor("c.weight")
    assert ArchKey.BLOCK_COUNT.of("gemma3") == "gemma3.block_count"
    assert ArchKey.RMS_EPS.of("llama") == "llama.attention.layer_norm_rms_epsilon"


def _head(version: int = 3, n_tensors: int = 0, n_kv: int = 0, magic: bytes = b"GGUF") -> bytes:
    return struct.pack("<4sIQQ", magic, version, n_tensors, n_kv)


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _tensor_info(name: bytes) -> bytes:
    return _string(name) + struct.pack("<IQIQ", 1, 8, 0, 0)  # 1-D, 8 values, F32, offset 0


@pytest.mark.parametrize(("data", "message"), [
    (b"", "truncated or malformed"),  # mmap refuses an empty file, struct an empty buffer
    (b"GGU", "truncated or malformed"),
    (_head(magic=b"GGML"), r"magic b'GGML' instead of b'GGUF' means this is not a GGUF file"),
    (_head(version=1), "GGUF version 1 is not supported"),
    (struct.pack(">4sIQQ", b"GGUF", 3, 0, 0), r"version 50331648 \(a big-endian file\?\) is not supported"),
    (_head(n_kv=1) + _string(b"k") + struct.pack("<I", 99), "truncated or malformed"),
    (_head(n_kv=1) + _string(b"k") + struct.pack("<I", 8) + struct.pack("<Q", 1000) + b"abc",
     "string of 1000 bytes at offset 37 runs past the end"),
    (_head(n_kv=1) + _string(b"general.alignment") + struct.pack("<II", 4, 48),
     "general.alignment 48 must be a power of two"),
    (_head(n_tensors=2) + _tensor_info(b"x") + _tensor_info(b"x"), "tensor 'x' is listed twice"),
    (_head(n_tensors=1) + _string(b"x"), "truncated or malformed"),
])
def test_bad_headers_are_refused_by_reason(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelLoadError, match=message):
        read_header(path)
    with pytest.raises(ModelLoadError, match=message):
        GGUFHeader.parse(data, "<bytes>")


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"nope\.gguf: cannot read: model file does not exist"):
        read_header(tmp_path / "nope.gguf")


def test_truncated_tensor_data_is_refused_by_name(tmp_path: Path) -> None:
    full = write_tiny_model(tmp_path / "full.gguf", n_layer=1).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[:-100])
    # Refused when opened, before any tensor is asked for: every stage of the file refuses it.
    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.0\.ffn_down\.weight' ends at byte \d+, past the end"):
        GGUFModel(cut)


def test_a_worker_parses_the_header_once(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m.gguf", n_layer=2)
    parses_before = gguf_file._header_of_version.cache_info().misses
    hp = ModelHParams.from_gguf(path)
    model = GGUFModel(str(path))
    tokenizer = Tokenizer.from_gguf(tmp_path / "." / "m.gguf")
    assert gguf_file._header_of_version.cache_info().misses - parses_before == 1
    assert model.hparams is hp and model.header is read_header(path)
    assert tokenizer.n_vocab == hp.n_vocab
    write_tiny_model(path, n_layer=3)  # a new version of the file is parsed again
    assert ModelHParams.from_gguf(path).n_layer == 3
    assert gguf_file._header_of_version.cache_info().misses - parses_before == 2
