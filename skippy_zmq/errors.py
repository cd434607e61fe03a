"""The one exception hierarchy of skippy-zmq."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class SkippyError(Exception):
    """Base class of every error skippy-zmq raises on purpose."""


class ConfigError(SkippyError, ValueError):
    """A topology or stage configuration is invalid."""


class WireError(SkippyError, ValueError):
    """A message or reply does not follow the wire format."""


class LimitError(WireError):
    """A wire value exceeds a protocol limit (docs/PROTOCOL.md §2.5)."""


class FrameError(WireError):
    """An activation frame or part descriptor is invalid."""


class CodecError(SkippyError, ValueError):
    """An activation codec cannot encode or decode the given values."""


class CodecMismatchError(CodecError):
    """A frame uses a codec that the receiving stage's policy does not admit."""


class ModelLoadError(SkippyError, RuntimeError):
    """A model file cannot be loaded (missing package, bad file, unknown architecture)."""


class CorruptTensorError(ModelLoadError):
    """A tensor of the model file holds a NaN or Inf value or block scale (`--check-tensors`)."""


class TokenizerError(SkippyError, ValueError):
    """Text or ids cannot be tokenized or detokenized."""


class StageError(SkippyError, RuntimeError):
    """A stage cannot execute or forward a message."""


class NonFiniteLogits(StageError):
    """The final stage computed a NaN or +Inf logit: corrupt weights, or activations out of range."""


class SessionError(StageError):
    """A session is unknown, out of position or over the lane limit."""


class StageTimeout(SkippyError, TimeoutError):
    """A reply did not arrive before its deadline."""


class RemoteStageError(SkippyError, RuntimeError):
    """A stage answered a request with an Error reply."""


class StageRefused(StageTimeout):
    """Stage 0 did not take a message within the send timeout: its queue stayed full or it is gone."""


class RequestError(SkippyError, ValueError):
    """A generation request cannot run: its prompt is empty or leaves no room to generate."""


class RequestJsonError(RequestError):
    """A request body or frame is not JSON a request may hold: not UTF-8, not JSON, or text that is
    not valid Unicode (a lone surrogate); `param` names the field when there is one."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFull(SkippyError, RuntimeError):
    """The serving queue holds as many waiting requests as it may: try again later."""


class EngineUnavailable(SkippyError, RuntimeError):
    """The pipeline is not serving: still starting, draining for shutdown, or closed."""


class RequestTimeout(SkippyError, TimeoutError):
    """A request did not finish before its deadline."""


class RequestCancelled(SkippyError, RuntimeError):
    """A request was cancelled by its client (it disconnected or asked to)."""


class GatewayError(SkippyError):
    """The gateway's request API answered with an error frame (docs/PROTOCOL.md §8.3)."""

    def __init__(
        self, message: str, *, code: int = 500, kind: str = "internal_error",
        param: str | None = None, request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code  # HTTP-like status of the error frame
        self.kind = kind  # the frame's stable "error" string
        self.param = param  # the request field at fault, when one is
        self.request_id = request_id


class GatewayRequestError(GatewayError, RequestError):
    """The gateway refused a request as malformed (400, 404, 409, 413)."""


class GatewayBusy(GatewayError, QueueFull):
    """The gateway's queue, or this client's share of it, is full (429): retry later."""


class GatewayUnavailable(GatewayError, EngineUnavailable):
    """The gateway's pipeline is starting, draining or lost a stage (503): retry later."""


class GatewayTimeout(GatewayError, RequestTimeout):
    """A request passed its deadline at the gateway (504), or the gateway did not answer in time."""


class GatewayCancelled(GatewayError, RequestCancelled):
    """The gateway ended a request because it was cancelled (499)."""


class ChatTemplateError(SkippyError, RuntimeError):
    """A chat template cannot be compiled or rendered: bad syntax, an undefined name, a sandbox violation."""


class SecurityError(ConfigError):
    """A CURVE key file is missing, unreadable, malformed or too widely readable."""


class LaneLimitError(SessionError):
    """Every lane of a stage is held by a live session: a new session is refused."""


class DriverReplacedError(SessionError):
    """A message from a driver process that a newer incarnation of the same driver replaced."""


class BenchError(SkippyError, RuntimeError):
    """A benchmark cannot run or its figures do not count: a server that does not start, requests that failed."""


class TableError(SkippyError, LookupError):
    """A table that needs one row per member of an enum (a message kind, say) lacks one or has a stray row."""


def check_rows(table: Mapping[Any, object], members: Iterable[Any], what: str) -> None:
    """Raise TableError at import when `table` (named `what`) has no row for some member, or a stray one."""
    expected = list(members)
    missing = [m for m in expected if m not in table]
    stray = [k for k in table if k not in expected]
    if missing or stray:
        raise TableError(
            f"{what}: "
            + "; ".join(part for part in (
                f"no row for {', '.join(_member(m) for m in missing)}" if missing else "",
                f"rows for {', '.join(str(k) for k in stray)}, which are not members" if stray else "",
            ) if part)
            + "; every member needs exactly one row"
        )


def _member(member: Any) -> str:
    """An enum member as `NAME (value)`, anything else as itself."""
    name = getattr(member, "name", None)
    return f"{name} ({member.value})" if isinstance(name, str) else str(member)
