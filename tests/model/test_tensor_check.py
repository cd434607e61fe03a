"""--check-tensors: layouts checked against gguf's, NaN/Inf values and scales found at their offsets."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from skippy_zmq.errors import CorruptTensorError, ModelLoadError
from skippy_zmq.model import tensor_check
from skippy_zmq.model.gguf_file import read_header
from skippy_zmq.model.tensor_check import LAYOUTS, check_stage_tensors, scan, stage_tensor_names
from skippy_zmq.testing.tiny import write_tiny_model

F16_NAN, F16_INF, F16_HALF = 0x7E00, 0x7C00, 0x3800
ROWS = 8  # blocks of 256 values per row: every type's block fits a whole number of times


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]) -> Path:
    """A GGUF holding `tensors` (raw block bytes, or float values for plain types) and no model."""
    writer = gguf.GGUFWriter(path, "llama")
    for name, (values, qtype) in tensors.items():
        writer.add_tensor(name, values, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _blocks(qtype: GGMLQuantizationType, seed: int = 0) -> npt.NDArray[np.uint8]:
    """(ROWS, bytes of 256 values) random blocks whose every scale is 0.5."""
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    per_row = 256 // block_elems
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(ROWS * per_row, block_bytes), dtype=np.uint8)
    for scale in LAYOUTS[qtype.value].scales:
        blocks[:, scale.offset:scale.offset + 2] = np.frombuffer(np.uint16(F16_HALF).tobytes(), np.uint8)
    return blocks.reshape(ROWS, per_row * block_bytes)


def _scan_all(path: Path) -> list[str]:
    header = read_header(path)
    data = np.fromfile(path, dtype=np.uint8)
    return [bad.describe() for bad in scan(header, data, list(header.tensors)).bad]


def test_layouts_are_gguf_block_sizes_and_cover_every_type() -> None:
    assert {t.value for t in GGMLQuantizationType} <= set(LAYOUTS)
    for qtype in GGMLQuantizationType:
        layout = LAYOUTS[qtype.value]
        assert (layout.type_name, layout.block_elems, layout.block_bytes) == (qtype.name, *GGML_QUANT_SIZES[qtype])
        assert all(s.offset + s.width <= layout.block_bytes for s in layout.scales)


SCALED = [t for t in GGMLQuantizationType if LAYOUTS[t.value].scales and t.name != "Q8_K"]  # gguf can't dequantize Q8_K


@pytest.mark.parametrize("qtype", SCALED, ids=lambda t: t.name)
def test_each_scale_field_is_one_gguf_dequantizes_with(tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    """A NaN written where the layout says a scale is makes exactly that block non-finite when
    gguf dequantizes it, and the scan names that block and byte; finite scales pass."""
    clean = _blocks(qtype)
    assert np.isfinite(gguf.quants.dequantize(clean, qtype)).all()
    path = _write(tmp_path / "clean.gguf", {"w": (clean, qtype)})
    assert _scan_all(path) == []
    layout = LAYOUTS[qtype.value]
    block_bytes = layout.block_bytes
    for scale in layout.scales:
        damaged = clean.copy().reshape(-1, block_bytes)
        damaged[5, scale.offset:scale.offset + 2] = np.frombuffer(np.uint16(F16_NAN).tobytes(), np.uint8)
        damaged[7, scale.offset:scale.offset + 2] = np.frombuffer(np.uint16(F16_INF).tobytes(), np.uint8)
        with np.errstate(invalid="ignore", over="ignore"):  # the NaN and Inf are the point
            values = gguf.quants.dequantize(damaged.reshape(clean.shape), qtype).reshape(-1, layout.block_elems)
        assert sorted(set(np.flatnonzero(~np.isfinite(values).all(axis=1)))) == [5, 7]
        path = _write(tmp_path / f"{scale.name}.gguf", {"w": (damaged.reshape(clean.shape), qtype)})
        offset = read_header(path).tensor("w").data_offset + 5 * block_bytes + scale.offset
        assert _scan_all(path) == [
            f"tensor w ({qtype.name}): block 5 scale {scale.name} is nan at byte offset {offset} "
            "(and 1 more in this tensor)"]


def test_the_lowest_offset_is_named_whichever_scale_holds_it(tmp_path: Path) -> None:
    q4_k = GGMLQuantizationType.Q4_K
    blocks = _blocks(q4_k).reshape(-1, 144)
    blocks[5, 0:2] = np.frombuffer(np.uint16(F16_NAN).tobytes(), np.uint8)  # d of block 5
    blocks[2, 2:4] = np.frombuffer(np.uint16(F16_INF).tobytes(), np.uint8)  # dmin of block 2
    path = _write(tmp_path / "k.gguf", {"w": (blocks.reshape(ROWS, -1), q4_k)})
    offset = read_header(path).tensor("w").data_offset + 2 * 144 + 2
    assert _scan_all(path) == [f"tensor w (Q4_K): block 2 scale dmin is inf at byte offset {offset} "
                               "(and 1 more in this tensor)"]


@pytest.mark.parametrize(("qtype", "dtype"), [(GGMLQuantizationType.F32, np.float32),
                                              (GGMLQuantizationType.F16, np.float16)])
def test_float_tensors_are_checked_value_by_value(tmp_path: Path, qtype: GGMLQuantizationType,
                                                  dtype: type[np.floating]) -> None:
    values = np.linspace(-1, 1, 2 * 64).astype(dtype).reshape(2, 64)
    values[1, 3] = np.inf
    values[1, 60] = np.nan
    path = _write(tmp_path / "f.gguf", {"ok": (np.ones((4, 8), dtype=dtype), qtype), "w": (values, qtype)})
    offset = read_header(path).tensor("w").data_offset + 67 * np.dtype(dtype).itemsize
    assert _scan_all(path) == [f"tensor w ({qtype.name}): element 67 is inf at byte offset {offset} "
                               "(and 1 more in this tensor)"]


def test_bf16_values_are_checked_with_their_own_exponent(tmp_path: Path) -> None:
    finite = np.array([[0x7F7F, 0xFF7F, 0x3F80, 0x7C00]], dtype=np.uint16)  # 0x7C00 is a BF16 number
    bad = np.array([[0x3F80, 0x7F80, 0xFFC1, 0x0000]], dtype=np.uint16)  # +inf, a NaN
    bf16 = GGMLQuantizationType.BF16
    path = _write(tmp_path / "b.gguf", {"a": (finite.view(np.uint8), bf16), "b": (bad.view(np.uint8), bf16)})
    offset = read_header(path).tensor("b").data_offset + 2
    assert _scan_all(path) == [f"tensor b (BF16): element 1 is inf at byte offset {offset} (and 1 more in this tensor)"]


def test_integer_tensors_are_reported_unchecked(tmp_path: Path) -> None:
    path = _write(tmp_path / "i.gguf", {"n": (np.arange(8, dtype=np.int32), GGMLQuantizationType.I32)})
    header = read_header(path)
    report = scan(header, np.fromfile(path, dtype=np.uint8), ["n"])
    assert (report.tensors, report.unchecked, report.bad, report.scanned_bytes) == (1, ("n",), (), 0)
    assert "1 of a type with no scale to check" in report.summary()


def test_a_stage_reads_its_blocks_the_embedding_and_the_head(tiny_llama_path: Path, tiny_gemma3_path: Path) -> None:
    llama, gemma = read_header(tiny_llama_path), read_header(tiny_gemma3_path)
    first = stage_tensor_names(llama, 0, 2, 4)
    assert first[0] == "token_embd.weight" and {n.split(".")[1] for n in first[1:]} == {"0", "1"}
    last = stage_tensor_names(llama, 2, 4, 4)
    assert "token_embd.weight" not in last and {"output.weight", "output_norm.weight"} <= set(last)
    assert {n.split(".")[1] for n in last if n.startswith("blk.")} == {"2", "3"}
    tied = stage_tensor_names(gemma, 3, 7, 7)  # the head is the embedding table
    assert "token_embd.weight" in tied and "blk.2.attn_q.weight" not in tied
    middle = stage_tensor_names(gemma, 2, 3, 7)
    assert all(n.startswith("blk.2.") for n in middle)
    whole = stage_tensor_names(gemma, 0, 7, 7)
    assert whole == list(gemma.tensors)


def _damage(source: Path, target: Path, tensor: str, at: int, patch: bytes) -> int:
    """A copy of `source` with `patch` written `at` bytes into `tensor`'s data; the file offset."""
    shutil.copyfile(source, target)
    offset = read_header(target).tensor(tensor).data_offset + at
    with open(target, "r+b") as handle:
        handle.seek(offset)
        handle.write(patch)
    return offset


