"""Tests of skippy_zmq.tokens.sampling: filters, penalty semantics, seeding and validation.

A draw's uniform is a function of (seed, position), so the helpers draw as generation does:
each token is appended to the history before the next draw (a new position each time).
"""

from __future__ import annotations

from collections import Counter

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from skippy_zmq.errors import ConfigError, SkippyError, StageError
from skippy_zmq.tokens.sampling import Sampler, SamplingParams, uniform

N_VOCAB_GEMMA = 262_144


def _draws(params: SamplingParams, logits: np.ndarray, n: int, history: list[int] | None = None,
           eog_ids: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """`n` tokens generated one after another: each is appended to the history before the next."""
    sampler = Sampler(params, eog_ids=eog_ids)
    tokens = list(history or [])
    start = len(tokens)
    for _ in range(n):
        tokens.append(sampler.sample(logits, tokens))
    return tokens[start:]


def _draws_over_seeds(params: SamplingParams, logits: np.ndarray, n: int, history: list[int]) -> list[int]:
    """One draw for each of `n` seeds with the same fixed history (the penalty stays put)."""
    return [Sampler(attrs.evolve(params, seed=params.seed + i)).sample(logits, history) for i in range(n)]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 300), elements=st.floats(-30, 30, width=32)))
def test_greedy_is_argmax_with_ties_to_lowest_id(logits: np.ndarray) -> None:
    token = Sampler(SamplingParams()).sample(logits, [])
    assert token == int(np.argmax(logits))
    assert token == int(np.flatnonzero(logits == logits.max())[0])


def test_greedy_tie_goes_to_lowest_id() -> None:
    logits = np.array([0.0, 3.0, 1.0, 3.0, 3.0], dtype=np.float32)
    assert Sampler(SamplingParams()).sample(logits, []) == 1


def test_same_seed_reproduces_tokens() -> None:
    logits = np.random.default_rng(1).standard_normal(5000).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=100, top_p=0.95, min_p=0.01, repeat_penalty=1.1, seed=42)
    history = [3, 17, 99]
    assert _draws(params, logits, 60, history) == _draws(params, logits, 60, history)


def test_different_seeds_give_different_tokens_on_a_flat_distribution() -> None:
    logits = np.zeros(1000, dtype=np.float32)
    runs = {tuple(_draws(SamplingParams(temperature=1.0, seed=seed), logits, 20)) for seed in range(8)}
    # 20 uniform draws from 1000 tokens: a repeat across seeds has probability ~1e-60.
    assert len(runs) == 8


def test_seed_accepts_the_full_u64_range() -> None:
    logits = np.zeros(64, dtype=np.float32)
    low = _draws(SamplingParams(temperature=1.0, seed=0), logits, 30)
    high = _draws(SamplingParams(temperature=1.0, seed=2**64 - 1), logits, 30)
    assert low != high


def test_uniform_is_a_pure_function_of_seed_and_position() -> None:
    assert uniform(7, 3) == uniform(7, 3)
    assert len({uniform(7, p) for p in range(1000)}) == 1000  # distinct positions, distinct numbers
    assert uniform(7, 3) != uniform(8, 3)
    assert uniform(2**64 - 1, 2**40) != uniform(0, 2**40)
    values = np.array([uniform(11, p) for p in range(20_000)])
    assert values.min() >= 0.0 and values.max() < 1.0
    # Ten equal bins, 2,000 expected each: 9 degrees of freedom, 27.88 is the 0.999 quantile.
    counts = np.bincount((values * 10).astype(np.int64), minlength=10)
    assert float(((counts - 2000) ** 2 / 2000).sum()) < 27.88


def test_a_draw_depends_on_the_position_not_on_earlier_draws() -> None:
    logits = np.zeros(1000, dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=5))
    history = [1, 2, 3]
    first = sampler.sample(logits, history)
    assert [sampler.sample(logits, history) for _ in range(5)] == [first] * 5
    assert sampler.sample(logits, [*history, first]) != first  # the next position draws anew


def test_a_replayed_session_draws_what_the_original_drew() -> None:
    logits = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    params = SamplingParams(temperature=1.2, top_k=200, top_p=0.9, repeat_penalty=1.1, seed=2024)
    prompt = [5, 17, 99, 4]
    generated = _draws(params, logits, 40, prompt)
    assert len(set(generated)) > 10  # a real sample, not a constant
    for k in range(len(generated)):
        # A new sampler (a restarted stage) fed the prompt plus what was generated so far.
        assert Sampler(params).sample(logits, prompt + generated[:k]) == generated[k]


