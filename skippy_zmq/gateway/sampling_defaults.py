"""Server-wide request defaults (`serve --seed --temp --top-k --top-p --min-p -n`, llama-server's
names, and `--reasoning`'s thought settings): the values a request that leaves those fields out gets;
socket-free.

Each is None unless given on the command line, and a route then keeps its own default: /completion
llama-server's (`llama_api.NATIVE_DEFAULTS`), the OpenAI routes OpenAI's (temperature 1, no top-k,
top-p or min-p filter, 16 tokens for completions, up to the context for chat). A given one replaces
both, as in llama-server, where the command line's sampling settings are every request's defaults.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from skippy_zmq.errors import ConfigError
from skippy_zmq.gateway.reasoning import DEFAULT_THINKING, Thinking

SEED_LIMIT = 2**64
"""Seeds are 0..2**64 - 1 (-1, llama-server's "random", is None here)."""
_INT32 = 2**31
_SAMPLING_NAMES = ("seed", "temperature", "top_k", "top_p", "min_p", "n_predict")
_TEMPERATURE_BOUND = 1e6  # a request's own temperature has the same bound (carried as a float32)


def _check_range(flag: str, low: float, high: float) -> Any:
    def check(_: object, __: attrs.Attribute[Any], value: float | None) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not low <= value <= high:
            raise ConfigError(f"{flag} {value!r} must be a number in [{low:g}, {high:g}]")

    return check


def _check_seed(_: object, __: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and not 0 <= value < SEED_LIMIT:
        raise ConfigError(f"--seed {value} must be -1 (a random seed per request) or in [0, {SEED_LIMIT - 1}]")


def _seed(value: int | None) -> int | None:
    return None if value == -1 else value  # llama-server's -1: a fresh random seed per request


@attrs.frozen
class SamplingDefaults:
    """What a request leaving a sampling field out gets (None: the route's own default)."""

    seed: int | None = attrs.field(default=None, converter=_seed, validator=_check_seed)
    temperature: float | None = attrs.field(default=None,
                                            validator=_check_range("--temp", -_TEMPERATURE_BOUND, _TEMPERATURE_BOUND))
    top_k: int | None = attrs.field(default=None, validator=_check_range("--top-k", -_INT32, _INT32 - 1))
    top_p: float | None = attrs.field(default=None, validator=_check_range("--top-p", 0.0, 1.0))
    min_p: float | None = attrs.field(default=None, validator=_check_range("--min-p", 0.0, 1.0))
    n_predict: int | None = attrs.field(default=None, validator=_check_range("-n/--n-predict", -1, _INT32 - 1))
    # --reasoning, --reasoning-format, --chat-template-kwargs: a chat request's thought (gateway/reasoning.py)
    thinking: Thinking = DEFAULT_THINKING

    def given(self) -> dict[str, Any]:
        """The sampling defaults given on the command line, by llama-server's request field names."""
        return {name: value for name in _SAMPLING_NAMES if (value := getattr(self, name)) is not None}

    def over(self, fallbacks: Mapping[str, Any]) -> dict[str, Any]:
        """`fallbacks` (a route's own defaults, by field name) with the given defaults in their place."""
        return {**fallbacks, **self.given()}

    def max_tokens(self) -> int | None:
        """The default length of a request that gives none (-1 or not given: the route's own)."""
        return None if self.n_predict is None or self.n_predict < 0 else self.n_predict


NO_DEFAULTS = SamplingDefaults()
"""Nothing given: every route keeps its own defaults."""
