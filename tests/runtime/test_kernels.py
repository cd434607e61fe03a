"""The kernel table: a kernel chosen by the environment, refused by name, the same tokens on either float32 kernel."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.runtime import kernels
from skippy_zmq.runtime.kernels import Kernel
from skippy_zmq.runtime.stage import StageRuntime

ONNX = Kernel("onnxruntime")
NUMPY = Kernel("numpy")


def test_a_kernel_is_chosen_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.KERNEL_ENV, raising=False)
    monkeypatch.delenv(kernels.THREADS_ENV, raising=False)
    assert Kernel.from_environment() == Kernel("ggml", 1, invariant=None)  # batch-invariant where the file allows
    assert Kernel.from_environment().fallback_reason is None
    monkeypatch.setenv(kernels.KERNEL_ENV, "numpy")
    monkeypatch.setenv(kernels.THREADS_ENV, "2")
    assert Kernel.from_environment() == Kernel("numpy", 2)
    for bad in ("two", "0"):
        monkeypatch.setenv(kernels.THREADS_ENV, bad)
        with pytest.raises(ModelLoadError, match=rf"\$OPENBLAS_NUM_THREADS = '{bad}' is not a thread count"):
            Kernel.from_environment()


def test_without_ggml_the_default_falls_back_to_onnxruntime_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.KERNEL_ENV, raising=False)
    missing = attrs.evolve(kernels.KERNELS["ggml"], unavailable=lambda: "no libggml-base.so; install the model extra")
    monkeypatch.setitem(kernels.KERNELS, "ggml", missing)
    kernel = Kernel.from_environment()
    assert kernel == Kernel("onnxruntime", 1)
    assert kernel.described == ("the onnxruntime kernel (ggml, the default, cannot run here: no libggml-base.so; "
                                "install the model extra)")
    with pytest.raises(ModelLoadError, match=r"kernel 'ggml' cannot run here: no libggml-base\.so"):
        Kernel.from_environment("ggml")  # named, it is not replaced
    assert Kernel("numpy").described == "the numpy kernel"


def test_unknown_unavailable_or_threadless_kernels_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelLoadError, match=r"kernel 'mkl' is unknown; expected one of \['ggml', 'numpy', 'onnxruntime'\]"):
        Kernel("mkl")
    with pytest.raises(ModelLoadError, match="kernel threads 0 must be >= 1"):
        Kernel("numpy", 0)
    missing = attrs.evolve(kernels.KERNELS["onnxruntime"], unavailable=lambda: "No module named 'onnxruntime'")
    monkeypatch.setitem(kernels.KERNELS, "onnxruntime", missing)
    with pytest.raises(ModelLoadError, match="kernel 'onnxruntime' cannot run here: No module named"):
        Kernel("onnxruntime")


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_a_stage_gives_the_same_tokens_on_either_kernel(request: pytest.FixtureRequest, arch: str) -> None:
    path: Path = request.getfixturevalue(f"tiny_{arch}_path")
    prompt = np.array([2, 300, 301, 460, 302, 310, 311, 512], dtype=np.int32)
    runs = []
    for kernel in (NUMPY, ONNX):
        n_layer = 7 if arch == "gemma3" else 4
        stage = StageRuntime.load(path, 0, n_layer, ctx_size=64, weight_cache=None, kernel=kernel)
        assert stage.kernel == kernel
        stage.open_session(1)
        logits = stage.logits(stage.forward(1, 0, prompt)[-1:])
        tokens = [int(logits.argmax())]
        for pos in range(len(prompt), len(prompt) + 6):
            step = stage.logits(stage.forward(1, pos, np.array(tokens[-1:], np.int32)))
            logits = np.concatenate([logits, step])
            tokens.append(int(step.argmax()))
        runs.append((tokens, logits))
    (numpy_tokens, numpy_logits), (onnx_tokens, onnx_logits) = runs
    assert onnx_tokens == numpy_tokens
    # Two float32 products summing in different orders, through 7 random layers: on an AMD EPYC the
    # gemma3 logits (std 1.0) differ by up to 4.6e-4 (its hidden states, up to 12.9, by 1.6e-3);
    # a wrong product would move them by about their std.
    np.testing.assert_allclose(onnx_logits, numpy_logits, rtol=1e-4, atol=1e-3)
