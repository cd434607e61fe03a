"""`--check-tensors`: a stage's tensors scanned for NaN/Inf values and impossible block scales.

What is checked, per ggml type (the layouts are gguf-py's and llama.cpp's; see
docs/PROTOCOL.md §7, "Checking tensors"):

- float tensors (F32, F16, BF16, F64): every value must be finite;
- quantized tensors: each block's scales, stored as f16 (f32 for Q8_K) at a fixed byte offset
  in the block, must be finite: Q4_0, Q5_0, Q8_0, IQ4_NL `d` at byte 0; Q4_1, Q5_1 `d` and `m`
  at 0 and 2; Q4_K, Q5_K `d` and `dmin` at 0 and 2; Q2_K `d`, `dmin` at 80 and 82; Q3_K `d`
  at 108; Q6_K `d` at 208; the IQ2/IQ3/IQ4_XS/IQ1_S super-blocks `d` at 0; TQ1_0 at 52,
  TQ2_0 at 64. The quantized values themselves are small integers: any bits are a number.
- integer tensors, types whose scale is not one field (IQ1_M, MXFP4, NVFP4, Q1_0, Q8_1) and
  types this table does not know are counted as not checked.

The scan compares exponent bits (all ones is Inf or NaN) on views of the memory-mapped file,
chunk by chunk: no value is converted and nothing is copied but the scale columns of one chunk.
A bad value is refused naming the tensor, the block or element and its byte offset in the file.
"""

from __future__ import annotations

import mmap
import os
import re
import time
from collections.abc import Iterable

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import CorruptTensorError, ModelLoadError
from skippy_zmq.model.gguf_file import GGUFHeader, TensorInfo, read_header

_CHUNK_BYTES = 16 << 20  # scanned per step: bounds the scan's temporaries


@attrs.frozen
class Scale:
    """One scale field of a quantized block: its name, byte offset and width (2: f16, 4: f32)."""

    name: str
    offset: int
    width: int = 2


@attrs.frozen
class Layout:
    """How a ggml type stores its values: elements and bytes per block, the scales to check."""

    type_name: str
    block_elems: int
    block_bytes: int
    float_width: int = 0  # a plain float type: bytes per value (its exponent is checked)
    scales: tuple[Scale, ...] = ()

    @property
    def checked(self) -> bool:
        """Whether the scan can find anything wrong in this type."""
        return self.float_width > 0 or bool(self.scales)


_D = (Scale("d", 0),)
_D_M = (Scale("d", 0), Scale("m", 2))
_D_DMIN = (Scale("d", 0), Scale("dmin", 2))

# By ggml type id (gguf's GGMLQuantizationType values; tests check the sizes against gguf's).
LAYOUTS: dict[int, Layout] = {
    0: Layout("F32", 1, 4, float_width=4),
    1: Layout("F16", 1, 2, float_width=2),
    2: Layout("Q4_0", 32, 18, scales=_D),
    3: Layout("Q4_1", 32, 20, scales=_D_M),
    6: Layout("Q5_0", 32, 22, scales=_D),
    7: Layout("Q5_1", 32, 24, scales=_D_M),
    8: Layout("Q8_0", 32, 34, scales=_D),
    9: Layout("Q8_1", 32, 40),  # an activation type; never a weight in a file
    10: Layout("Q2_K", 256, 84, scales=(Scale("d", 80), Scale("dmin", 82))),
    11: Layout("Q3_K", 256, 110, scales=(Scale("d", 108),)),
    12: Layout("Q4_K", 256, 144, scales=_D_DMIN),
    13: Layout("Q5_K", 256, 176, scales=_D_DMIN),
    14: Layout("Q6_K", 256, 210, scales=(Scale("d", 208),)),
    15: Layout("Q8_K", 256, 292, scales=(Scale("d", 0, width=4),)),
    16: Layout("IQ2_XXS", 256, 66, scales=_D),
    17: Layout("IQ2_XS", 256, 74, scales=_D),
    18: Layout("IQ3_XXS", 256, 98, scales=_D),
    19: Layout("IQ1_S", 256, 50, scales=_D),
    20: Layout("IQ4_NL", 32, 18, scales=_D),
    21: Layout("IQ3_S", 256, 110, scales=_D),
    22: Layout("IQ2_S", 256, 82, scales=_D),
    23: Layout("IQ4_XS", 256, 136, scales=_D),
    24: Layout("I8", 1, 1),
    25: Layout("I16", 1, 2),
    26: Layout("I32", 1, 4),
    27: Layout("I64", 1, 8),
    28: Layout("F64", 1, 8, float_width=8),
    29: Layout("IQ1_M", 256, 56),  # its f16 scale is spread over the block's scale nibbles
    30: Layout("BF16", 1, 2, float_width=2),
    34: Layout("TQ1_0", 256, 54, scales=(Scale("d", 52),)),
    35: Layout("TQ2_0", 256, 66, scales=(Scale("d", 64),)),
    39: Layout("MXFP4", 32, 17),
    40: Layout("NVFP4", 64, 36),
    41: Layout("Q1_0", 128, 18),
}

