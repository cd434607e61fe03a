"""Next-token sampling: repeat penalty, greedy, top-k, top-p, min-p, temperature, seeded draw.

The chain follows llama.cpp's common sampler: repeat penalty over the last `penalty_last_n`
history tokens -> greedy when temperature is 0 -> top-k -> top-p -> min-p -> temperature ->
a seeded draw. Top-p and min-p see the logits before temperature scaling, as in llama.cpp.

The draw holds no hidden generator state: the uniform behind the token at position p (p =
len(history) when it is drawn, the prompt included) is `uniform(seed, p)`, numpy's Philox4x64
counter-based generator keyed by the seed with its counter set to p. A draw costs 12.7 µs
(`python3 -m timeit -s "from skippy_zmq.runtime.sampling import uniform" "uniform(1234, 57)"`).
A session replayed elsewhere, with its prompt plus the tokens generated so far as the new prompt,
therefore draws the same numbers and picks the same tokens as the uninterrupted run. A seed
reproduces skippy-zmq's tokens, not llama.cpp's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import ConfigError, NonFiniteLogits, StageError

_U64_LIMIT = 2**64


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_temperature(_: object, __: attrs.Attribute[float], value: float) -> None:
    if not (_is_real(value) and value >= 0):
        raise ConfigError(f"sampling: temperature {value!r} must be a finite number >= 0 (0 = greedy)")


def _check_top_k(_: object, __: attrs.Attribute[int], value: int) -> None:
    if not (_is_int(value) and value >= 0):
        raise ConfigError(f"sampling: top_k {value!r} must be an integer >= 0 (0 = disabled)")


def _check_top_p(_: object, __: attrs.Attribute[float], value: float) -> None:
    if not (_is_real(value) and 0 < value <= 1):
        raise ConfigError(f"sampling: top_p {value!r} must be a number in (0, 1] (1 = disabled)")


def _check_min_p(_: object, __: attrs.Attribute[float], value: float) -> None:
    if not (_is_real(value) and 0 <= value <= 1):
        raise ConfigError(f"sampling: min_p {value!r} must be a number in [0, 1] (0 = disabled)")


def _check_repeat_penalty(_: object, __: attrs.Attribute[float], value: float) -> None:
    if not (_is_real(value) and value > 0):
        raise ConfigError(f"sampling: repeat_penalty {value!r} must be a finite number > 0 (1 = disabled)")


def _check_penalty_last_n(_: object, __: attrs.Attribute[int], value: int) -> None:
    if not (_is_int(value) and value >= -1):
        raise ConfigError(f"sampling: penalty_last_n {value!r} must be an integer >= 0, or -1 for the whole history")


def _check_seed(_: object, __: attrs.Attribute[int], value: int) -> None:
    if not (_is_int(value) and 0 <= value < _U64_LIMIT):
        raise ConfigError(f"sampling: seed {value!r} must be an integer in [0, 2**64)")


def _check_ignore_eos(_: object, __: attrs.Attribute[bool], value: bool) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"sampling: ignore_eos {value!r} must be a bool")


@attrs.frozen
class SamplingParams:
    """How a session picks its next token (defaults: greedy, no penalty)."""

    temperature: float = attrs.field(default=0.0, validator=_check_temperature)
    top_k: int = attrs.field(default=0, validator=_check_top_k)
    top_p: float = attrs.field(default=1.0, validator=_check_top_p)
    min_p: float = attrs.field(default=0.0, validator=_check_min_p)
    repeat_penalty: float = attrs.field(default=1.0, validator=_check_repeat_penalty)
    penalty_last_n: int = attrs.field(default=64, validator=_check_penalty_last_n)
    seed: int = attrs.field(default=0, validator=_check_seed)
    ignore_eos: bool = attrs.field(default=False, validator=_check_ignore_eos)

    @classmethod
    def greedy(cls) -> SamplingParams:
        """Argmax of the logits, ties to the lowest id."""
        return cls()

    @property
    def is_greedy(self) -> bool:
        """Whether the token is the argmax of the (penalized) logits."""
        return self.temperature == 0.0


def uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) behind the draw at `position` of a session seeded with `seed`."""
    # Philox is counter-based: keying it by the seed and setting its counter to the position
    # makes the number a pure function of the two, whatever was drawn before.
    return float(np.random.Generator(np.random.Philox(key=seed, counter=position)).random())