def test_a_damaged_scale_is_refused_by_the_stage_that_holds_it(tiny_llama_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "damaged.gguf"
    offset = _damage(tiny_llama_path, path, "blk.1.attn_q.weight", 3 * 34, np.uint16(F16_INF).tobytes())
    report = check_stage_tensors(path, 2, 4, 4)  # layers 2-3 and the head: untouched
    assert report.bad == () and report.tensors == len(stage_tensor_names(read_header(path), 2, 4, 4))
    assert report.summary().endswith(": every value and scale finite")
    with pytest.raises(CorruptTensorError) as caught:
        check_stage_tensors(path, 0, 2, 4)
    assert str(caught.value) == (
        f"{path}: tensor blk.1.attn_q.weight (Q8_0): block 3 scale d is inf at byte offset {offset}; expected "
        "finite weights and block scales in layers [0, 2): the file is damaged, fetch or convert it again")
    assert isinstance(caught.value, ModelLoadError)
    assert check_stage_tensors(tiny_llama_path, 0, 4, 4).bad == ()


def test_random_bytes_in_tensor_data_are_found(tiny_llama_path: Path, tmp_path: Path) -> None:
    """The case of issue 16: a run of random bytes in a quantized tensor (and a NaN in a float one)."""
    path = tmp_path / "random.gguf"
    noise = np.random.default_rng(16).integers(0, 256, size=4096, dtype=np.uint8).tobytes()
    _damage(tiny_llama_path, path, "blk.2.ffn_gate.weight", 100, noise)
    shutil.copyfile(path, tmp_path / "twice.gguf")
    _damage(path, tmp_path / "twice.gguf", "output_norm.weight", 40, np.float32(np.nan).tobytes())
    with pytest.raises(CorruptTensorError, match=r"tensor blk\.2\.ffn_gate\.weight \(Q8_0\): block \d+ scale d is"):
        check_stage_tensors(path, 2, 4, 4)
    with pytest.raises(CorruptTensorError, match="; 1 more tensor holds non-finite values;"):
        check_stage_tensors(tmp_path / "twice.gguf", 2, 4, 4)


def test_a_truncated_tensor_is_refused(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "t.gguf", n_layer=2, seed=3)
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 10)
    with pytest.raises(ModelLoadError, match=r"past the end of the file .* the file is truncated"):
        check_stage_tensors(path, 0, 2, 2)


