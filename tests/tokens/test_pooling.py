"""Embedding pooling: mean and last rows, chunked as whole, and llama.cpp's embeddings as the oracle."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from skippy_zmq.errors import StageError, WireError
from skippy_zmq.model.gguf_model import GGUFModel
from skippy_zmq.runtime.kernels import Kernel
from skippy_zmq.runtime.stage import StageRuntime
from skippy_zmq.tokens.pooling import PooledRows, Pooling, RankHead
from tests.tools import run_tool

F32 = npt.NDArray[np.float32]
# Longer than the tiny Gemma 3's sliding window (8), so its sliding layers drop keys.
PROMPT = [2, 300, 301, 460, 302, 310, 311, 512, 600, 700, 320, 330, 331, 332, 400, 401, 402]


def _unit(v: npt.NDArray[np.float64]) -> F32:
    return (v / np.linalg.norm(v)).astype(np.float32)


def test_mean_pooling_is_the_normalized_mean_of_every_row_in_any_chunks() -> None:
    rows = np.random.default_rng(0).standard_normal((9, 6)).astype(np.float32)
    whole = PooledRows(Pooling.MEAN, 6)
    whole.add(rows)
    want = _unit(rows.astype(np.float64).mean(axis=0))
    np.testing.assert_allclose(whole.vector(), want, rtol=0, atol=1e-7)
    assert whole.count == 9 and abs(float(np.linalg.norm(whole.vector())) - 1) < 1e-6
    chunked = PooledRows(Pooling.MEAN, 6)
    for part in (rows[:1], rows[1:5], rows[5:]):
        chunked.add(part)
    assert chunked.count == 9 and np.array_equal(chunked.vector(), whole.vector())


def test_last_pooling_is_the_normalized_last_row_whatever_came_before() -> None:
    rows = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    pooled = PooledRows(Pooling.LAST, 4)
    pooled.add(rows[:3])
    assert np.array_equal(pooled.vector(), _unit(rows[2].astype(np.float64)))
    rows_kept = rows.copy()
    pooled.add(rows[3:])
    rows[4] = 0  # the caller's buffer may be reused: the pooled row is a copy
    assert np.array_equal(pooled.vector(), _unit(rows_kept[4].astype(np.float64)))


def test_rank_pooling_keeps_the_last_row_as_it_is_for_the_head() -> None:
    rows = np.random.default_rng(2).standard_normal((5, 4)).astype(np.float32) * 3
    pooled = PooledRows(Pooling.RANK, 4)
    pooled.add(rows[:2])
    pooled.add(rows[2:])
    assert np.array_equal(pooled.vector(), rows[4])  # not normalized: the head scores the row itself


def test_pooling_none_keeps_every_row_of_every_chunk_as_it_is() -> None:
    rows = np.random.default_rng(4).standard_normal((6, 4)).astype(np.float32) * 3
    pooled = PooledRows(Pooling.NONE, 4)
    for part in (rows[:1], rows[1:4], rows[4:]):
        pooled.add(part)
    kept = rows.copy()
    rows[:] = 0  # the caller's buffer may be reused: the rows are copies
    assert pooled.count == 6 and np.array_equal(pooled.vector(), kept.reshape(-1))


def test_the_rank_head_applies_dense_tanh_classifier_and_softmax_in_llama_cpps_order() -> None:
    rng = np.random.default_rng(3)
    row = rng.standard_normal(4).astype(np.float32)
    assert np.array_equal(RankHead().scores(row), row[:1])  # no classifier: the row's first value
    dense, dense_bias = rng.standard_normal((4, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    out, out_bias = rng.standard_normal((2, 4)).astype(np.float32), rng.standard_normal(2).astype(np.float32)
    logits = out @ np.tanh(dense @ row + dense_bias) + out_bias
    head = RankHead(dense, dense_bias, out, out_bias, softmax=False, n_scores=2)
    np.testing.assert_allclose(head.scores(row), logits, rtol=1e-6)
    scores = RankHead(None, None, out, None, softmax=True, n_scores=2).scores(row)
    want = np.exp(out @ row - (out @ row).max())
    np.testing.assert_allclose(scores, want / want.sum(), rtol=1e-6)
    assert scores.dtype == np.float32 and abs(float(scores.sum()) - 1) < 1e-6


def test_a_zero_vector_stays_zero_instead_of_dividing_by_zero() -> None:
    pooled = PooledRows(Pooling.MEAN, 3)
    pooled.add(np.array([[1, -2, 0], [-1, 2, 0]], dtype=np.float32))
    assert pooled.vector().tolist() == [0.0, 0.0, 0.0]


def test_bad_rows_and_names_are_refused_by_name() -> None:
    pooled = PooledRows(Pooling.LAST, 4)
    with pytest.raises(StageError, match="no rows were pooled"):
        pooled.vector()
    for bad in (np.zeros((0, 4), np.float32), np.zeros((2, 5), np.float32), np.zeros(4, np.float32)):
        with pytest.raises(StageError, match=re.escape(f"expected float rows (T, 4) with T >= 1, got {bad.dtype} {bad.shape}")):
            pooled.add(bad)
    with pytest.raises(StageError, match=r"expected float rows \(T, 4\) with T >= 1, got int32 \(1, 4\)"):
        pooled.add(np.zeros((1, 4), np.int32))  # type: ignore[arg-type]
    with pytest.raises(StageError, match=r"got list"):
        pooled.add([[0.0] * 4])  # type: ignore[arg-type]
    assert pooled.count == 0
    with pytest.raises(WireError, match=r"unknown pooling id 5; expected one of 1 \(mean\), 2 \(last\), 3 \(rank\), "
                       r"4 \(none\)"):
        Pooling.parse(5)
    assert Pooling.parse(2) is Pooling.LAST and Pooling.named("Mean") is Pooling.MEAN
    with pytest.raises(ValueError, match="unknown pooling 'cls'; expected one of mean, last, rank, none"):
        Pooling.named("cls")


# ------------------------------------------------------------ against llama.cpp


def _llama_cpp_embedding(path: Path, pooling: Pooling, ids: list[int]) -> F32:
    """llama.cpp's pooled embedding of `ids` (CPU buffers, F32 KV cache), L2-normalized."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from tests.pipeline_helpers import plain_llama

    kind = {Pooling.MEAN: llama_cpp.LLAMA_POOLING_TYPE_MEAN, Pooling.LAST: llama_cpp.LLAMA_POOLING_TYPE_LAST}
    # logits_all marks every position an output, as Llama.embed does: pooling reads them all.
    llm = plain_llama(path, n_ctx=64, n_threads=1, embedding=True, pooling_type=kind[pooling], logits_all=True)
    try:
        llm.eval(ids)
        pooled = np.array(llama_cpp.llama_get_embeddings_seq(llm.ctx, 0)[: llm.n_embd()], dtype=np.float64)
    finally:
        llm.close()
    return _unit(pooled)