# Exponent mask by (byte width, is BF16): a value whose exponent bits are all ones is Inf or NaN.
_EXPONENT: dict[tuple[int, bool], tuple[type[np.unsignedinteger], int]] = {
    (2, False): (np.uint16, 0x7C00),
    (2, True): (np.uint16, 0x7F80),
    (4, False): (np.uint32, 0x7F800000),
    (8, False): (np.uint64, 0x7FF0000000000000),
}
_FLOAT_OF_WIDTH: dict[tuple[int, bool], type[np.floating]] = {
    (2, False): np.float16, (4, False): np.float32, (8, False): np.float64,
}


@attrs.frozen
class BadValue:
    """The first non-finite value or scale of one tensor, and how many it holds."""

    tensor: str
    type_name: str
    where: str  # "element 12" or "block 3 scale d"
    value: float
    file_offset: int
    count: int

    def describe(self) -> str:
        """`tensor blk.0.attn_q.weight (Q8_0): block 3 scale d is nan at byte offset 1234`."""
        more = f" (and {self.count - 1} more in this tensor)" if self.count > 1 else ""
        return (f"tensor {self.tensor} ({self.type_name}): {self.where} is {self.value} "
                f"at byte offset {self.file_offset}{more}")


@attrs.frozen
class ScanReport:
    """What a scan looked at and what it found."""

    tensors: int
    scanned_bytes: int
    unchecked: tuple[str, ...]  # tensors of a type with nothing to check
    bad: tuple[BadValue, ...]
    seconds: float

    def summary(self) -> str:
        """One line for the load log."""
        skipped = f"; {len(self.unchecked)} of a type with no scale to check" if self.unchecked else ""
        found = f"; {len(self.bad)} with non-finite values" if self.bad else ": every value and scale finite"
        return (f"checked {self.tensors} tensors ({self.scanned_bytes / 2**20:.1f} MiB) in "
                f"{self.seconds:.2f}s{skipped}{found}")


_BLOCK = re.compile(r"blk\.(\d+)\.")


def stage_tensor_names(header: GGUFHeader, layer_start: int, layer_end: int, n_layer: int) -> list[str]:
    """The tensors a stage of layers [layer_start, layer_end) reads, in file order: its blocks',
    the embedding table (first stage, or a final stage whose head is tied to it), the output
    norm and head (final stage) and any other tensor outside the blocks (every stage)."""
    first, last = layer_start == 0, layer_end == n_layer
    tied = "output.weight" not in header.tensors
    names = []
    for name in header.tensors:
        block = _BLOCK.match(name)
        if block is not None:
            keep = layer_start <= int(block.group(1)) < layer_end
        elif name.startswith("token_embd."):
            keep = first or (last and tied)
        elif name.startswith("output"):
            keep = last
        else:
            keep = True
        if keep:
            names.append(name)
    return names


def scan(header: GGUFHeader, data: npt.NDArray[np.uint8], names: Iterable[str]) -> ScanReport:
    """Scan the tensors `names` of the file whose bytes are `data` (the whole file, uint8)."""
    started = time.perf_counter()
    count = scanned = 0
    unchecked: list[str] = []
    bad: list[BadValue] = []
    for name in names:
        info = header.tensor(name)
        layout = LAYOUTS.get(info.ggml_type)
        count += 1
        if layout is None or not layout.checked:
            unchecked.append(name)
            continue
        nbytes = _tensor_bytes(header, info, layout)
        found = _scan_tensor(data[info.data_offset:info.data_offset + nbytes], info, layout)
        scanned += nbytes
        if found is not None:
            bad.append(found)
    return ScanReport(tensors=count, scanned_bytes=scanned, unchecked=tuple(unchecked), bad=tuple(bad),
                      seconds=time.perf_counter() - started)


