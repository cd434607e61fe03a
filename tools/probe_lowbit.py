"""Two low-bit routes to a cheaper decode step, measured on Gemma 3 270M (docs/BENCHMARKS.md).

    python3 tools/probe_lowbit.py [--threads 2]

1. An int8 screen of the output head: ONNX Runtime's MatMulInteger against the packed float32
   MatMul at 8 and 16 rows, then, on real hidden states, how many vocabulary rows a proven
   error bound leaves as greedy candidates (per-row int8 scales for the head and for x):
   |w.x - s_w s_x (q_w . q_x)| <= ||r_w|| ||x_hi|| + ||w|| ||x - x_hi||, r_w the row's rounding.
2. MatMulNBits (4-bit blocks of 32, float zero points, float32 arithmetic) against the packed
   float32 MatMul on the layer shapes.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any


def _median_ms(run: Callable[[], Any], repeats: int = 12) -> float:
    import numpy as np

    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return float(np.median(times[2:]) * 1000)


def _session(nodes: list[Any], inits: dict[str, Any], inputs: list[Any], outputs: list[Any], threads: int) -> Any:
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    graph = helper.make_graph(nodes, "probe", inputs, outputs,
                              initializer=[numpy_helper.from_array(a, n) for n, a in inits.items()])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def probe_head(threads: int) -> None:
    """MatMulInteger's time on the head, and the screen's candidate counts on real states."""
    import numpy as np
    from onnx import TensorProto, helper

    from skippy_zmq.float32.layers import rms_norm
    from skippy_zmq.model.catalog import ensure_gemma3_270m
    from skippy_zmq.model.gguf_model import GGUFModel
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime

    path = ensure_gemma3_270m()
    runtime = StageRuntime.load(path, 0, 18, ctx_size=128)
    hp = runtime.hparams
    w = GGUFModel(path).row_table("token_embd.weight", (hp.n_vocab, hp.n_embd)).rows(np.arange(hp.n_vocab))
    w64 = w.astype(np.float64)
    s_w = np.abs(w64).max(axis=1) / 127
    q_w = np.rint(w64 / np.where(s_w > 0, s_w, 1)[:, None])
    r_norm = np.linalg.norm(w64 - s_w[:, None] * q_w, axis=1)
    w_norm = np.linalg.norm(w64, axis=1)
    k, n = hp.n_embd, hp.n_vocab
    integer = _session(
        [helper.make_node("MatMulInteger", ["x", "w", "zero"], ["y"])],
        {"w": np.ascontiguousarray(q_w.T.astype(np.int8)), "zero": np.array(128, np.uint8)},
        [helper.make_tensor_value_info("x", TensorProto.UINT8, ["R", k])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["R", n])], threads)
    packed = Kernel("onnxruntime", threads).bind(np.ascontiguousarray(w.T))
    rng = np.random.default_rng(0)
    for rows in (8, 16):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        x_u8 = (np.rint(x / (np.abs(x).max(axis=1, keepdims=True) / 127)) + 128).astype(np.uint8)
        integer_ms = _median_ms(lambda x_u8=x_u8: integer.run(None, {"x": x_u8}))
        float_ms = _median_ms(lambda x=x: packed(x))
        print(f"head, {rows} rows: MatMulInteger {integer_ms:.1f} ms, float32 MatMul {float_ms:.1f} ms", flush=True)
    counts = []
    for session in range(6):
        runtime.open_session(session)
        ids = rng.integers(200, 20000, size=12).astype(np.int32)
        ids[0] = 2
        states = rms_norm(runtime.forward(session, 0, ids), runtime.head.norm, hp.rms_eps)  # type: ignore[union-attr]
        for x in states[-4:].astype(np.float64):
            s_x = np.abs(x).max() / 127
            x_hi = s_x * np.rint(x / s_x)
            approx = s_w * s_x * (q_w @ np.rint(x / s_x))
            bound = r_norm * np.linalg.norm(x_hi) + w_norm * np.linalg.norm(x - x_hi)
            counts.append(int((approx + bound >= (approx - bound).max()).sum()))
    print(f"screen candidates per row (of {n}): min {min(counts)}, median {int(np.median(counts))}, max {max(counts)}")


def probe_nbits(threads: int) -> None:
    """MatMulNBits (4-bit, float zero points, float32 arithmetic) against MatMul, layer shapes."""
    import numpy as np
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    total = {8: [0.0, 0.0], 16: [0.0, 0.0]}
    for k, n in ((640, 1536), (1024, 640), (640, 4096), (2048, 640)):
        blocks = k // 32
        q = rng.integers(0, 16, size=(n, blocks, 32), dtype=np.uint8)
        scale = rng.random((n, blocks), dtype=np.float32) * 0.01
        zero = rng.random((n, blocks), dtype=np.float32) * 8
        w = ((q.astype(np.float32) - zero[:, :, None]) * scale[:, :, None]).reshape(n, k)
        x_in = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["R", k])]
        y_out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["R", n])]
        nbits = _session([helper.make_node("MatMulNBits", ["x", "b", "s", "zp"], ["y"], domain="com.microsoft",
                                           K=k, N=n, bits=4, block_size=32, accuracy_level=1)],
                         {"b": (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).astype(np.uint8),
                          "s": scale.reshape(-1), "zp": zero.reshape(-1)}, x_in, y_out, threads)
        dense = _session([helper.make_node("MatMul", ["x", "w"], ["y"])], {"w": np.ascontiguousarray(w.T)},
                         x_in, y_out, threads)
        for rows in (8, 16):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            total[rows][0] += _median_ms(lambda x=x, nbits=nbits: nbits.run(None, {"x": x}))
            total[rows][1] += _median_ms(lambda x=x, dense=dense: dense.run(None, {"x": x}))
    for rows, (nbits_ms, dense_ms) in total.items():
        print(f"one layer's four products, {rows} rows: MatMulNBits {nbits_ms:.2f} ms, "
              f"float32 MatMul {dense_ms:.2f} ms")


def main() -> None:
    """Run both probes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="threads per product (and BLAS threads)")
    args = parser.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)  # before numpy loads
    probe_head(args.threads)
    probe_nbits(args.threads)


if __name__ == "__main__":
    main()
