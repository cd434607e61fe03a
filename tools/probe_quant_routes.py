"""The candidate routes to products from a GGUF's quantized blocks, on Gemma 3 270M's own matrices
(docs/BENCHMARKS.md, "Kernels: the quantized routes").

    python3 tools/probe_quant_routes.py [--threads 1] [--rows 1 8 16 32]

Routes, side by side in one process, each (matrix, rows) cell run in interleaved bursts
(A, B, C, D, A, B, ...), medians in µs per product, and each route's resident memory for the
matrix (RSS before and after binding it):

- `ggml`: the project's ggml kernel (compute/ggml.py), computing from the blocks in the file's map;
- `ort_nbits`: ONNX Runtime's MatMulNBits at accuracy_level 4 (int8 activations) over the blocks
  repacked here to its 4- or 8-bit layout (Q5_0 and Q6_K widened to 8 bits; Q4_K's float minimum
  as an integer zero point plus one small product of block sums for the rest);
- `ort_f32`: the project's onnxruntime kernel on the dequantized float32 matrix;
- `numpy`: x @ w_t in float32.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

MATRICES = {"Q5_0 ffn_gate 640x2048": "blk.0.ffn_gate.weight", "Q4_K attn_output 1024x640": "blk.0.attn_output.weight",
            "Q6_K ffn_down 2048x640": "blk.0.ffn_down.weight", "Q8_0 attn_v 640x256": "blk.0.attn_v.weight",
            "Q8_0 head 640x262144": "token_embd.weight"}
F32 = npt.NDArray[np.float32]


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def decode_codes(type_name: str, raw: np.ndarray, k: int, n: int) -> dict[str, Any]:
    """Blocks -> integer codes q (n, k), zero, per-block scale and (K-quants) minimum: w = s (q - zero) - m."""
    raw = np.asarray(raw).reshape(-1).view(np.uint8)
    if type_name == "Q8_0":
        b = raw.reshape(n, k // 32, 34)
        q = b[..., 2:].view(np.int8).astype(np.int16).reshape(n, k) + 128
        return {"q": q, "zero": 128, "scale": _f16(b[..., 0:2]), "minv": None, "block": 32, "bits": 8}
    if type_name == "Q5_0":
        b = raw.reshape(n, k // 32, 22)
        qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)[..., 0]
        high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        low = np.concatenate([b[..., 6:] & 15, b[..., 6:] >> 4], axis=-1)
        return {"q": (low | (high << 4)).astype(np.int16).reshape(n, k), "zero": 16, "scale": _f16(b[..., 0:2]),
                "minv": None, "block": 32, "bits": 8}
    if type_name == "Q4_K":
        b = raw.reshape(n, k // 256, 144)
        s = b[..., 4:16]
        sc = np.empty((*s.shape[:-1], 8), np.uint8)
        mn = np.empty_like(sc)
        sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
        sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
        mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
        qs = b[..., 16:].reshape(n, k // 256, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=3).astype(np.int16).reshape(n, k)
        return {"q": q, "zero": 0, "scale": (_f16(b[..., 0:2])[..., None] * sc).reshape(n, k // 32),
                "minv": (_f16(b[..., 2:4])[..., None] * mn).reshape(n, k // 32), "block": 32, "bits": 4}
    if type_name == "Q6_K":
        b = raw.reshape(n, k // 256, 210)
        ql, qh = b[..., 0:128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)
        l0, l1 = ql[..., :32], ql[..., 32:]
        parts = [(l0 & 15) | ((qh & 3) << 4), (l1 & 15) | (((qh >> 2) & 3) << 4),
                 (l0 >> 4) | (((qh >> 4) & 3) << 4), (l1 >> 4) | (((qh >> 6) & 3) << 4)]
        q = np.stack(parts, axis=3).astype(np.int16).reshape(n, k)
        scale = (_f16(b[..., 208:210])[..., None] * b[..., 192:208].view(np.int8).astype(np.float32))
        return {"q": q, "zero": 32, "scale": scale.reshape(n, k // 16), "minv": None, "block": 16, "bits": 8}
    raise NotImplementedError(type_name)


def nbits_route(type_name: str, raw: np.ndarray, k: int, n: int, threads: int) -> Callable[[F32], F32]:
    """MatMulNBits (accuracy_level 4) over the repacked blocks, plus the K-quant minimum's correction."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    d = decode_codes(type_name, raw, k, n)
    block, bits = d["block"], d["bits"]
    nb = k // block
    scales = np.ascontiguousarray(d["scale"], np.float32).reshape(n, nb)
    zp = np.full((n, nb), d["zero"], np.int16)
    residual = None
    if d["minv"] is not None:  # w = s q - m = s (q - z) + (s z - m), z the integer nearest m / s
        m = d["minv"].astype(np.float64).reshape(n, nb)
        with np.errstate(divide="ignore", invalid="ignore"):
            zp = np.clip(np.where(scales > 0, np.rint(m / scales), 0), 0, 2**bits - 1).astype(np.int16)
        residual = np.ascontiguousarray((scales * zp - m).astype(np.float32).T)  # (K/32, N)
    q = d["q"]
    if bits == 4:
        u = q.astype(np.uint8).reshape(n, nb, block // 2, 2)
        codes = np.ascontiguousarray(u[..., 0] | (u[..., 1] << 4))
        zpad = np.zeros((n, nb + (nb & 1)), np.uint8)
        zpad[:, :nb] = zp
        zpad = zpad.reshape(n, -1, 2)
        zeros = np.ascontiguousarray(zpad[..., 0] | (zpad[..., 1] << 4))
    else:
        codes = np.ascontiguousarray(q.astype(np.uint8).reshape(n, nb, block))
        zeros = np.ascontiguousarray(zp.astype(np.uint8))
    inits = [numpy_helper.from_array(codes, "B"), numpy_helper.from_array(scales, "S"),
             numpy_helper.from_array(zeros, "Z")]
    nodes = [helper.make_node("MatMulNBits", ["x", "B", "S", "Z"], ["y" if residual is None else "y0"],
                              domain="com.microsoft", K=k, N=n, bits=bits, block_size=block, accuracy_level=4)]
    if residual is not None:
        inits += [numpy_helper.from_array(residual, "R"), numpy_helper.from_array(np.array([0, k // 32, 32]), "shape"),
                  numpy_helper.from_array(np.array([-1]), "axes")]
        nodes += [helper.make_node("Reshape", ["x", "shape"], ["x3"]),
                  helper.make_node("ReduceSum", ["x3", "axes"], ["sums"], keepdims=0),
                  helper.make_node("MatMul", ["sums", "R"], ["fix"]), helper.make_node("Add", ["y0", "fix"], ["y"])]
    graph = helper.make_graph(nodes, "nbits", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["R", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["R", n])], initializer=inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"x": x})[0]  # type: ignore[no-any-return]


def main() -> int:
    """Bind every route for each matrix, time the cells interleaved, print one line per cell."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    args = parser.parse_args()
    from skippy_zmq.model.catalog import ensure_gemma3_270m
    from skippy_zmq.model.gguf_model import GGUFModel
    from skippy_zmq.runtime.kernels import Kernel

    model = GGUFModel(ensure_gemma3_270m())
    rng = np.random.default_rng(1)
    print(f"threads {args.threads}; medians in µs per product; MiB: RSS added by binding the matrix")
    for label, name in MATRICES.items():
        info = model.header.tensor(name)
        n, k = info.shape
        matrix = model.block_matrix(name, (n, k))
        routes: dict[str, Callable[[F32], F32]] = {}
        added: dict[str, float] = {}
        for route in ("ggml", "ort_nbits", "ort_f32", "numpy"):
            gc.collect()
            before = _rss_mib()
            if route == "ggml":
                routes[route] = Kernel("ggml", args.threads).bind_blocks([matrix])
            elif route == "ort_nbits":
                routes[route] = nbits_route(matrix.type_name, matrix.data, k, n, args.threads)
            else:
                w_t = model.load_f32_transposed(name, (n, k))
                routes[route] = Kernel("onnxruntime" if route == "ort_f32" else "numpy", args.threads).bind(w_t)
                del w_t
            gc.collect()
            added[route] = _rss_mib() - before
        for rows in args.rows:
            x = rng.standard_normal((rows, k)).astype(np.float32)
            for run in routes.values():
                run(x)
            started = time.perf_counter()
            for run in routes.values():
                run(x)
            burst = max(1, min(200, int(0.025 * len(routes) / max(time.perf_counter() - started, 1e-6))))
            times: dict[str, list[float]] = {r: [] for r in routes}
            for _ in range(9 if n > 100_000 else 15):
                for route, run in routes.items():
                    started = time.perf_counter()
                    for _ in range(burst):
                        run(x)
                    times[route].append((time.perf_counter() - started) / burst)
            cells = "  ".join(f"{r} {np.median(v) * 1e6:9.0f}" for r, v in times.items())
            print(f"{label:28s} rows {rows:3d}  {cells}", flush=True)
        print(f"{label:28s} MiB added   " + "  ".join(f"{r} {v:7.0f}" for r, v in added.items()), flush=True)
        routes.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