def check_stage_tensors(path: str | os.PathLike[str], layer_start: int, layer_end: int,
                        n_layer: int) -> ScanReport:
    """Scan a stage's tensors; CorruptTensorError naming the first bad one (and how many more)."""
    header = read_header(path)
    data = _map(header)
    report = scan(header, data, stage_tensor_names(header, layer_start, layer_end, n_layer))
    if report.bad:
        others = len(report.bad) - 1
        held = "tensor holds" if others == 1 else "tensors hold"
        more = f"; {others} more {held} non-finite values" if others else ""
        raise CorruptTensorError(
            f"{header.source}: {report.bad[0].describe()}{more}; expected finite weights and block "
            f"scales in layers [{layer_start}, {layer_end}): the file is damaged, fetch or convert it again"
        )
    return report


def _tensor_bytes(header: GGUFHeader, info: TensorInfo, layout: Layout) -> int:
    """The tensor's size in bytes; ModelLoadError when its blocks are not whole or run past the file."""
    n = info.n_elements
    if n % layout.block_elems:
        raise ModelLoadError(f"{header.source}: tensor {info.name!r} ({layout.type_name}) holds {n} values, "
                             f"not a whole number of {layout.block_elems}-value blocks")
    nbytes = n // layout.block_elems * layout.block_bytes
    if info.data_offset + nbytes > header.file_size:
        raise ModelLoadError(f"{header.source}: tensor {info.name!r} runs to byte {info.data_offset + nbytes}, "
                             f"past the end of the file ({header.file_size} bytes): the file is truncated")
    return nbytes


def _scan_tensor(raw: npt.NDArray[np.uint8], info: TensorInfo, layout: Layout) -> BadValue | None:
    """The first non-finite value (float types) or block scale of one tensor's bytes, with a count."""
    blocks = raw.reshape(-1, layout.block_bytes)  # (n_blocks, block_bytes); a float type's block is one value
    step = max(1, _CHUNK_BYTES // layout.block_bytes)
    is_bf16 = layout.type_name == "BF16"
    first: BadValue | None = None
    total = 0
    for start in range(0, blocks.shape[0], step):
        chunk = blocks[start:start + step]
        if layout.float_width:
            fields = [(chunk, 0, layout.float_width, "element")]
        else:
            fields = [(chunk[:, s.offset:s.offset + s.width], s.offset, s.width, s.name) for s in layout.scales]
        for column, offset, width, what in fields:
            dtype, mask = _EXPONENT[(width, is_bf16)]
            bits = np.ascontiguousarray(column).view(dtype).reshape(-1)
            hits = np.flatnonzero((bits & dtype(mask)) == dtype(mask))
            total += hits.size
            if hits.size:  # the lowest offset wins, whichever scale field holds it (chunks go up)
                found = _bad(info, layout, what, start + int(hits[0]), offset, width, bits[hits[0]], is_bf16)
                if first is None or found.file_offset < first.file_offset:
                    first = found
    if first is None:
        return None
    return attrs.evolve(first, count=total)


def _bad(info: TensorInfo, layout: Layout, what: str, index: int, offset: int, width: int,
         bits: np.unsignedinteger, is_bf16: bool) -> BadValue:
    """A BadValue for element `index` (float types) or the scale `what` of block `index`."""
    if layout.float_width:
        where, byte = f"element {index}", index * width
    else:
        where, byte = f"block {index} scale {what}", index * layout.block_bytes + offset
    if is_bf16:
        value = float(np.array([int(bits) << 16], dtype=np.uint32).view(np.float32)[0])
    else:
        value = float(np.array([bits]).view(_FLOAT_OF_WIDTH[(width, False)])[0])
    return BadValue(tensor=info.name, type_name=layout.type_name, where=where, value=value,
                    file_offset=info.data_offset + byte, count=1)


def _map(header: GGUFHeader) -> npt.NDArray[np.uint8]:
    """The file as a read-only uint8 array over one memory map (the map lives as long as it)."""
    try:
        with open(header.source, "rb") as handle:
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{header.source}: cannot map the GGUF file to check its tensors: {exc}") from None
    if len(mapping) != header.file_size:
        size = len(mapping)
        mapping.close()
        raise ModelLoadError(f"{header.source}: the file changed while it was checked ({size} bytes now, "
                             f"{header.file_size} when its header was read)")
    return np.frombuffer(mapping, dtype=np.uint8)