@settings(max_examples=30, deadline=None)
@given(
    hnp.arrays(np.float32, st.integers(2, 500), elements=st.floats(-20, 20, width=32)),
    st.floats(0.05, 5.0),
    st.integers(0, 2**32),
)
def test_top_k_one_and_tiny_top_p_are_greedy(logits: np.ndarray, temperature: float, seed: int) -> None:
    greedy = int(np.argmax(logits))
    assert _draws(SamplingParams(temperature=temperature, top_k=1, seed=seed), logits, 5) == [greedy] * 5
    assert _draws(SamplingParams(temperature=temperature, top_p=1e-9, seed=seed), logits, 5) == [greedy] * 5


def test_top_k_keeps_only_the_k_best() -> None:
    logits = np.random.default_rng(2).standard_normal(N_VOCAB_GEMMA).astype(np.float32)
    best = set(np.argsort(-logits)[:5].tolist())
    drawn = Counter(_draws(SamplingParams(temperature=50.0, top_k=5, seed=3), logits, 500))
    assert set(drawn) == best  # very high temperature: near uniform over the five


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass() -> None:
    logits = np.log(np.array([0.05, 0.5, 0.15, 0.3], dtype=np.float32))
    hot = 1e4  # after filtering, near uniform over what is left
    assert set(_draws(SamplingParams(temperature=hot, top_p=0.79, seed=0), logits, 300)) == {1, 3}
    assert set(_draws(SamplingParams(temperature=hot, top_p=0.81, seed=0), logits, 300)) == {1, 2, 3}
    assert set(_draws(SamplingParams(temperature=hot, top_p=1.0, seed=0), logits, 300)) == {0, 1, 2, 3}


def test_top_p_on_a_large_vocab_matches_a_full_sort() -> None:
    # 2,000 distinct high logits scattered over the Gemma-sized vocab: the cut lies beyond the
    # first guessed candidate count, so the growing partial selection must agree with a full sort.
    rng = np.random.default_rng(4)
    logits = np.zeros(N_VOCAB_GEMMA, dtype=np.float32)
    high = rng.permutation(N_VOCAB_GEMMA)[:2000]
    logits[high] = 6.0 - np.arange(2000, dtype=np.float32) * 1e-3
    probs = _softmax(logits.astype(np.float64))
    order = np.lexsort((np.arange(N_VOCAB_GEMMA), -logits))
    n_keep = int(np.searchsorted(np.cumsum(probs[order]), 0.5)) + 1
    expected = set(order[:n_keep].tolist())
    assert 300 < n_keep < 2000
    drawn = Counter(_draws(SamplingParams(temperature=1e4, top_p=0.5, seed=5), logits, 1000))
    assert set(drawn) <= expected
    rank = {int(token): k for k, token in enumerate(order[:n_keep])}
    assert max(rank[t] for t in drawn) > 0.95 * n_keep  # the tail of the kept prefix is reachable


def test_top_p_keeps_every_tied_token_in_id_order() -> None:
    logits = np.zeros(N_VOCAB_GEMMA, dtype=np.float32)
    tied = np.sort(np.random.default_rng(6).permutation(N_VOCAB_GEMMA)[:300])
    logits[tied] = 5.0
    # Each tied token holds ~4.8e-4 of the mass; 0.1 needs the 207 lowest tied ids.
    probs = _softmax(logits.astype(np.float64))
    n_keep = int(np.ceil(0.1 / probs[tied[0]]))
    drawn = set(_draws(SamplingParams(temperature=1e4, top_p=0.1, seed=7), logits, 800))
    assert drawn <= set(tied[:n_keep].tolist())
    assert max(drawn) > tied[n_keep - 10]


def test_min_p_drops_tokens_below_the_fraction_of_the_peak() -> None:
    probs = np.array([0.4, 0.2, 0.1, 0.039, 0.261], dtype=np.float64)
    logits = np.log(probs).astype(np.float32)
    drawn = set(_draws(SamplingParams(temperature=1e4, min_p=0.1, seed=8), logits, 400))
    assert drawn == {0, 1, 2, 4}  # 0.039 < 0.1 * 0.4
    drawn = set(_draws(SamplingParams(temperature=1e4, min_p=0.6, seed=8), logits, 400))
    assert drawn == {0, 4}


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    params = SamplingParams(repeat_penalty=1.1)
    sampler = Sampler(params)
    # 2.0 / 1.1 = 1.818 < 1.9: the repeated token loses its lead.
    assert sampler.sample(np.array([2.0, 1.9], dtype=np.float32), [0]) == 1
    # -1.0 * 1.1 = -1.1 < -1.05: a negative repeated logit gets more negative, not less.
    assert sampler.sample(np.array([-1.0, -1.05], dtype=np.float32), [0]) == 1
    # Penalty applied once per distinct token: 2.0 / 1.1 = 1.818 > 1.6 even if token 0 repeats.
    assert sampler.sample(np.array([2.0, 1.6], dtype=np.float32), [0, 0, 0, 0]) == 0
    # Zero logits stay zero.
    assert sampler.sample(np.array([0.0, -0.01], dtype=np.float32), [0]) == 0


