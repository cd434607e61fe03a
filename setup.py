"""The compiled parts of the package: the Q6_K, Q4_K and Q8_0 products (skippy_zmq/compute/native/q6k.c, q4k.c
and q80.c, docs/ARCHITECTURE.md, "The Q6_K product", "The Q4_K product" and "The Q8_0 product"). Optional: where
they cannot build (no C compiler), the package installs without them and stages multiply with ggml's own products."""

from setuptools import Extension, setup

# -ffp-contract=off: no fused multiply-add but the ones the code spells, so the sums are ggml's bits;
# -fno-math-errno: lrintf (ggml_ops.h's quantizer, once a value) inlined as one instruction, not a call
FLAGS = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno"]
setup(ext_modules=[Extension(f"skippy_zmq.compute._{name}", [f"skippy_zmq/compute/native/{name}.c"],
                             depends=["skippy_zmq/compute/native/ggml_ops.h"], extra_compile_args=FLAGS,
                             libraries=["m"], optional=True) for name in ("q6k", "q4k", "q80")])
