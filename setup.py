"""The one compiled part of the package: the Q6_K product (skippy_zmq/runtime/native/q6k.c, docs/ARCHITECTURE.md,
"The Q6_K product"). Optional: where it cannot build (no C compiler), the package installs without it and
stages multiply Q6_K matrices with ggml's own product."""

from setuptools import Extension, setup

# -ffp-contract=off: no fused multiply-add but the ones the code spells, so the sums are ggml's bits
setup(ext_modules=[Extension("skippy_zmq.runtime._q6k", ["skippy_zmq/runtime/native/q6k.c"],
                             extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off"], libraries=["m"],
                             optional=True)])
