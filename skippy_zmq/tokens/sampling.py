"""Next-token sampling: logit bias, penalties, greedy, top-k, top-p, min-p, temperature, seeded draw.

The chain follows llama.cpp's common sampler: logit bias -> repeat penalty over the last
`penalty_last_n` history tokens -> OpenAI's presence and frequency penalties over the tokens
generated so far -> greedy when temperature is 0 -> top-k -> top-p -> min-p -> temperature ->
a seeded draw. Top-p and min-p see the logits before temperature scaling, as in llama.cpp.

The draw holds no hidden generator state: the uniform behind the token at position p (p =
len(history) when it is drawn, the prompt included) is `uniform(seed, p)`, numpy's Philox4x64
counter-based generator keyed by the seed with its counter set to p. A draw costs 12.7 µs
(`python3 -m timeit -s "from skippy_zmq.tokens.sampling import uniform" "uniform(1234, 57)"`).
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

from skippy_zmq import defaults
from skippy_zmq.errors import ConfigError, NonFiniteLogits, StageError

_U64_LIMIT = 2**64
MAX_LOGIT_BIAS = 1024
"""Most token ids one request may bias (docs/PROTOCOL.md §2.6: the options part stays bounded)."""
LOGIT_BIAS_RANGE = (-100.0, 100.0)
"""OpenAI's bounds of one bias; -100 bans a token, 100 all but forces it."""
PENALTY_RANGE = (-2.0, 2.0)
"""OpenAI's bounds of presence_penalty and frequency_penalty."""


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


def _check_penalty(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    low, high = PENALTY_RANGE
    if not (_is_real(value) and low <= value <= high):
        raise ConfigError(f"sampling: {attribute.name} {value!r} must be a number in [{low:g}, {high:g}] "
                          "(0 = disabled)")


def _check_logit_bias(_: object, __: attrs.Attribute[tuple[tuple[int, float], ...]],
                      value: tuple[tuple[int, float], ...]) -> None:
    if not isinstance(value, tuple) or len(value) > MAX_LOGIT_BIAS:
        size = len(value) if isinstance(value, tuple) else type(value).__name__
        raise ConfigError(f"sampling: logit_bias has {size} entries; expected a tuple of at most "
                          f"{MAX_LOGIT_BIAS} (token id, bias) pairs")
    low, high = LOGIT_BIAS_RANGE
    previous = -1
    for entry in value:
        if not (isinstance(entry, tuple) and len(entry) == 2 and _is_int(entry[0]) and _is_real(entry[1])):
            raise ConfigError(f"sampling: logit_bias entry {entry!r} must be a (token id, bias) pair")
        token, bias = entry
        if token <= previous:
            raise ConfigError(f"sampling: logit_bias token id {token} is out of order or repeated; "
                              "expected ids in strictly ascending order, each >= 0")
        if not low <= bias <= high:
            raise ConfigError(f"sampling: logit_bias of token {token} is {bias!r}; expected a number in "
                              f"[{low:g}, {high:g}]")
        previous = token


def _as_bias(value: object) -> object:
    """An attrs converter: a mapping or pairs of (token id, bias) as pairs sorted by id (the
    validator then checks them; what cannot be sorted is left for it to refuse)."""
    items = value.items() if isinstance(value, dict) else value
    try:
        return tuple(sorted(tuple(pair) for pair in items))  # type: ignore[attr-defined]
    except TypeError:
        return value


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
    penalty_last_n: int = attrs.field(default=defaults.REPEAT_LAST_N, validator=_check_penalty_last_n)
    seed: int = attrs.field(default=0, validator=_check_seed)
    ignore_eos: bool = attrs.field(default=False, validator=_check_ignore_eos)
    presence_penalty: float = attrs.field(default=0.0, validator=_check_penalty)
    frequency_penalty: float = attrs.field(default=0.0, validator=_check_penalty)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_as_bias,
                                                          validator=_check_logit_bias)

    @classmethod
    def greedy(cls) -> SamplingParams:
        """Argmax of the logits, ties to the lowest id."""
        return cls()

    @property
    def is_greedy(self) -> bool:
        """Whether the token is the argmax of the (penalized) logits."""
        return self.temperature == 0.0


