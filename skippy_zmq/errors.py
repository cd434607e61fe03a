"""The one exception hierarchy of skippy-zmq."""

from __future__ import annotations


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


class TokenizerError(SkippyError, ValueError):
    """Text or ids cannot be tokenized or detokenized."""


class StageError(SkippyError, RuntimeError):
    """A stage cannot execute or forward a message."""


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


class QueueFull(SkippyError, RuntimeError):
    """The serving queue holds as many waiting requests as it may: try again later."""


class EngineUnavailable(SkippyError, RuntimeError):
    """The pipeline is not serving: still starting, draining for shutdown, or closed."""


class RequestTimeout(SkippyError, TimeoutError):
    """A request did not finish before its deadline."""


class RequestCancelled(SkippyError, RuntimeError):
    """A request was cancelled by its client (it disconnected or asked to)."""