def test_repeat_penalty_only_covers_the_last_n_tokens() -> None:
    logits = np.array([2.0, 1.9, 0.0, 0.0], dtype=np.float32)
    history = [0, 2, 3]
    assert Sampler(SamplingParams(repeat_penalty=1.1, penalty_last_n=2)).sample(logits, history) == 0
    assert Sampler(SamplingParams(repeat_penalty=1.1, penalty_last_n=3)).sample(logits, history) == 1
    assert Sampler(SamplingParams(repeat_penalty=1.1, penalty_last_n=-1)).sample(logits, history) == 1
    assert Sampler(SamplingParams(repeat_penalty=1.1, penalty_last_n=0)).sample(logits, history) == 0


def test_repeat_penalty_leaves_the_callers_logits_untouched() -> None:
    logits = np.array([2.0, 1.9, -1.0], dtype=np.float32)
    before = logits.copy()
    Sampler(SamplingParams(repeat_penalty=1.5)).sample(logits, [0, 2])
    np.testing.assert_array_equal(logits, before)


def test_repeat_penalty_shifts_sampled_frequencies_by_the_penalized_softmax() -> None:
    logits = np.array([1.0, 1.0, -0.5], dtype=np.float32)
    params = SamplingParams(temperature=1.0, repeat_penalty=2.0, seed=9)
    n = 20_000
    counts = Counter(_draws_over_seeds(params, logits, n, history=[0, 2]))
    expected = _softmax(np.array([0.5, 1.0, -1.0]))  # 1.0 / 2, untouched, -0.5 * 2
    observed = np.array([counts[i] for i in range(3)]) / n
    np.testing.assert_allclose(observed, expected, atol=0.015)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_draws_follow_the_scaled_softmax(temperature: float) -> None:
    logits = np.array([0.0, 0.5, 1.0, 2.0, -1.0], dtype=np.float32)
    expected = _softmax(logits.astype(np.float64) / temperature)
    n = 20_000
    counts = Counter(_draws(SamplingParams(temperature=temperature, seed=11), logits, n))
    observed = np.array([counts[i] for i in range(5)], dtype=np.float64)
    mask = expected * n >= 5
    chi2 = float((((observed - expected * n) ** 2) / (expected * n))[mask].sum())
    # 4 degrees of freedom: 18.47 is the 0.999 quantile; the seed is fixed, so this is not flaky.
    assert chi2 < 18.47
    assert observed[~mask].sum() < 25


def test_temperature_changes_the_distribution() -> None:
    logits = np.array([0.0, 1.0, 2.0], dtype=np.float32)
    n = 5000
    cold = Counter(_draws(SamplingParams(temperature=0.25, seed=12), logits, n))[2] / n
    hot = Counter(_draws(SamplingParams(temperature=4.0, seed=12), logits, n))[2] / n
    assert cold > 0.95  # softmax([0, 4, 8])[2] = 0.982
    assert 0.35 < hot < 0.45  # softmax([0, .25, .5])[2] = 0.399


def test_ignore_eos_never_picks_end_of_generation_tokens() -> None:
    logits = np.array([0.0, 9.0, 5.0, 9.0], dtype=np.float32)
    assert Sampler(SamplingParams(ignore_eos=True), eog_ids={1, 3}).sample(logits, []) == 2
    assert Sampler(SamplingParams(ignore_eos=False), eog_ids={1, 3}).sample(logits, []) == 1
    drawn = set(_draws(SamplingParams(temperature=1e3, ignore_eos=True, seed=1), logits, 300, eog_ids={1}))
    assert drawn == {0, 2, 3}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", -1.0),
        ("penalty_last_n", -2),
        ("seed", -1),
        ("seed", 2**64),
        ("ignore_eos", 1),
    ],
)
def test_bad_params_are_rejected_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert isinstance(info.value, SkippyError) and isinstance(info.value, ValueError)
    assert repr(value) in str(info.value)


def test_params_defaults_and_is_greedy() -> None:
    params = SamplingParams()
    assert params.is_greedy and params.top_k == 0 and params.top_p == 1.0 and params.penalty_last_n == 64
    assert not SamplingParams(temperature=0.7).is_greedy
    assert SamplingParams.greedy() == SamplingParams()