def _embedding(runtime: StageRuntime, pooling: Pooling, ids: list[int], cut: int | None) -> F32:
    """The runtime's embedding of `ids`, prefilled whole or in two chunks cut at `cut`."""
    runtime.open_session(1)
    pooled = PooledRows(pooling, runtime.hparams.n_embd)
    chunks = [ids] if cut is None else [ids[:cut], ids[cut:]]
    position = 0
    for chunk in chunks:
        pooled.add(runtime.normed(runtime.forward(1, position, np.array(chunk, np.int32))))
        position += len(chunk)
    runtime.close_session(1)
    return pooled.vector()


@pytest.mark.parametrize("pooling", [Pooling.MEAN, Pooling.LAST], ids=lambda pooling: pooling.name.lower())
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_runtime_embeds_as_llama_cpp_does_on_tiny_models(request: pytest.FixtureRequest, arch: str,
                                                             pooling: Pooling) -> None:
    # llama.cpp pools `result_norm` (the output-normed rows) under causal attention for both
    # architectures. Measured: the largest difference 3e-8 (float32 rounding of the pooling and the
    # normalization), where the float32 path differs by 4e-3 to 7e-3 (cosine 0.99976 to 0.99992).
    from skippy_zmq.compute import ggml

    if ggml.unavailable() is not None:
        pytest.skip(f"ggml kernel unavailable: {ggml.unavailable()}")
    path = request.getfixturevalue(f"tiny_{arch}_path")
    reference = _llama_cpp_embedding(path, pooling, PROMPT)
    n_layer = GGUFModel(path).hparams.n_layer
    for kernel, bound in ((Kernel("ggml", repack=False), 1e-6), (Kernel("onnxruntime"), 1e-3)):
        runtime = StageRuntime.load(path, 0, n_layer, ctx_size=64, kernel=kernel, weight_cache=None,
                                    cache_type_k="f32", cache_type_v="f32")
        for cut in (None, 8):  # whole, then the prompt in two prefill chunks
            got = _embedding(runtime, pooling, PROMPT, cut)
            assert 1 - float(got @ reference) < bound, (kernel.name, cut)
        if kernel.name == "ggml":
            assert float(np.abs(got - reference).max()) < 1e-6


