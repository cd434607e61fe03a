"""The batch-invariant mode: a row's hidden state and logits are the same bits whatever else is in its pass
(other sessions, prefill chunks, decode rows pooled or apart), on files of each type the mode holds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy_zmq.compute import ggml
from skippy_zmq.compute.engine import GgmlEngine
from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.gguf_model import BlockMatrix, GGUFModel
from skippy_zmq.runtime.kernels import INVARIANT_ENV, Kernel
from skippy_zmq.runtime.stage import StageRuntime
from skippy_zmq.testing.random_model import MIXES, ModelShape, write_random_model
from skippy_zmq.testing.tiny import write_tiny_model

F32 = npt.NDArray[np.float32]
CTX = 160


@pytest.fixture(autouse=True)
def _ggml() -> None:
    if ggml.unavailable() is not None:
        pytest.skip(f"ggml kernel unavailable: {ggml.unavailable()}")


SHAPES = {
    # K-quant blocks need rows of 256 values; Gemma 3's sliding window (8) shorter than the prompts
    "gemma3": ModelShape(name="gemma3-invariant", arch="gemma3", n_layer=3, n_embd=256, n_head=4, n_head_kv=2,
                         head_dim=64, n_ff=512, rope_freq_base=1e6, rms_eps=1e-6, context_length=512,
                         sliding_window=8),
    "qwen3": ModelShape(name="qwen3-invariant", arch="qwen3", n_layer=2, n_embd=256, n_head=4, n_head_kv=2,
                        head_dim=64, n_ff=768, rope_freq_base=1e6, rms_eps=1e-6, context_length=512),
}


@pytest.fixture(scope="module", params=[("gemma3", "Q4_K_M"), ("gemma3", "Q8_0"), ("qwen3", "Q4_K_M")],
                ids=lambda param: f"{param[0]}-{param[1]}")
def runtime(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StageRuntime]:
    """A whole random-weight file of a small shape in a real type mix (Q4_K_M: Q4_K, Q6_K and others), in the
    batch-invariant mode."""
    arch, mix = request.param
    path = write_random_model(tmp_path_factory.mktemp("invariant") / f"{arch}-{mix}.gguf", SHAPES[arch], seed=3,
                              mix=MIXES[mix], output_gain=0.5)
    runtime = StageRuntime.load(path, 0, GGUFModel(path).hparams.n_layer, ctx_size=CTX,
                                kernel=Kernel("ggml", repack=True, invariant=True), weight_cache=None,
                                cache_type_k="f16", cache_type_v="f16")
    yield runtime


@pytest.mark.parametrize("type_name", sorted(ggml.INVARIANT_TYPES))
def test_each_types_product_gives_a_row_the_same_bits_at_every_row_count(type_name: str) -> None:
    rng = np.random.default_rng(7)
    k, n = 512, 64
    data = ggml.quantize(type_name, rng.standard_normal((n, k)).astype(np.float32))
    x = rng.standard_normal((40, k)).astype(np.float32)
    for invariant in (True, False):
        graphs = ggml.MatmulGraphs([BlockMatrix("w", type_name, k, n, data)], 2, "test", repack=True,
                                   invariant=invariant)
        alone = np.concatenate([graphs(x[row:row + 1]) for row in range(40)])
        differ = [rows for rows in (2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 40)
                  if not np.array_equal(graphs(x[:rows]), alone[:rows])]
        if invariant:
            assert differ == [], f"{type_name}: rows differ from one-row products at {differ} rows"
        elif type_name in ("Q4_K", "Q6_K"):
            assert differ, f"{type_name}: llama.cpp's kernels were expected to differ somewhere"


def _rows_alone(runtime: StageRuntime, prompt: npt.NDArray[np.int32]) -> F32:
    """Every position's row of `prompt` computed one position per pass (as decode steps compute them)."""
    runtime.close_session(999)
    runtime.open_session(999)
    rows = np.stack([runtime.forward(999, position, prompt[position:position + 1])[-1].copy()
                     for position in range(len(prompt))])
    runtime.close_session(999)
    return rows


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_row_alone_is_the_same_row_among_any_others(runtime: StageRuntime, data: st.DataObject) -> None:
    n_vocab = runtime.hparams.n_vocab
    sessions = data.draw(st.integers(1, 5), "sessions")
    prompts = [np.array(data.draw(st.lists(st.integers(3, n_vocab - 1), min_size=1, max_size=40)), np.int32)
               for _ in range(sessions)]
    alone = [_rows_alone(runtime, prompt) for prompt in prompts]
    # The same prompts in passes of random chunks, several sessions per pass, until every position ran.
    for session in range(sessions):
        runtime.close_session(session + 1)
        runtime.open_session(session + 1)
    done = [0] * sessions
    got: list[list[F32]] = [[] for _ in range(sessions)]
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        ids, positions, counts, parts = [], [], [], []
        first = next(session for session, prompt in enumerate(prompts) if done[session] < len(prompt))
        for session, prompt in enumerate(prompts):
            left = len(prompt) - done[session]
            # the first unfinished session always runs: every pass makes progress
            if left and (session == first or data.draw(st.booleans(), f"session {session} in this pass")):
                count = data.draw(st.integers(1, left), f"rows of session {session}")
                ids.append(session + 1)
                positions.append(done[session])
                counts.append(count)
                parts.append(prompt[done[session]:done[session] + count])
        hidden = runtime.forward_many(ids, positions, counts, np.concatenate(parts))
        start = 0
        for session_id, count in zip(ids, counts, strict=True):
            got[session_id - 1].append(hidden[start:start + count].copy())
            done[session_id - 1] += count
            start += count
    for session in range(sessions):
        rows = np.concatenate(got[session])
        assert np.array_equal(rows, alone[session]), f"session {session}: rows differ from those computed alone"
        runtime.close_session(session + 1)
    head = runtime.logits(alone[0][-1:])[0].copy()
    together = runtime.logits(np.concatenate([alone[-1], alone[0][-1:]]))[-1]
    assert np.array_equal(head, together)  # the head too