@pytest.mark.parametrize(
    ("logits", "history", "message"),
    [
        (np.zeros((2, 3), dtype=np.float32), [], "1-D"),
        (np.zeros(0, dtype=np.float32), [], "1-D"),
        (np.array([0.0, np.nan], dtype=np.float32), [], "nan"),
        (np.full(3, -np.inf, dtype=np.float32), [], "-inf"),
        (np.zeros(3, dtype=np.float32), [3], "history token id 3"),
        (np.zeros(3, dtype=np.float32), [-1], "history token id -1"),
    ],
)
def test_bad_logits_or_history_raise_stage_error(logits: np.ndarray, history: list[int], message: str) -> None:
    with pytest.raises(StageError, match=message):
        Sampler(SamplingParams(repeat_penalty=1.2)).sample(logits, history)


@pytest.mark.parametrize("params", [SamplingParams(ignore_eos=True), SamplingParams(repeat_penalty=1.5),
                                    SamplingParams(temperature=0.8, seed=3, ignore_eos=True)])
def test_scratch_logits_give_the_same_token_and_others_stay_untouched(params: SamplingParams) -> None:
    logits = np.array([0.5, 4.0, 3.9, 1.0, 3.95], dtype=np.float32)
    history = [1, 4]
    kept = logits.copy()
    sampler = Sampler(params, eog_ids={1})
    token = sampler.sample(logits, history)
    assert np.array_equal(logits, kept)  # the caller's array is not changed
    assert sampler.sample(logits.copy(), history, scratch=True) == token


# --- OpenAI's penalties and the logit bias -------------------------------------------------------


def test_presence_and_frequency_penalties_count_generated_tokens_only() -> None:
    logits = np.zeros(6, dtype=np.float32)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    history = [1, 1, 2, 3, 3, 3]  # the prompt is [1, 1]: tokens 2 and 3 were generated
    scores = Sampler(params)._adjusted(logits, history, False, prompt_tokens=2)
    assert scores.tolist() == [0.0, 0.0, -0.75, -1.25, 0.0, 0.0]
    assert logits.tolist() == [0.0] * 6  # not in place unless handed over as scratch


def test_a_negative_presence_penalty_rewards_and_greedy_follows_the_penalized_logits() -> None:
    logits = np.array([1.0, 0.9, 0.0], dtype=np.float32)
    assert Sampler(SamplingParams(presence_penalty=-0.5)).sample(logits, [0, 1], prompt_tokens=1) == 1
    assert Sampler(SamplingParams(frequency_penalty=2.0)).sample(logits, [0, 0], prompt_tokens=1) == 1


def test_logit_bias_is_added_before_everything_and_minus_100_bans_a_token() -> None:
    logits = np.array([5.0, 4.0, 3.0], dtype=np.float32)
    assert Sampler(SamplingParams(logit_bias={0: -100.0})).sample(logits, []) == 1
    assert Sampler(SamplingParams(logit_bias=[(2, 2.5)])).sample(logits, []) == 2
    draws = {Sampler(SamplingParams(temperature=1.0, seed=s, logit_bias={0: -100, 1: -100})).sample(logits, [])
             for s in range(30)}
    assert draws == {2}


