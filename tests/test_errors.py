"""The one exception hierarchy: every error is a SkippyError and the builtin its callers expect."""

from __future__ import annotations

import inspect

import pytest

from skippy_zmq import errors

CLASSES = [cls for _, cls in inspect.getmembers(errors, inspect.isclass) if cls.__module__ == errors.__name__]
BUILTINS = (ValueError, RuntimeError, TimeoutError, LookupError)


def test_every_error_of_the_package_is_a_skippy_error_with_a_docstring() -> None:
    assert errors.SkippyError in CLASSES and len(CLASSES) > 20
    for cls in CLASSES:
        assert issubclass(cls, errors.SkippyError), cls
        assert (cls.__doc__ or "").strip(), f"{cls.__name__} has no docstring"


@pytest.mark.parametrize("cls", [c for c in CLASSES if c is not errors.SkippyError and c is not errors.GatewayError],
                         ids=lambda c: c.__name__)
def test_every_concrete_error_is_also_the_builtin_a_caller_catches(cls: type[Exception]) -> None:
    assert issubclass(cls, BUILTINS), f"{cls.__name__} is none of {[b.__name__ for b in BUILTINS]}"


@pytest.mark.parametrize(("cls", "builtin"), [
    (errors.ConfigError, ValueError), (errors.WireError, ValueError), (errors.CodecError, ValueError),
    (errors.ModelLoadError, RuntimeError), (errors.StageTimeout, TimeoutError), (errors.RequestTimeout, TimeoutError),
    (errors.TableError, LookupError), (errors.SecurityError, ValueError),
])
def test_a_caller_of_the_builtin_catches_the_package_error(cls: type[Exception], builtin: type[Exception]) -> None:
    with pytest.raises(builtin, match="what is wrong"):
        raise cls("what is wrong")
