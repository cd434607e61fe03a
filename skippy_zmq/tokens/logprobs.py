"""Log probabilities of the sampled token and its most likely alternatives (docs/PROTOCOL.md §5,
Logprobs).

The values are the float32 log-softmax of the final stage's raw logits: before the logit bias,
the penalties, the sampling filters and temperature, as llama-server reports them by default.
The normalizer is the float32 sum of exp(logit) in `exp_sum`'s order (16-term column sums, then
their pairwise sum), or of exp(logit - max) when that sum is not in (1e-6, 1e30), where a term
may have overflowed or the underflowed ones may matter; relative error about 1e-7, where a
float64 sum would double the cost. Each value is then rounded to float32 once.

Cost per row of 262,144 logits (docs/BENCHMARKS.md, "Logprobs"): one exp-sum (a max pass only
when that sum is out of range) and, for the alternatives, a look at the exp-sum's 16,384 column
sums and a read of the few columns that can hold one of them; no second pass over the row. A
row summed shifted by its maximum takes its alternatives from one comparison pass against a
threshold drawn from a strided sample instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import ConfigError, StageError
from skippy_zmq.tokens.exp_sum import ExpSum, NumpyExpSum, RowSum, takes_block

MAX_TOP_LOGPROBS = 20
"""Most alternatives one token may report: OpenAI's top_logprobs and llama-server's n_probs limit."""
_SAMPLE_STRIDE = 64  # the threshold sample takes every 64th logit
_DIRECT_SUM = (1e-6, 1e30)  # a sum of exp(logit) in here is used as it is (no shift by the maximum)
_GROUPS = 256  # groups of columns whose maxima give the column-sum bound (`_kth_largest_at_most`)
_SUM_SLACK = 1e-4  # bounds a computed column sum's relative error: 16 float32 adds and exps within a few ulp
_FAR_STRIDE, _FAR_BELOW = 1024, -40.0  # a sample's maximum below -40 sends a row to the shifted sum at once
_MIN_TAU = -80.0  # exp(-80) = 1.8e-35 is a normal float32; below, exp's flush to zero voids the bounds


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
    def of(cls, logits: npt.NDArray[np.float32], top_n: int, *, exp_sum: ExpSum | None = None,
           summed: RowSum | None = None) -> LogSoftmax:
        """From one (n_vocab,) row of raw float32 logits; StageError for a bad row or count.
        `exp_sum`, the normalizer's kernel the caller keeps (default: a new numpy one); `summed`, this
        row's exp-sum already computed with its pass (`pass_sums`)."""
        if not (isinstance(logits, np.ndarray) and logits.ndim == 1 and logits.size > 0):
            raise StageError(f"logprobs: logits must be a non-empty 1-D array (n_vocab,), got "
                             f"{getattr(logits, 'shape', type(logits).__name__)}")
        if not 0 <= top_n <= MAX_TOP_LOGPROBS:
            raise StageError(f"logprobs: top_n {top_n} is outside 0..{MAX_TOP_LOGPROBS}")
        row = np.ascontiguousarray(logits, dtype=np.float32)
        kernel = exp_sum if exp_sum is not None else NumpyExpSum()
        # A row whose sample lies far below 0 would mostly give subnormal exps, several times slower
        # to compute (a speed guess only: either path is exact): it goes to the shifted sum at once.
        if summed is None:
            summed = None if _far_below_zero(row) else RowSum(kernel(row), kernel.columns)
        total = math.nan if summed is None else summed.total
        if _DIRECT_SUM[0] < total < _DIRECT_SUM[1]:
            # No term overflowed, and the sum is large enough that the terms exp underflowed to 0
            # (below 1e-38) weigh nothing beside it: the row needs no shifting by its maximum.
            norm = math.log(total)
            assert summed is not None  # a far row's total is NaN
            ids = _top_ids_by_columns(row, min(top_n, row.size), summed.columns)
        else:
            peak = float(row.max())
            if not math.isfinite(peak):
                raise StageError(f"logprobs: the largest logit is {peak}; expected finite logits")
            shifted = row - np.float32(peak)  # (n_vocab,) every term <= 0, so exp <= 1; a rare path
            norm = peak + math.log(kernel(shifted))
            ids = _top_ids(row, min(top_n, row.size))
        top = tuple((index, _value(float(row[index]), norm)) for index in ids)
        return cls(norm, top, row.size)

    def token(self, token: int, raw_logit: float, top_n: int | None = None) -> TokenLogprobs:
        """`token`'s logprobs, given its raw (unchanged) logit, with the first `top_n` alternatives
        (default: all the table holds)."""
        if not 0 <= token < self.n_vocab:
            raise StageError(f"logprobs: token id {token} is outside the vocab [0, {self.n_vocab})")
        return TokenLogprobs(token, _value(raw_logit, self.norm), self.top if top_n is None else self.top[:top_n])