@attrs.frozen(eq=False)
class Candidates:
    """The ids a sampler drew its token from and their probabilities, most probable first (ties:
    lowest id first); ids whose probability rounds to 0 are left out."""

    ids: npt.NDArray[np.int64]
    probs: npt.NDArray[np.float64]

    @classmethod
    def only(cls, token: int) -> Candidates:
        """A greedy pick: the token alone, at probability 1."""
        return cls(np.array([token], dtype=np.int64), np.ones(1, dtype=np.float64))

    @classmethod
    def of(cls, ids: npt.NDArray[np.int64], scaled: npt.NDArray[np.float32]) -> Candidates:
        """softmax(`scaled`) over `ids` (the values already divided by the temperature), sorted."""
        weights = np.exp(scaled.astype(np.float64) - float(scaled.max()))  # (n,) the largest is 1
        probs = weights / weights.sum()
        order = np.lexsort((ids, -probs))
        order = order[probs[order] > 0.0]
        return cls(ids[order].astype(np.int64), probs[order])


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
        self._bias_ids = np.array([token for token, _ in params.logit_bias], dtype=np.int64)
        self._bias_values = np.array([bias for _, bias in params.logit_bias], dtype=np.float32)

    def sample(self, logits: npt.NDArray[np.float32], history: Sequence[int], *, scratch: bool = False,
               prompt_tokens: int = 0, work: npt.NDArray[np.float32] | None = None,
               allowed: npt.NDArray[np.int32] | None = None) -> int:
        """Next token id from float32 (n_vocab,) logits; `history` is the session's tokens so far
        (prompt included): its length is the position that picks the draw's uniform, and the
        tokens after its first `prompt_tokens` are the generated ones the presence and frequency
        penalties count. With `scratch`, the caller will not read `logits` again and the sampler
        may change them; otherwise the changed logits go to `work` (a float32 row of the same size
        the caller keeps) when given, else to a copy. `allowed`, a constraint's bitmask (bit i of
        word i // 32 for id i), removes every other id before the chain (llama.cpp's grammar first)."""
        return self._run(logits, history, scratch, prompt_tokens, work, allowed, candidates=False)[0]

    def sample_candidates(self, logits: npt.NDArray[np.float32], history: Sequence[int], *, scratch: bool = False,
                          prompt_tokens: int = 0, work: npt.NDArray[np.float32] | None = None,
                          allowed: npt.NDArray[np.int32] | None = None) -> tuple[int, Candidates]:
        """`sample`'s pick (the same token) and the candidates it was drawn from: the ids the filters kept
        with their probabilities, softmax(logit / temperature) over those ids alone (llama.cpp's
        probabilities after its sampler chain); a greedy sampler's only candidate is its pick, at 1."""
        token, candidates = self._run(logits, history, scratch, prompt_tokens, work, allowed, candidates=True)
        assert candidates is not None
        return token, candidates

    def _run(self, logits: npt.NDArray[np.float32], history: Sequence[int], scratch: bool, prompt_tokens: int,
             work: npt.NDArray[np.float32] | None, allowed: npt.NDArray[np.int32] | None, *,
             candidates: bool) -> tuple[int, Candidates | None]:
        scores = self._adjusted(logits, history, scratch, prompt_tokens, work)  # (n_vocab,)
        if allowed is not None:
            keep = np.unpackbits(allowed.view(np.uint8), bitorder="little", count=scores.shape[0])  # (n_vocab,) 0/1
            count = int(np.count_nonzero(keep))
            if count * _FEW_ALLOWED < keep.size:  # a few ids: read only those
                ids = np.flatnonzero(keep)
                if ids.size == 0:
                    raise StageError("sampler: the constraint allows no token here")
                return self._pick(ids, scores[ids], len(history), candidates)
            # Most ids (inside a JSON string, say): the row with the others at -inf is cheaper.
            scores = _writable(scores, logits, scratch, work)
            np.copyto(scores, np.float32(-np.inf), where=keep == 0)
        return self._pick(None, scores, len(history), candidates)

    def _pick(self, ids: npt.NDArray[np.int64] | None, scores: npt.NDArray[np.float32], position: int,
              candidates: bool) -> tuple[int, Candidates | None]:
        """The pick among candidates `ids` (ascending; None: every id) with logits `scores`: the argmax
        when greedy, else top-k, top-p, min-p and the draw; and, when asked, the candidates it was
        drawn from with their probabilities."""
        params = self.params
        if params.is_greedy:
            index = _argmax(scores)
            token = index if ids is None else int(ids[index])
            return token, (Candidates.only(token) if candidates else None)
        kept, values = _top_k(scores, params.top_k)
        ids = kept if ids is None else ids[kept]
        if params.top_p < 1.0:
            ids, values = _top_p(ids, values, params.top_p)
        if params.min_p > 0.0:
            keep = values >= values.max() + np.float32(math.log(params.min_p))
            ids, values = ids[keep], values[keep]
        scaled = values / params.temperature
        token = _draw(ids, scaled, uniform(params.seed, position))
        return token, (Candidates.of(ids, scaled) if candidates else None)

    @property
    def greedy_depth(self) -> int:
        """How many of the raw logits' largest ids decide this sampler's pick (`greedy_from_top`):
        one more than the banned ids for a greedy sampler without a logit bias, else 0."""
        if not self.params.is_greedy or self.params.logit_bias:
            return 0
        return int(self._banned.size) + 1

    def greedy_from_top(self, top: Sequence[int], history: Sequence[int], prompt_tokens: int = 0) -> int | None:
        """`sample`'s pick without another pass over the row, from the raw logits' largest ids in
        order (`top`, ties to the lowest id, the row finite): the first that is not banned, for a
        greedy sampler whose only change to the row is the banned ids. None when the bias or a
        penalty applies to this history, or when every id in `top` is banned."""
        params = self.params
        last_n = len(history) if params.penalty_last_n == -1 else params.penalty_last_n
        penalized = (params.repeat_penalty != 1.0 and last_n > 0 and len(history) > 0) or (
            (params.presence_penalty or params.frequency_penalty) and len(history) > prompt_tokens)
        if self.greedy_depth == 0 or penalized:
            return None
        banned = set(self._banned.tolist())
        return next((token for token in top if token not in banned), None)

    def touched(self, history: Sequence[int], prompt_tokens: int = 0) -> npt.NDArray[np.int64]:
        """Every id whose logit `sample` may change for this history (bias, banned end-of-generation
        ids, penalized ids): a caller that needs raw logits after sampling in place saves these."""
        params = self.params
        parts = [self._bias_ids, self._banned]
        last_n = len(history) if params.penalty_last_n == -1 else params.penalty_last_n
        if params.repeat_penalty != 1.0 and last_n > 0 and history:
            parts.append(np.asarray(history[-last_n:], dtype=np.int64))
        if params.presence_penalty or params.frequency_penalty:
            parts.append(np.asarray(history[prompt_tokens:], dtype=np.int64))
        return np.unique(np.concatenate(parts))

    def _adjusted(self, logits: npt.NDArray[np.float32], history: Sequence[int], scratch: bool,
                  prompt_tokens: int = 0, work: npt.NDArray[np.float32] | None = None) -> npt.NDArray[np.float32]:
        """Logits after ignore_eos, the logit bias and the penalties (a copy only when something
        changes, and none when the caller handed them over as scratch)."""
        if not (isinstance(logits, np.ndarray) and logits.ndim == 1 and logits.size > 0):
            shape = getattr(logits, "shape", type(logits).__name__)
            raise StageError(f"sampler: logits must be a non-empty 1-D array (n_vocab,), got {shape}")
        n_vocab = logits.shape[0]
        scores = logits.astype(np.float32, copy=False)
        params = self.params
        last_n = len(history) if params.penalty_last_n == -1 else params.penalty_last_n
        penalize = params.repeat_penalty != 1.0 and last_n > 0 and len(history) > 0
        generated = history[prompt_tokens:] if (params.presence_penalty or params.frequency_penalty) else ()
        if not (penalize or self._banned.size or params.logit_bias or len(generated)):
            return scores
        if not (scratch and scores is logits):
            if work is not None and work.shape == scores.shape and work.dtype == np.float32 and work is not logits:
                np.copyto(work, scores)
                scores = work
            else:
                scores = scores.copy()
        if params.logit_bias:
            ids, biases = self._bias_ids, self._bias_values
            if ids[-1] >= n_vocab:
                raise StageError(f"sampler: logit_bias names token id {int(ids[-1])}, outside the vocab [0, {n_vocab})")
            scores[ids] += biases
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
        if len(generated):
            _presence_frequency(scores, generated, params.presence_penalty, params.frequency_penalty)
        return scores


