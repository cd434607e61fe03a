"""Tests of skippy_zmq.tokens.logprobs: exact log-softmax values and top alternatives."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from skippy_zmq.errors import ConfigError, StageError
from skippy_zmq.tokens import exp_sum
from skippy_zmq.tokens.logprobs import (
    MAX_TOP_LOGPROBS,
    LogSoftmax,
    TokenLogprobs,
    pass_sums,
    post_sampling_logprobs,
    token_logprobs,
)


def _reference(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def _top_reference(logits: np.ndarray, k: int) -> list[int]:
    return np.lexsort((np.arange(logits.size), -logits.astype(np.float64)))[:k].tolist()


@pytest.mark.parametrize("kernel", exp_sum.available())
@settings(max_examples=150, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 3000), elements=st.floats(-40, 40, width=32)),
       st.integers(0, MAX_TOP_LOGPROBS), st.data())
def test_values_are_the_log_softmax_and_the_top_ids_the_largest_ties_to_lowest(
        kernel: str, logits: np.ndarray, top_n: int, data: st.DataObject) -> None:
    token = data.draw(st.integers(0, logits.size - 1))
    got = token_logprobs(logits, token, top_n, exp_sum=exp_sum.EXP_SUMS[kernel](1))
    reference = _reference(logits)
    assert got.token == token and got.logprob == pytest.approx(reference[token], abs=2e-5)
    order = np.lexsort((np.arange(logits.size), -logits.astype(np.float64)))[: min(top_n, logits.size)]
    assert [i for i, _ in got.top] == order.tolist()
    assert all(v == pytest.approx(reference[i], abs=2e-5) for i, v in got.top)


@pytest.mark.parametrize("kernel", exp_sum.available())
@settings(max_examples=100, deadline=None)
@given(width=st.one_of(st.integers(1, 400), st.integers(512, 1200)), tail=st.integers(0, 15),
       top_n=st.integers(1, MAX_TOP_LOGPROBS),
       levels=st.lists(st.sampled_from([-9.0, -3.0, 0.0, 0.5, 2.0, 7.0]), min_size=1, max_size=6),
       seed=st.integers(0, 2**32 - 1), data=st.data())
def test_top_ids_from_the_column_sums_are_exact_with_ties_and_peaks_sharing_a_column(
        kernel: str, width: int, tail: int, top_n: int, levels: list[float], seed: int, data: st.DataObject) -> None:
    # Few distinct values, so many ties; the largest ones are put in one column (i * width + c),
    # in columns of one group of the bound (c + 256 m), and in the trailing values no column
    # holds: where the bounds drawn from the column sums are loosest.
    logits = np.random.default_rng(seed).choice(np.array(levels, np.float32), 16 * width + tail)
    column = data.draw(st.integers(0, width - 1))
    logits[[i * width + column for i in range(16)]] = max(levels) + 1.0
    logits[[column % 256 + 256 * m for m in range(width // 256)]] = max(levels) + 2.0
    logits[16 * width:] = data.draw(st.sampled_from([max(levels) + 1.0, min(levels)]))
    got = token_logprobs(logits, 0, top_n, exp_sum=exp_sum.EXP_SUMS[kernel](1))
    assert [i for i, _ in got.top] == _top_reference(logits, top_n)
    reference = _reference(logits)
    assert all(v == pytest.approx(reference[i], abs=2e-5) for i, v in got.top)


def test_a_row_whose_column_sums_underflow_still_gets_its_exact_top_ids() -> None:
    # Two logits at 0 and the rest at -90: the sum (about 2) needs no shift, but the fifth-largest
    # column sum is exp(-90) * 16, below float32's normal range, so no bound is drawn from it.
    logits = np.full(262_144, -90.0, np.float32)
    logits[[1_000, 200_000]] = 0.0
    logits[[7, 9]] = -89.0
    got = token_logprobs(logits, 1_000, 5, exp_sum=exp_sum.best())
    assert [i for i, _ in got.top] == [1_000, 200_000, 7, 9, 0]
    assert got.logprob == pytest.approx(-np.log(2.0), abs=1e-6)


def test_a_large_row_with_a_sharp_peak_and_a_tie_gets_the_exact_top_ids() -> None:
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(262_144) * 2).astype(np.float32)
    logits[[5, 77_000, 200_001]] = [30.0, 29.0, 29.0]  # a tie: the lower id first
    got = token_logprobs(logits, 77_000, 20)
    reference = _reference(logits)
    assert [i for i, _ in got.top[:3]] == [5, 77_000, 200_001]
    assert [i for i, _ in got.top] == np.lexsort((np.arange(logits.size), -logits.astype(np.float64)))[:20].tolist()
    assert max(abs(v - reference[i]) for i, v in got.top) < 1e-5


def test_bad_rows_ids_and_counts_are_named() -> None:
    row = np.zeros(8, np.float32)
    with pytest.raises(StageError, match="token id 8 is outside the vocab"):
        token_logprobs(row, 8, 0)
    with pytest.raises(StageError, match=r"top_n 21 is outside 0\.\.20"):
        token_logprobs(row, 0, 21)
    with pytest.raises(StageError, match="non-empty 1-D"):
        token_logprobs(np.zeros((2, 2), np.float32), 0, 0)
    with pytest.raises(StageError, match="largest logit is nan"):
        token_logprobs(np.full(4, np.nan, np.float32), 0, 0)
    with pytest.raises(ConfigError, match="at most 20"):
        TokenLogprobs(0, 0.0, tuple((i, 0.0) for i in range(21)))


@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_logprobs_are_llama_cpps_log_softmax_on_tiny_models(request: pytest.FixtureRequest, arch: str,
                                                             cache: str) -> None:
    # The ggml kernel's logits are llama.cpp's (plain CPU buffers, the same KV cache type), so
    # the logprobs are the log-softmax llama-server reports, to float32 rounding. On Gemma 3 270M
    # (Q4_K_M) the first token of "The capital of France is" gets -1.5322369 here and in llama.cpp
    # with an f32 cache, -1.7258857 in both with f16.
    from pathlib import Path

    from skippy_zmq.compute import ggml
    from skippy_zmq.model.gguf_model import GGUFModel
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime
    from tests.pipeline_helpers import plain_llama

    if ggml.unavailable() is not None:
        pytest.skip(f"ggml kernel unavailable: {ggml.unavailable()}")
    path: Path = request.getfixturevalue(f"tiny_{arch}_path")
    prompt = [1, 70, 71, 72, 73, 80, 90]
    ggml_type = {"f32": 0, "f16": 1}[cache]
    llm = plain_llama(path, n_ctx=64, n_threads=1, logits_all=True, type_k=ggml_type, type_v=ggml_type,
                      flash_attn=False)
    try:
        llm.eval(prompt)
        reference = _reference(np.array(llm.scores[len(prompt) - 1], dtype=np.float32))
    finally:
        llm.close()
    runtime = StageRuntime.load(path, 0, GGUFModel(path).hparams.n_layer, ctx_size=64,
                                kernel=Kernel("ggml", repack=False, head="ggml"), weight_cache=None, cache_type_k=cache,
                                cache_type_v=cache)
    runtime.open_session(1)
    logits = runtime.logits(runtime.forward(1, 0, np.array(prompt, np.int32))[-1:])[0]
    got = token_logprobs(logits, int(np.argmax(reference)), 5)
    assert [i for i, _ in got.top] == np.argsort(-reference, kind="stable")[:5].tolist()
    assert max(abs(v - reference[i]) for i, v in got.top) < 1e-5


@pytest.mark.parametrize("kernel", exp_sum.available())
@pytest.mark.parametrize("offset", [-120.0, -70.0, -30.0, 0.0, 60.0, 95.0, 300.0])
def test_rows_far_from_zero_take_the_shifted_sum_and_agree(kernel: str, offset: float) -> None:
    # -70: most exps are subnormal, which ONNX Runtime's kernel flushes to zero (a sum out of the
    # direct range either way, so the row is summed again shifted by its maximum).
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(5000) * 4 + offset).astype(np.float32)
    got = token_logprobs(logits, 3, 4, exp_sum=exp_sum.EXP_SUMS[kernel](1))
    reference = _reference(logits)
    assert got.logprob == pytest.approx(reference[3], abs=5e-5)
    assert [i for i, _ in got.top] == np.argsort(-reference, kind="stable")[:4].tolist()


@pytest.mark.parametrize("kernel", exp_sum.available())
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), width=st.integers(1, 200), top_n=st.integers(0, MAX_TOP_LOGPROBS),
       seed=st.integers(0, 2**32 - 1), data=st.data())
def test_a_pass_s_sums_give_the_tables_of_one_row_alone(kernel: str, rows: int, width: int, top_n: int,
                                                        seed: int, data: st.DataObject) -> None:
    # Rows of a pass's logits, some far below zero (summed shifted, so left out of the pass's runs),
    # some not asked for, the asked ones in stretches of adjacent rows.
    rng = np.random.default_rng(seed)
    block = (rng.standard_normal((rows, 16 * width)) * 4).astype(np.float32)
    far = data.draw(st.sets(st.integers(0, rows - 1)))
    block[sorted(far)] -= 100.0
    wanted = sorted(data.draw(st.sets(st.integers(0, rows - 1))))
    normalizer = exp_sum.EXP_SUMS[kernel](1)
    sums = pass_sums(block, wanted, normalizer)
    assert sorted(sums) == [i for i in wanted if i not in far]
    for index in wanted:
        alone = LogSoftmax.of(block[index], top_n, exp_sum=exp_sum.EXP_SUMS[kernel](1))
        assert LogSoftmax.of(block[index], top_n, exp_sum=normalizer, summed=sums.get(index)) == alone


def test_a_pass_whose_rows_are_not_column_groups_end_to_end_is_summed_row_by_row() -> None:
    normalizer = exp_sum.best()
    assert pass_sums(np.zeros((3, 40), np.float32), [0, 1, 2], normalizer) == {}  # 40 is not a multiple of 16
    assert pass_sums(np.zeros((3, 64), np.float32)[:, :32], [0, 1], normalizer) == {}  # rows not end to end
    assert sorted(pass_sums(np.zeros((3, 32), np.float32), [0, 2], normalizer)) == [0, 2]


def test_post_sampling_logprobs_are_the_logs_of_the_candidates_probabilities() -> None:
    ids, probs = np.array([7, 3, 9], dtype=np.int64), np.array([0.5, 0.3, 0.2])
    entry = post_sampling_logprobs(3, ids, probs, 2)
    assert entry.token == 3 and entry.logprob == pytest.approx(math.log(0.3))
    assert entry.top == ((7, pytest.approx(math.log(0.5))), (3, pytest.approx(math.log(0.3))))
    assert post_sampling_logprobs(9, ids, probs, 0).top == ()
    with pytest.raises(StageError, match="token 4 is not among the sampler's 3 candidates"):
        post_sampling_logprobs(4, ids, probs, 2)