def test_pooled_decode_rows_are_the_rows_their_positions_get_in_a_chunk(runtime: StageRuntime) -> None:
    # Six sessions' decode rows attend through their pool in one view; each equals its position's row computed
    # as the last row of its whole prompt's chunk (the chunk's rows attend together, two rows at least per product).
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, runtime.hparams.n_vocab - 1, 9 + 5 * s).astype(np.int32) for s in range(6)]
    whole = []
    for s, prompt in enumerate(prompts):
        runtime.open_session(100 + s)
        whole.append(runtime.forward(100 + s, 0, prompt)[-1].copy())
        runtime.close_session(100 + s)
        runtime.open_session(200 + s)
        runtime.forward(200 + s, 0, prompt[:-1])
    ids = [200 + s for s in range(6)]
    decoded = runtime.forward_many(ids, [len(p) - 1 for p in prompts], [1] * 6,
                                   np.array([p[-1] for p in prompts], np.int32))
    assert isinstance(runtime.engine, GgmlEngine)
    assert list(runtime.engine.graphs._graphs)[-1].pooled_rows == 6  # they did attend through the pool
    for s in range(6):
        assert np.array_equal(decoded[s], whole[s]), f"session {s}: the pooled decode row differs from its chunk's"
        runtime.close_session(200 + s)


def test_without_the_mode_rows_differ_and_the_mode_refuses_what_it_cannot_hold(tmp_path: Path) -> None:
    # Not vacuous: llama.cpp's kernels give a chunk's rows other bits than one row at a time.
    path = write_random_model(tmp_path / "q4km.gguf", SHAPES["gemma3"], seed=4, mix=MIXES["Q4_K_M"])
    plain = StageRuntime.load(path, 0, 3, ctx_size=CTX, kernel=Kernel("ggml", repack=True), weight_cache=None,
                              cache_type_k="f16", cache_type_v="f16")
    prompt = np.arange(3, 40, dtype=np.int32)
    plain.open_session(1)
    assert not np.array_equal(plain.forward(1, 0, prompt), _rows_alone(plain, prompt))
    with pytest.raises(ModelLoadError, match=r"the batch-invariant mode multiplies Q4_K matrices repacked .*is not"):
        StageRuntime.load(path, 0, 3, ctx_size=CTX, kernel=Kernel("ggml", repack=False, invariant=True),
                          weight_cache=None)
    tiny = write_tiny_model(tmp_path / "f32.gguf", arch="gemma3", n_layer=2, seed=5)  # an F32 ffn_up
    with pytest.raises(ModelLoadError, match=r"this file has F32"):
        StageRuntime.load(tiny, 0, 2, ctx_size=CTX, kernel=Kernel("ggml", invariant=True), weight_cache=None)


def test_the_mode_is_on_by_default_where_the_file_allows_it_and_the_environment_chooses(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(INVARIANT_ENV, raising=False)
    kernel = Kernel.from_environment("ggml")
    assert kernel.invariant is None and "batch-invariant" not in kernel.described  # auto: the load line says
    path = write_random_model(tmp_path / "q4km.gguf", SHAPES["gemma3"], seed=4, mix=MIXES["Q4_K_M"])
    said: list[str] = []
    stage = StageRuntime.load(path, 0, 3, ctx_size=CTX, kernel=kernel, weight_cache=None, progress=said.append)
    assert stage.invariant and said[-1].endswith("; batch-invariant")
    tiny = write_tiny_model(tmp_path / "f32.gguf", arch="gemma3", n_layer=2, seed=5)  # an F32 ffn_up
    said.clear()
    stage = StageRuntime.load(tiny, 0, 2, ctx_size=CTX, kernel=kernel, weight_cache=None, progress=said.append)
    assert not stage.invariant  # llama.cpp's kernels, saying why
    assert "; llama.cpp's kernels, since the batch-invariant mode holds one order per row for" in said[-1]
    assert said[-1].endswith("this file has F32")
    monkeypatch.setenv(INVARIANT_ENV, "1")
    kernel = Kernel.from_environment("ggml")
    assert kernel.invariant and "batch-invariant" in kernel.described
    monkeypatch.setenv(INVARIANT_ENV, "0")
    kernel = Kernel.from_environment("ggml")
    assert kernel.invariant is False and "llama.cpp's kernels" in kernel.described
    assert not StageRuntime.load(path, 0, 3, ctx_size=CTX, kernel=kernel, weight_cache=None).invariant
    monkeypatch.setenv(INVARIANT_ENV, "yes")
    with pytest.raises(ModelLoadError, match=r"SKIPPY_ZMQ_BATCH_INVARIANT = 'yes'; expected auto \(the default\), 1 "
                                             r"or 0"):
        Kernel.from_environment("ggml")
