"""Gemma 3 270M in numpy against llama.cpp references recorded by tools/record_llama_reference.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from skippy_zmq.runtime.kernels import Kernel
from skippy_zmq.runtime.stage import StageRuntime

DATA = Path(__file__).parent / "data" / "llama_cpp"
PROMPTS_JSON = DATA / "gemma3_prompts.json"
LOGITS_NPZ = DATA / "gemma3_logits.npz"
N_GREEDY = 24
F32_ATOL = 2e-2
Q4_MIN_COSINE = 0.998
SLIDING_WINDOW = 512

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (PROMPTS_JSON.is_file() and LOGITS_NPZ.is_file()),
        reason=f"llama.cpp references {PROMPTS_JSON.name} / {LOGITS_NPZ.name} are absent from "
               f"{DATA}; record them with tools/record_llama_reference.py",
    ),
]


@pytest.fixture(scope="module")
def refs() -> tuple[dict[str, Any], dict[str, npt.NDArray[np.float32]]]:
    doc = json.loads(PROMPTS_JSON.read_text())
    with np.load(LOGITS_NPZ) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return doc, arrays


@pytest.fixture(scope="module")
def runtime(gemma3_270m_path: Path) -> StageRuntime:
    # The float32 path: these are the numbers of llama.cpp's F32 reference (the default, ggml, gives
    # llama.cpp's on the Q4_K_M file itself: tests/test_gemma3_pipeline.py).
    # The float32 oracle tests keep f32: the references ran with an F32 cache.
    return StageRuntime.load(gemma3_270m_path, 0, 18, ctx_size=1024, kernel=Kernel("onnxruntime"), cache_type_k="f32",
                             cache_type_v="f32")


def _prompt_logits(rt: StageRuntime, sid: int, ids: list[int]) -> npt.NDArray[np.float32]:
    rt.open_session(sid)
    hidden = rt.forward(sid, 0, np.array(ids, dtype=np.int32))
    return rt.logits(hidden[-1:])[0]


def test_prompt_logits_and_greedy_tokens_match_f32_llama_cpp(
        runtime: StageRuntime, refs: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
    doc, arrays = refs
    assert len(doc["prompts"]) >= 6
    for i, rec in enumerate(doc["prompts"]):
        sid = 1000 + i
        logits = _prompt_logits(runtime, sid, rec["prompt_ids"])
        want = arrays[f"f32_last_{i}"]
        assert logits.shape == want.shape == (runtime.hparams.n_vocab,)
        diff = float(np.max(np.abs(logits - want)))
        assert diff <= F32_ATOL, f"prompt {rec['prompt']!r}: max |logit diff| {diff:.4g}"
        tokens: list[int] = []
        for _ in range(N_GREEDY):
            tokens.append(int(np.argmax(logits)))
            pos = runtime.session_length(sid)
            hidden = runtime.forward(sid, pos, np.array(tokens[-1:], dtype=np.int32))
            logits = runtime.logits(hidden)[0]
        assert tokens == rec["greedy_ids_f32"], f"prompt {rec['prompt']!r}"
        runtime.close_session(sid)


def test_prompt_logits_close_to_q4_llama_cpp(
        runtime: StageRuntime, refs: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
    doc, arrays = refs
    for i, rec in enumerate(doc["prompts"]):
        logits = _prompt_logits(runtime, 2000 + i, rec["prompt_ids"]).astype(np.float64)
        runtime.close_session(2000 + i)
        want = arrays[f"q4_last_{i}"].astype(np.float64)
        cosine = float(logits @ want / (np.linalg.norm(logits) * np.linalg.norm(want)))
        assert cosine > Q4_MIN_COSINE, f"prompt {rec['prompt']!r}: cosine {cosine:.5f}"
        assert int(np.argmax(logits)) == rec["top_token_q4"] == int(np.argmax(want))


def test_sliding_window_logits_match_f32_llama_cpp(
        runtime: StageRuntime, refs: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
    doc, arrays = refs
    ids, positions = doc["sliding"]["prompt_ids"], doc["sliding"]["positions"]
    assert len(ids) > 600 and all(p > SLIDING_WINDOW for p in positions)
    runtime.open_session(3000)
    hidden = runtime.forward(3000, 0, np.array(ids, dtype=np.int32))
    logits = runtime.logits(hidden[positions])
    runtime.close_session(3000)
    want = arrays["sliding_f32"]
    assert logits.shape == want.shape
    diff = np.max(np.abs(logits - want), axis=1)
    assert np.all(diff <= F32_ATOL), f"max |logit diff| per position {diff.tolist()}"