def test_pooling_none_gives_llama_cpps_rows_of_every_position(tiny_gemma3_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    from skippy_zmq.compute import ggml
    from tests.pipeline_helpers import plain_llama

    if ggml.unavailable() is not None:
        pytest.skip(f"ggml kernel unavailable: {ggml.unavailable()}")
    llm = plain_llama(tiny_gemma3_path, n_ctx=64, n_threads=1, embedding=True,
                      pooling_type=llama_cpp.LLAMA_POOLING_TYPE_NONE, logits_all=True)
    try:
        llm.eval(PROMPT)
        reference = np.array([llama_cpp.llama_get_embeddings_ith(llm.ctx, i)[: llm.n_embd()]
                              for i in range(len(PROMPT))], dtype=np.float32)
    finally:
        llm.close()
    runtime = StageRuntime.load(tiny_gemma3_path, 0, GGUFModel(tiny_gemma3_path).hparams.n_layer, ctx_size=64,
                                kernel=Kernel("ggml", repack=False), weight_cache=None, cache_type_k="f32",
                                cache_type_v="f32")
    for cut in (None, 8):
        got = _embedding(runtime, Pooling.NONE, PROMPT, cut).reshape(len(PROMPT), -1)
        np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-5)


def _qwen3_reranker(path: Path) -> Path:
    """A tiny random Qwen3-Reranker-shaped file: a qwen3 body, cls.output.weight (2, n_embd) scoring
    "yes" and "no", rank pooling and the two labels in its metadata, as llama.cpp's converter writes one."""
    from skippy_zmq.testing.random_model import ModelShape, TensorPlan, write_random_model

    shape = ModelShape(name="qwen3-reranker-tiny", arch="qwen3", n_layer=2, n_embd=64, n_head=4, n_head_kv=2,
                       head_dim=16, n_ff=128, rope_freq_base=1e6, rms_eps=1e-6, context_length=256)

    def with_head(plans: list[TensorPlan]) -> list[TensorPlan]:
        return [*plans, TensorPlan(name="cls.output.weight", shape=(2, 64), type_name="F32", sigma=1.0)]

    return write_random_model(path, shape, seed=4, edit=with_head,
                              keys={"qwen3.pooling_type": 4, "qwen3.classifier.output_labels": ("yes", "no")})