def post_sampling_logprobs(token: int, ids: npt.NDArray[np.int64], probs: npt.NDArray[np.float64],
                           top_n: int) -> TokenLogprobs:
    """`token`'s logprobs after the sampler's filters: the logs of the probabilities the sampler drew
    it with (`ids` and `probs`, the candidates most probable first, none at 0), the first `top_n` of
    them as the alternatives (docs/PROTOCOL.md §5, Logprobs)."""
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise StageError(f"logprobs: top_n {top_n} is outside 0..{MAX_TOP_LOGPROBS}")
    where = np.flatnonzero(ids == token)
    if not where.size:
        raise StageError(f"logprobs: token {token} is not among the sampler's {ids.size} candidates")
    top = tuple((int(ids[i]), math.log(float(probs[i]))) for i in range(min(top_n, ids.size)))
    return TokenLogprobs(token, math.log(float(probs[where[0]])), top)


def _far_below_zero(row: npt.NDArray[np.float32]) -> bool:
    """Whether the row's strided sample lies far below 0, where most exps would be subnormal."""
    return float(row[::_FAR_STRIDE].max()) < _FAR_BELOW


def pass_sums(block: npt.NDArray[np.float32], wanted: Sequence[int], kernel: ExpSum) -> dict[int, RowSum]:
    """The exp-sums of the rows `wanted` (ascending indices) of a pass's (R, n_vocab) logits, by one
    kernel run per stretch of adjacent rows, for `LogSoftmax.of(..., summed=)`. A row that lies far
    below 0 is left out (its table takes the shifted sum at once), and so is every row of a block
    whose rows are not 16-term column groups end to end (n_vocab not a multiple of 16, or not
    C-contiguous): those rows are summed one by one as before."""
    if not takes_block(block):
        return {}
    rows = [index for index in wanted if not _far_below_zero(block[index])]
    sums: dict[int, RowSum] = {}
    start = 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and rows[end] == rows[end - 1] + 1:
            end += 1
        first = rows[start]
        sums.update(zip(rows[start:end], kernel.rows(block[first:first + end - start]), strict=True))
        start = end
    return sums


def _value(raw_logit: float, norm: float) -> float:
    return float(np.float32(raw_logit - norm))


def token_logprobs(logits: npt.NDArray[np.float32], token: int, top_n: int, *,
                   exp_sum: ExpSum | None = None) -> TokenLogprobs:
    """The log-softmax of `token` and of the `top_n` (0..20) most likely ids, from one (n_vocab,)
    row of raw float32 logits; StageError for a bad row or id (see `LogSoftmax.of`)."""
    table = LogSoftmax.of(logits, top_n, exp_sum=exp_sum)
    if not 0 <= token < table.n_vocab:
        raise StageError(f"logprobs: token id {token} is outside the vocab [0, {table.n_vocab})")
    return table.token(token, float(logits[token]))


def _top_ids_by_columns(row: npt.NDArray[np.float32], k: int, columns: npt.NDArray[np.float32]) -> list[int]:
    """The `k` largest logits' ids, largest first, ties to the lowest id; exact, from the exp-sum's
    column sums (`exp_sum.ExpSum.columns`) of this row, so the row itself is not scanned again.

    A column's true sum lies in [exp(its max), 16 exp(its max)], and the computed one within
    `_SUM_SLACK` of it. So k columns whose sums reach s_k (at most the k-th largest sum) hold k
    distinct logits >= tau = log(s_k / 16), s_k shrunk by the slack: every one of the row's top k is
    >= tau, and sits in a column whose sum is >= exp(tau). Only those few columns (and the row's
    n mod 16 trailing values, which no column holds) are read."""
    width = columns.size
    if k == 0:
        return []
    if width < k:
        return _top_ids(row, k)
    s_k = _kth_largest_at_most(columns, k)
    tau = math.log(s_k * (1 - _SUM_SLACK) / 16) if s_k > 0 else -math.inf
    if tau < _MIN_TAU:  # exp(tau) would be subnormal in float32, where the sums' bounds fail
        return _top_ids(row, k)
    wanted = np.flatnonzero(columns >= math.exp(tau) * (1 - _SUM_SLACK))
    grid = row[:16 * width].reshape(16, width)  # (16, W) the exp-sum's columns
    group, column = np.nonzero(grid[:, wanted] >= tau)
    candidates = np.concatenate([group * width + wanted[column], np.arange(16 * width, row.size)])
    order = np.lexsort((candidates, -row[candidates].astype(np.float64)))
    return [int(i) for i in candidates[order[:k]]]


def _kth_largest_at_most(columns: npt.NDArray[np.float32], k: int) -> float:
    """A value that at least k of `columns` reach: the k-th largest of the maxima of 256 groups
    (column j in group j mod 256), one vector pass instead of a partition of every column; the
    exact k-th largest where there are too few columns for the groups."""
    groups = columns.size // _GROUPS
    if groups < 2 or 4 * k > _GROUPS:
        return float(np.partition(columns, columns.size - k)[columns.size - k])
    maxima = columns[:groups * _GROUPS].reshape(groups, _GROUPS).max(axis=0)  # (256,)
    return float(np.partition(maxima, _GROUPS - k)[_GROUPS - k])


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
