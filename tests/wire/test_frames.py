"""Activation part and frame descriptors: every rule of docs/PROTOCOL.md §3."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from skippy_zmq.errors import FrameError, LimitError, SkippyError
from skippy_zmq.wire.frames import MAX_ACTIVATION_BYTES, PART_OPTIONAL, ActivationFrame, FrameDesc, GGMLType, PartDesc
from tests.strategies import activation_frames


def primary(n_embd: int = 4, tokens: int = 2) -> PartDesc:
    return PartDesc(identity=0, ggml_type=GGMLType.F32, dims=(n_embd, tokens), token_axis=1)


def frame_desc(*parts: PartDesc, tokens: int = 2) -> FrameDesc:
    return FrameDesc(producer_stage_index=0, layer_start=0, layer_end=4, token_count=tokens, parts=parts)


def test_part_geometry() -> None:
    part = PartDesc(identity=7, ggml_type=GGMLType.I32, dims=(3, 2, 5), token_axis=1, flags=PART_OPTIONAL)
    assert part.rank == 3
    assert part.shape == (5, 2, 3)
    assert part.n_elements == 30
    assert part.nbytes == 120
    assert part.optional and part.token_count == 2
    assert GGMLType.BF16.itemsize == 2 and GGMLType.BF16.dtype == np.dtype("<u2")


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"dims": ()}, LimitError, "rank 0 is outside 1..4"),
        ({"dims": (1, 1, 1, 1, 1)}, LimitError, "rank 5 is outside 1..4"),
        ({"dims": (4, 2), "token_axis": 2}, FrameError, "token_axis 2 is outside 0..1"),
        ({"dims": (4, 2), "token_axis": -1}, FrameError, "token_axis -1"),
        ({"dims": (4, 0)}, FrameError, "dims[1] = 0 must be positive"),
        ({"dims": (-4, 2)}, FrameError, "dims[0] = -4 must be positive"),
        ({"dims": (4, 2), "flags": 2}, FrameError, "unknown flag bits 0x2"),
        ({"dims": (4, 2), "ggml_type": 8}, FrameError, "unsupported activation part ggml type 8"),
        ({"dims": (4, 2), "identity": 2**32}, FrameError, "identity 4294967296"),
    ],
)
def test_invalid_parts_are_rejected_by_name(kwargs: dict, error: type, text: str) -> None:
    fields = {"identity": 1, "ggml_type": GGMLType.F32, "token_axis": 0} | kwargs
    with pytest.raises(error) as info:
        PartDesc(**fields)
    assert text in str(info.value)
    assert isinstance(info.value, SkippyError)


def test_frame_rules() -> None:
    ok = frame_desc(primary(), PartDesc(identity=1, ggml_type=GGMLType.I32, dims=(2,), token_axis=0))
    assert ok.payload_bytes == 4 * 4 * 2 + 2 * 4
    with pytest.raises(FrameError, match="two parts with identity 0"):
        frame_desc(primary(), PartDesc(identity=0, ggml_type=GGMLType.I32, dims=(2,)))
    with pytest.raises(FrameError, match=r"dims\[0\] = 3 must equal the frame token_count 2"):
        frame_desc(primary(), PartDesc(identity=1, ggml_type=GGMLType.I32, dims=(3,)))
    with pytest.raises(LimitError, match=r"part count 0 is outside 1\.\.16"):
        frame_desc()
    many = [primary()] + [PartDesc(identity=i, ggml_type=GGMLType.I32, dims=(2,)) for i in range(1, 17)]
    with pytest.raises(LimitError, match=r"part count 17 is outside 1\.\.16"):
        frame_desc(*many)
    with pytest.raises(FrameError, match="version 3 is not supported; expected 2"):
        FrameDesc(producer_stage_index=0, layer_start=0, layer_end=1, token_count=2, parts=(primary(),), version=3)
    with pytest.raises(FrameError, match="must be the primary hidden state"):
        frame_desc(PartDesc(identity=0, ggml_type=GGMLType.F16, dims=(4, 2), token_axis=1))
    with pytest.raises(FrameError, match="must be the primary hidden state"):
        frame_desc(PartDesc(identity=0, ggml_type=GGMLType.F32, dims=(4, 2), token_axis=1, flags=PART_OPTIONAL))
    with pytest.raises(FrameError, match=r"layer range 3\.\.3"):
        FrameDesc(producer_stage_index=0, layer_start=3, layer_end=3, token_count=2, parts=(primary(),))
    with pytest.raises(FrameError, match="sequence_count 0"):
        FrameDesc(producer_stage_index=0, layer_start=0, layer_end=1, token_count=2, parts=(primary(),), sequence_count=0)
    with pytest.raises(FrameError, match="producer_stage_index -1"):
        FrameDesc(producer_stage_index=-1, layer_start=0, layer_end=1, token_count=2, parts=(primary(),))


def test_decoded_size_limit_is_checked_on_the_descriptor() -> None:
    # 2**27 floats per token is 512 MiB: the descriptor alone is refused, nothing is allocated.
    huge = PartDesc(identity=0, ggml_type=GGMLType.F32, dims=(2**27, 2), token_axis=1)
    with pytest.raises(LimitError) as info:
        frame_desc(huge)
    assert f"exceeds the limit of {MAX_ACTIVATION_BYTES} bytes" in str(info.value)


def test_from_hidden_and_array_checks() -> None:
    hidden = np.arange(12, dtype=np.float32).reshape(3, 4)
    frame = ActivationFrame.from_hidden(hidden, producer_stage_index=1, layer_start=4, layer_end=8)
    assert frame.desc.token_count == 3
    assert frame.desc.parts[0].dims == (4, 3)
    assert frame.hidden is hidden or np.shares_memory(frame.hidden, hidden)
    with pytest.raises(FrameError, match="float32"):
        ActivationFrame.from_hidden(hidden.astype(np.float64), producer_stage_index=0, layer_start=0, layer_end=1)
    with pytest.raises(FrameError, match="does not match descriptor"):
        ActivationFrame(frame.desc, (hidden.reshape(4, 3),))
    with pytest.raises(FrameError, match="1 arrays for 2 parts"):
        ActivationFrame(frame_desc(primary(), PartDesc(identity=1, ggml_type=GGMLType.I32, dims=(2,))), (np.zeros((2, 4), np.float32),))


@given(activation_frames())
def test_generated_frames_are_self_consistent(frame: ActivationFrame) -> None:
    assert frame.desc.payload_bytes == sum(a.nbytes for a in frame.arrays)
    for part, array in zip(frame.desc.parts, frame.arrays, strict=True):
        assert array.shape[part.rank - 1 - part.token_axis] == frame.desc.token_count