def test_chunks_keep_block_and_element_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensor_check, "_CHUNK_BYTES", 100)  # 5 Q8_0 blocks, or 25 F32 values, a chunk
    q8 = GGMLQuantizationType.Q8_0
    blocks = _blocks(q8).reshape(-1, 34)
    for index in (13, 40):
        blocks[index, 0:2] = np.frombuffer(np.uint16(F16_NAN).tobytes(), np.uint8)
    values = np.ones((4, 32), dtype=np.float32)
    values[2, 7] = -np.inf  # element 71
    path = _write(tmp_path / "c.gguf", {"q": (blocks.reshape(ROWS, -1), q8),
                                        "f": (values, GGMLQuantizationType.F32)})
    header = read_header(path)
    q_at, f_at = header.tensor("q").data_offset + 13 * 34, header.tensor("f").data_offset + 71 * 4
    assert _scan_all(path) == [f"tensor q (Q8_0): block 13 scale d is nan at byte offset {q_at} (and 1 more in this tensor)",
                               f"tensor f (F32): element 71 is -inf at byte offset {f_at}"]


def test_a_type_the_table_does_not_know_is_counted_unchecked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "u.gguf", {"w": (_blocks(GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)})
    monkeypatch.delitem(LAYOUTS, GGMLQuantizationType.Q8_0.value)  # as a type newer than the table
    report = scan(read_header(path), np.fromfile(path, dtype=np.uint8), ["w"])
    assert (report.unchecked, report.bad) == (("w",), ())


def test_a_damaged_expert_is_refused_by_the_stage_that_holds_it(tiny_qwen3moe_path: Path, tmp_path: Path) -> None:
    # Expert 11 of 16 in layer 4's ffn_up_exps (Q4_K blocks of 144 bytes, 256 x 256 per expert: one
    # block a row): the router and the other experts are untouched, the scan names the block.
    path = tmp_path / "damaged.gguf"
    block = 11 * 256 + 7
    offset = _damage(tiny_qwen3moe_path, path, "blk.4.ffn_up_exps.weight", block * 144, np.uint16(F16_INF).tobytes())
    assert check_stage_tensors(path, 0, 4, 6).bad == ()
    with pytest.raises(CorruptTensorError) as caught:
        check_stage_tensors(path, 4, 6, 6)
    assert str(caught.value).startswith(
        f"{path}: tensor blk.4.ffn_up_exps.weight (Q4_K): block {block} scale d is inf at byte offset {offset}; ")