class Sampler:
    """Samples the tokens of one session; its draws depend only on the seed and the position."""

    def __init__(self, params: SamplingParams, *, eog_ids: Iterable[int] = ()) -> None:
        """Sampler for `params`; with `params.ignore_eos`, the `eog_ids` are never picked."""
        self.params = params
        self._banned = np.array(sorted(set(eog_ids)) if params.ignore_eos else [], dtype=np.int64)

    def sample(self, logits: npt.NDArray[np.float32], history: Sequence[int], *, scratch: bool = False) -> int:
        """Next token id from float32 (n_vocab,) logits; `history` is the session's tokens so far
        (prompt included): its length is the position that picks the draw's uniform. With
        `scratch`, the caller will not read `logits` again and the sampler may change them."""
        params = self.params
        scores = self._adjusted(logits, history, scratch)  # (n_vocab,)
        if params.is_greedy:
            return _argmax(scores)
        ids, values = _top_k(scores, params.top_k)
        if params.top_p < 1.0:
            ids, values = _top_p(ids, values, params.top_p)
        if params.min_p > 0.0:
            keep = values >= values.max() + np.float32(math.log(params.min_p))
            ids, values = ids[keep], values[keep]
        return _draw(ids, values / params.temperature, uniform(params.seed, len(history)))

    def _adjusted(self, logits: npt.NDArray[np.float32], history: Sequence[int], scratch: bool
                  ) -> npt.NDArray[np.float32]:
        """Logits after ignore_eos and the repeat penalty (a copy only when something changes,
        and none when the caller handed them over as scratch)."""
        if not (isinstance(logits, np.ndarray) and logits.ndim == 1 and logits.size > 0):
            shape = getattr(logits, "shape", type(logits).__name__)
            raise StageError(f"sampler: logits must be a non-empty 1-D array (n_vocab,), got {shape}")
        n_vocab = logits.shape[0]
        scores = logits.astype(np.float32, copy=False)
        params = self.params
        last_n = len(history) if params.penalty_last_n == -1 else params.penalty_last_n
        penalize = params.repeat_penalty != 1.0 and last_n > 0 and len(history) > 0
        if not (penalize or self._banned.size):
            return scores
        if not (scratch and scores is logits):
            scores = scores.copy()
        if self._banned.size:
            scores[self._banned[self._banned < n_vocab]] = -np.inf
        if penalize:
            recent = np.unique(np.asarray(history[-last_n:], dtype=np.int64))
            if recent[0] < 0 or recent[-1] >= n_vocab:
                bad = recent[0] if recent[0] < 0 else recent[-1]
                raise StageError(f"sampler: history token id {bad} is outside the vocab [0, {n_vocab})")
            # llama.cpp: a positive logit is divided by the penalty, a zero or negative one multiplied.
            values = scores[recent]
            penalty = np.float32(params.repeat_penalty)
            scores[recent] = np.where(values <= 0, values * penalty, values / penalty)
        return scores


def _draw(ids: npt.NDArray[np.int64], values: npt.NDArray[np.float32], u: float) -> int:
    """The token where `u` falls in the cumulative softmax(values) over `ids`, in ascending id
    order so paths agree."""
    if ids.size > 1 and not bool(np.all(ids[1:] > ids[:-1])):
        order = np.argsort(ids)
        ids, values = ids[order], values[order]
    weights = np.exp(values - values.max())
    cumulative = np.cumsum(weights, dtype=np.float64)
    index = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    return int(ids[min(index, ids.size - 1)])


def _argmax(scores: npt.NDArray[np.float32]) -> int:
    """Index of the largest logit (ties: lowest id); refuses NaN, +inf and all -inf logits."""
    index = int(np.argmax(scores))  # np.argmax stops at the first NaN, so NaN shows up here
    best = float(scores[index])
    if math.isnan(best) or best == math.inf:
        raise NonFiniteLogits(
            f"sampler: logit of token {index} is {best}; expected finite logits: the model's weights may be "
            "damaged; restart the stages with --check-tensors to scan them (docs/PROTOCOL.md §7)")
    if best == -math.inf:
        raise StageError("sampler: every token has logit -inf; nothing can be sampled")
    return index


def _top_k(scores: npt.NDArray[np.float32], top_k: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """The ids and values of the top_k largest logits (all when top_k is 0 or >= n_vocab)."""
    _argmax(scores)  # rejects NaN or all -inf logits before any filtering
    n_vocab = scores.shape[0]
    if top_k == 0 or top_k >= n_vocab:
        return np.arange(n_vocab, dtype=np.int64), scores
    # O(n_vocab) selection, no full sort; ties at the cut go to the lowest ids, as greedy's do.
    threshold = np.partition(scores, n_vocab - top_k)[n_vocab - top_k]
    above = np.flatnonzero(scores > threshold)
    tied = np.flatnonzero(scores == threshold)[: top_k - above.size]
    ids = np.concatenate((above, tied)).astype(np.int64)
    return ids, scores[ids]


def _top_p(
    ids: npt.NDArray[np.int64], values: npt.NDArray[np.float32], top_p: float
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Smallest prefix (by logit desc, id asc) of the candidates whose probability mass is >= top_p."""
    weights = np.exp(values - values.max())  # (n,) unnormalized probabilities
    total = float(weights.sum(dtype=np.float64))
    # Tokens lighter than `floor` weigh less than (1 - top_p) together, so the rest already
    # holds top_p of the mass and contains the whole nucleus: sort only those.
    floor = (1.0 - top_p) / weights.size * total
    chosen = np.flatnonzero(weights >= floor)
    chosen = chosen[np.lexsort((ids[chosen], -values[chosen]))]
    cumulative = np.cumsum(weights[chosen], dtype=np.float64) / total
    cut = int(np.searchsorted(cumulative, top_p, side="left"))
    keep = chosen[: cut + 1]
    return ids[keep], values[keep]
