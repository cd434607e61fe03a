"""`SchedulerSettings`: how a driver schedules sessions on a pipeline, one value from the command
that was asked (`serve`, `generate`) down to the scheduler, through the serving engine and the
transport untouched. Socket-free; imports nothing of the driver.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import attrs

from skippy_zmq import defaults
from skippy_zmq.errors import ConfigError
from skippy_zmq.wire.messages import MAX_DRAFT_TOKENS

_T = TypeVar("_T")
_Validator = Callable[[Any, "attrs.Attribute[_T]", _T], None]

MAX_GATHER_S = 1.0
"""The longest gather window a scheduler takes (`gather_max_s`): it delays a new request's first token."""


def _check_count(minimum: int, what: str, most: int | None = None) -> _Validator[int]:
    expected = f"from {minimum} to {most}" if most is not None else f"of at least {minimum}"
    highest = math.inf if most is None else most

    def check(_: object, attribute: attrs.Attribute[int], value: int) -> None:
        if not (isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= highest):
            raise ConfigError(f"scheduler settings: {attribute.name} {value!r} must be an integer {expected} ({what})")

    return check


def _check_seconds(*, zero: bool, most: float = math.inf) -> _Validator[float]:
    expected = f"between 0 and {most:g}" if most < math.inf else (">= 0" if zero else "> 0")

    def check(_: object, attribute: attrs.Attribute[float], value: float) -> None:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and (value >= 0 if zero else value > 0) and value <= most):
            raise ConfigError(f"scheduler settings: {attribute.name} {value!r} must be a number of seconds {expected}")

    return check


def _check_bool(_: object, attribute: attrs.Attribute[bool], value: bool) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"scheduler settings: {attribute.name} {value!r} must be true or false")


class ServeScheduling(Protocol):
    """What `serve` was asked for that its scheduler settings come from (gateway/options.py `ServeOptions`)."""

    @property
    def max_queue(self) -> int:
        """`--max-queue`."""

    @property
    def request_timeout_s(self) -> float:
        """`--request-timeout`."""

    @property
    def prefill_chunk(self) -> int:
        """`--prefill-chunk`."""

    @property
    def micro_batches(self) -> int:
        """`--micro-batches`."""

    @property
    def recovery_timeout_s(self) -> float:
        """`--recovery-timeout`."""

    @property
    def cache_prompt(self) -> bool:
        """`--cache-prompt/--no-cache-prompt`."""

    @property
    def draft_max(self) -> int | None:
        """`--draft-max` (None: the pipeline's own, SchedulerSettings.draft_max)."""


@attrs.frozen
class SchedulerSettings:
    """How a driver schedules sessions on a pipeline; the defaults are a batch run's (`generate`'s)."""

    max_queue: int = attrs.field(default=defaults.MAX_QUEUE, validator=_check_count(0, "requests waiting for a lane"))
    request_timeout_s: float = attrs.field(default=defaults.REQUEST_TIMEOUT_S, validator=_check_seconds(zero=False))
    prefill_chunk: int = attrs.field(default=defaults.PREFILL_CHUNK,
                                     validator=_check_count(1, "prompt tokens per prefill message"))
    micro_batches: int = attrs.field(default=1, validator=_check_count(1, "groups the live sessions are split into"))
    reply_timeout_s: float = attrs.field(default=defaults.REPLY_TIMEOUT_S, validator=_check_seconds(zero=False))
    # A stage that sent no heartbeat for this long while a request waits is reported dead.
    silence_s: float = attrs.field(default=15.0, validator=_check_seconds(zero=False))
    recovery_timeout_s: float = attrs.field(default=defaults.RECOVERY_TIMEOUT_S, validator=_check_seconds(zero=True))
    # How long an idle pipeline holds a new request for others arriving with it (scheduler.py `BurstGate`).
    gather_max_s: float = attrs.field(default=0.0, validator=_check_seconds(zero=True, most=MAX_GATHER_S))
    cache_prompts: bool = attrs.field(default=False, validator=_check_bool)  # finished sessions stay on the stages
    # Most n-gram drafts a decode step carries, for a request that names none (0: one token a step; speculation.py);
    # None: defaults.DRAFT_MAX while every stage's heartbeat says it computes batch-invariantly, else 0
    draft_max: int | None = attrs.field(default=None, validator=attrs.validators.optional(
        _check_count(0, "drafts a decode step carries", most=MAX_DRAFT_TOKENS)))

    @classmethod
    def from_serve(cls, options: ServeScheduling) -> SchedulerSettings:
        """`serve`'s settings from its options. Its requests arrive over time, so an idle pipeline
        holds the first a moment for others arriving with it (`defaults.GATHER_MAX_S`); a batch
        run submits all of its prompts at once and needs no such wait."""
        return cls(max_queue=options.max_queue, request_timeout_s=options.request_timeout_s,
                   prefill_chunk=options.prefill_chunk, micro_batches=options.micro_batches,
                   recovery_timeout_s=options.recovery_timeout_s, gather_max_s=defaults.GATHER_MAX_S,
                   cache_prompts=options.cache_prompt, draft_max=options.draft_max)
