"""Log probabilities of the sampled token and its most likely alternatives (docs/PROTOCOL.md §5,
Logprobs).

The values are the float32 log-softmax of the final stage's raw logits: before the logit bias,
the penalties, the sampling filters and temperature, as llama-server reports them by default.
The normalizer is numpy's pairwise float32 sum of exp(logit) (of exp(logit - max) when that sum
is not in (1e-6, 1e30), where a term may have overflowed or the underflowed ones may matter;
relative error about 1e-7, where a float64 sum would double the cost); each value is then rounded
to float32 once.

Cost per row of 262,144 logits (docs/BENCHMARKS.md, "Logprobs"): one exp-sum (a max pass only
when that sum is out of range) and, for the alternatives, one comparison pass against a threshold
taken from a strided sample, so only a few hundred candidates are sorted instead of the whole row.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import ConfigError, StageError

MAX_TOP_LOGPROBS = 20
"""Most alternatives one token may report: OpenAI's top_logprobs and llama-server's n_probs limit."""
_SAMPLE_STRIDE = 64  # the threshold sample takes every 64th logit
_DIRECT_SUM = (1e-6, 1e30)  # a sum of exp(logit) in here is used as it is (no shift by the maximum)


def _check_top(_: object, __: attrs.Attribute[tuple[tuple[int, float], ...]],
               value: tuple[tuple[int, float], ...]) -> None:
    if len(value) > MAX_TOP_LOGPROBS:
        raise ConfigError(f"logprobs: {len(value)} alternatives; at most {MAX_TOP_LOGPROBS} are reported")


@attrs.frozen
class TokenLogprobs:
    """One generated token's log probability and its most likely alternatives, best first
    (ties: lowest id first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = attrs.field(default=(), validator=_check_top)


@attrs.frozen
class LogSoftmax:
    """One row's log-softmax, read before the sampler may change the row: its normalizer and its
    `top_n` most likely ids with their values; a token's value then needs only its raw logit."""

    norm: float  # log(sum(exp(logits)))
    top: tuple[tuple[int, float], ...]
    n_vocab: int

    @classmethod
    def of(cls, logits: npt.NDArray[np.float32], top_n: int, *,
           scratch: npt.NDArray[np.float32] | None = None) -> LogSoftmax:
        """From one (n_vocab,) row of raw float32 logits; StageError for a bad row or count.
        `scratch`, a float32 array of the row's size the caller keeps, saves allocating (and
        faulting in) one per call."""
        if not (isinstance(logits, np.ndarray) and logits.ndim == 1 and logits.size > 0):
            raise StageError(f"logprobs: logits must be a non-empty 1-D array (n_vocab,), got "
                             f"{getattr(logits, 'shape', type(logits).__name__)}")
        if not 0 <= top_n <= MAX_TOP_LOGPROBS:
            raise StageError(f"logprobs: top_n {top_n} is outside 0..{MAX_TOP_LOGPROBS}")
        row = logits.astype(np.float32, copy=False)
        if scratch is None or scratch.shape != row.shape or scratch.dtype != np.float32:
            scratch = np.empty_like(row)
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            total = float(np.exp(row, out=scratch).sum())
        if _DIRECT_SUM[0] < total < _DIRECT_SUM[1]:
            # No term overflowed, and the sum is large enough that the terms exp underflowed to 0
            # (below 1e-38) weigh nothing beside it: the row needs no shifting by its maximum.
            norm = math.log(total)
        else:
            peak = float(row.max())
            if not math.isfinite(peak):
                raise StageError(f"logprobs: the largest logit is {peak}; expected finite logits")
            np.subtract(row, np.float32(peak), out=scratch)  # (n_vocab,) every term <= 0, so exp <= 1
            norm = peak + math.log(float(np.exp(scratch, out=scratch).sum()))
        top = tuple((index, _value(float(row[index]), norm)) for index in _top_ids(row, min(top_n, row.size)))
        return cls(norm, top, row.size)

    def token(self, token: int, raw_logit: float) -> TokenLogprobs:
        """`token`'s logprobs, given its raw (unchanged) logit."""
        if not 0 <= token < self.n_vocab:
            raise StageError(f"logprobs: token id {token} is outside the vocab [0, {self.n_vocab})")
        return TokenLogprobs(token, _value(raw_logit, self.norm), self.top)


def _value(raw_logit: float, norm: float) -> float:
    return float(np.float32(raw_logit - norm))


def token_logprobs(logits: npt.NDArray[np.float32], token: int, top_n: int, *,
                   scratch: npt.NDArray[np.float32] | None = None) -> TokenLogprobs:
    """The log-softmax of `token` and of the `top_n` (0..20) most likely ids, from one (n_vocab,)
    row of raw float32 logits; StageError for a bad row or id (see `LogSoftmax.of`)."""
    table = LogSoftmax.of(logits, top_n, scratch=scratch)
    if not 0 <= token < table.n_vocab:
        raise StageError(f"logprobs: token id {token} is outside the vocab [0, {table.n_vocab})")
    return table.token(token, float(logits[token]))


def _top_ids(row: npt.NDArray[np.float32], k: int) -> list[int]:
    """The `k` largest logits' ids, largest first, ties to the lowest id; exact.

    A strided sample's k-th largest value is at most the row's k-th largest (the sample is part
    of the row), so every one of the row's top k is >= it: only those candidates are sorted."""
    if k == 0:
        return []
    sample = row[::_SAMPLE_STRIDE]
    if sample.size >= k and row.size > 4 * _SAMPLE_STRIDE * k:
        threshold = np.partition(sample, sample.size - k)[sample.size - k]
        candidates = np.flatnonzero(row >= threshold)
    else:
        candidates = np.arange(row.size)
    order = np.lexsort((candidates, -row[candidates].astype(np.float64)))
    return [int(i) for i in candidates[order[:k]]]