def test_logit_bias_and_penalty_values_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"logit_bias of token 3 is 100\.5"):
        SamplingParams(logit_bias={3: 100.5})
    with pytest.raises(ConfigError, match="out of order or repeated"):
        SamplingParams(logit_bias=[(3, 1.0), (3, 2.0)])
    with pytest.raises(ConfigError, match=r"must be a \(token id, bias\) pair"):
        SamplingParams(logit_bias=[(True, 1.0)])
    with pytest.raises(ConfigError, match="has 1025 entries"):
        SamplingParams(logit_bias=dict.fromkeys(range(1025), 1.0))
    with pytest.raises(ConfigError, match=r"presence_penalty 2.5 must be a number in \[-2, 2\]"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(StageError, match="names token id 9, outside the vocab"):
        Sampler(SamplingParams(logit_bias={9: 1.0})).sample(np.zeros(4, np.float32), [])


@settings(max_examples=200, deadline=None)
@given(logits=hnp.arrays(np.float32, st.integers(2, 300), elements=st.sampled_from([-3.0, 0.0, 1.5, 2.0])),
       params=st.sampled_from([SamplingParams(), SamplingParams(ignore_eos=True), SamplingParams(repeat_penalty=1.3),
                               SamplingParams(presence_penalty=0.5), SamplingParams(logit_bias={1: 5.0}),
                               SamplingParams(temperature=0.7, seed=3)]),
       history=st.lists(st.integers(0, 1), max_size=3), prompt_tokens=st.integers(0, 3))
def test_a_greedy_pick_from_the_largest_ids_is_the_samplers_own(
        logits: np.ndarray, params: SamplingParams, history: list[int], prompt_tokens: int) -> None:
    # Few values, so many ties; ids 0 and 1 are the end-of-generation ids ignore_eos bans.
    sampler = Sampler(params, eog_ids=[0, 1])
    depth = sampler.greedy_depth
    order = np.lexsort((np.arange(logits.size), -logits.astype(np.float64)))  # largest first, ties to lowest id
    known = sampler.greedy_from_top(order[:depth].tolist(), history, prompt_tokens)
    applies = (params.repeat_penalty != 1.0 and bool(history)) or (
        params.presence_penalty != 0.0 and len(history) > prompt_tokens)
    assert depth == (0 if not params.is_greedy or params.logit_bias else 1 + 2 * params.ignore_eos)
    if depth == 0 or applies:
        assert known is None
    elif known is not None:
        assert known == sampler.sample(logits, history, prompt_tokens=prompt_tokens)
    else:  # only banned ids among the largest: a row shorter than the depth
        assert set(order[:depth].tolist()) <= {0, 1}


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]), top_k=st.integers(0, 70),
       min_p=st.sampled_from([0.0, 0.05, 0.3]), words=st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=2))
def test_a_constrained_pick_is_the_pick_of_the_row_with_every_other_id_at_minus_infinity(
        seed: int, temperature: float, top_k: int, min_p: float, words: list[int]) -> None:
    mask = np.array(words, dtype=np.uint32).view(np.int32)  # 64 ids
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little").astype(bool)
    if not allowed.any():
        return
    logits = np.random.default_rng(seed % 2**32).normal(size=64).astype(np.float32)
    masked = np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p, seed=seed))
    history = list(range(5))
    token = sampler.sample(logits, history, allowed=mask)
    assert allowed[token]
    assert token == sampler.sample(masked, history)


@settings(max_examples=60, deadline=None)
@given(logits=hnp.arrays(np.float32, st.integers(2, 40), elements=st.floats(-8, 8, width=32)),
       seed=st.integers(0, 2**32), top_k=st.integers(0, 8), top_p=st.sampled_from([1.0, 0.9, 0.5]),
       min_p=st.sampled_from([0.0, 0.05, 0.3]), temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]))
def test_the_candidates_are_what_the_filters_kept_with_the_tempered_softmax_and_hold_the_pick(
        logits: np.ndarray, seed: int, top_k: int, top_p: float, min_p: float, temperature: float) -> None:
    """llama.cpp's post-sampling probabilities: softmax(logit / temperature) over the ids top-k, top-p and
    min-p kept, renormalised; the pick is `sample`'s own, and greedy's only candidate is its pick."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    history = [0, 1]
    token, candidates = Sampler(params).sample_candidates(logits, history)
    assert token == Sampler(params).sample(logits, history)
    if params.is_greedy:
        assert candidates.ids.tolist() == [token] and candidates.probs.tolist() == [1.0]
        return
    ids = candidates.ids.tolist()
    assert token in ids and len(set(ids)) == len(ids)
    assert candidates.probs.sum() == pytest.approx(1.0)
    assert list(candidates.probs) == sorted(candidates.probs, reverse=True)
    order = sorted(range(logits.size), key=lambda i: (-logits[i], i))
    kept = order[: top_k or logits.size]  # top-k; top-p and min-p then cut its tail
    assert ids == kept[: len(ids)] or sorted(ids) == sorted(kept[: len(ids)])  # ties may swap equal logits
    scaled = logits[ids].astype(np.float64) / temperature
    expected = np.exp(scaled - scaled.max()) / np.exp(scaled - scaled.max()).sum()
    assert candidates.probs == pytest.approx(expected, rel=1e-5)


def test_the_candidates_of_a_constrained_pick_are_among_the_allowed_ids() -> None:
    logits = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0] * 4, dtype=np.float32)
    allowed = np.zeros(1, dtype=np.int32)
    allowed[0] = (1 << 2) | (1 << 5)  # ids 2 and 5 only
    token, candidates = Sampler(SamplingParams(temperature=1.0, seed=3)).sample_candidates(logits, [], allowed=allowed)
    assert token in (2, 5) and candidates.ids.tolist() == [2, 5]
    assert candidates.probs.tolist() == pytest.approx([1 / (1 + np.exp(-3.0)), 1 - 1 / (1 + np.exp(-3.0))])