def _presence_frequency(scores: npt.NDArray[np.float32], generated: Sequence[int], presence: float,
                        frequency: float) -> None:
    """OpenAI's penalties in place: logit[j] -= count[j] * frequency + (count[j] > 0) * presence,
    count[j] being how often token j was generated so far (the prompt does not count)."""
    ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
    if ids[0] < 0 or ids[-1] >= scores.shape[0]:
        bad = ids[0] if ids[0] < 0 else ids[-1]
        raise StageError(f"sampler: generated token id {bad} is outside the vocab [0, {scores.shape[0]})")
    scores[ids] -= (counts * np.float32(frequency) + np.float32(presence)).astype(np.float32)


_FEW_ALLOWED = 4
"""A constraint that allows fewer than n_vocab / this many ids is sampled among them alone."""


def _writable(scores: npt.NDArray[np.float32], logits: npt.NDArray[np.float32], scratch: bool,
              work: npt.NDArray[np.float32] | None) -> npt.NDArray[np.float32]:
    """`scores` where the sampler may write: itself when it is already a copy or the caller's scratch,
    else a copy in `work` (when it fits) or a new one."""
    if scores is not logits or scratch:
        return scores
    if work is not None and work.shape == scores.shape and work.dtype == np.float32 and work is not logits:
        np.copyto(work, scores)
        return work
    return scores.copy()


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