def _llama_cpp_rank(path: Path, ids: list[int], kv_type: int = 0) -> F32:
    """llama.cpp's rank pooling of `ids`: the n_cls_out scores of the last position (KV cache F32, or F16 with
    `kv_type` 1)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from tests.pipeline_helpers import plain_llama

    llm = plain_llama(path, n_ctx=64, n_threads=1, embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK,
                      logits_all=True, type_k=kv_type, type_v=kv_type)
    try:
        llm.eval(ids)
        n_out = max(int(llama_cpp.llama_model_n_cls_out(llm.model)), 1)
        return np.array(llama_cpp.llama_get_embeddings_seq(llm.ctx, 0)[:n_out], dtype=np.float32)
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["gemma3", "qwen3-reranker"])
def test_rank_scores_equal_llama_cpps_rank_pooling(request: pytest.FixtureRequest, tmp_path: Path, arch: str) -> None:
    # gemma3 has no classifier (llama-server's --reranking on a plain model scores by the row's first
    # value); the reranker-shaped qwen3 file goes through cls.output and a softmax.
    from skippy_zmq.compute import ggml

    if ggml.unavailable() is not None:
        pytest.skip(f"ggml kernel unavailable: {ggml.unavailable()}")
    path = _qwen3_reranker(tmp_path / "rerank.gguf") if arch == "qwen3-reranker" else request.getfixturevalue(
        "tiny_gemma3_path")
    ids = [2, *PROMPT[1:12]] if arch == "qwen3-reranker" else PROMPT
    reference = _llama_cpp_rank(path, ids)
    head = RankHead.from_file(path)
    assert head.n_scores == (2 if arch == "qwen3-reranker" else 1) and (head.out is not None) == (arch != "gemma3")
    runtime = StageRuntime.load(path, 0, GGUFModel(path).hparams.n_layer, ctx_size=64,
                                kernel=Kernel("ggml", repack=False), weight_cache=None, cache_type_k="f32",
                                cache_type_v="f32")
    for cut in (None, 5):
        got = head.scores(_embedding(runtime, Pooling.RANK, ids, cut))
        np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-5)
    if arch == "qwen3-reranker":
        assert abs(float(reference.sum()) - 1) < 1e-5  # P("yes"), P("no")


# ------------------------------------------------------------ Gemma 3 270M


def _compare(*args: str) -> dict[str, Any]:
    done = run_tool("compare_embeddings", "--json", *args, timeout_s=900)
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout)
    assert {row["pooling"] for row in result["rows"]} == {"mean", "last"} and len(result["rows"]) >= 8
    return result


@pytest.mark.slow
def test_gemma3_embeddings_match_llama_cpp_on_the_f32_file(gemma3_270m_path: Path) -> None:
    # The float32 path on the F32-dequantized file; measured: lowest cosine 0.99999992 (mean) and
    # 0.99999987 (last) over 7 prompts, whole and in two chunks.
    pytest.importorskip("llama_cpp")
    result = _compare("--model", str(gemma3_270m_path), "--f32", "--kernel", "onnxruntime", "--min-cosine", "0.999")
    assert min(row["cosine"] for row in result["rows"]) >= 0.9999


@pytest.mark.slow
def test_gemma3_embeddings_on_the_ggml_kernel_are_llama_cpps_on_the_q4_k_m_file(
        gemma3_270m_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The file as it is, both sides without repacking, with ggml's Q6_K product: measured cosine 1.0
    # (to 1e-9) for the whole prompts; two prefill chunks smaller than 8 rows take ggml's other product
    # kernel (docs/PROTOCOL.md §7, "Batched and alone"), measured down to 0.99888.
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("SKIPPY_ZMQ_Q6K", "ggml")
    result = _compare("--model", str(gemma3_270m_path), "--kernel", "ggml")
    assert min(row["cosine"] for row in result["rows"]) >= 0.99999
    assert min(row["cosine_chunked"] for row in result["rows"]) >= 0.995


@pytest.mark.slow
def test_with_the_packages_q6k_product_embeddings_stay_within_the_kernels_spread(
        gemma3_270m_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The default: the package's product takes Q6_K matrices below 8 rows only, where it gives ggml's
    # bits (docs/ARCHITECTURE.md, "The Q6_K product"), so the embeddings are llama.cpp's as with ggml's.
    pytest.importorskip("llama_cpp")
    monkeypatch.delenv("SKIPPY_ZMQ_Q6K", raising=False)
    result = _compare("--model", str(gemma3_270m_path), "--kernel", "ggml")
    assert min(row["cosine"] for row in result["rows"]) >= 0.99999
    assert min(row["cosine_chunked"] for row in result["rows"]) >= 0.995
