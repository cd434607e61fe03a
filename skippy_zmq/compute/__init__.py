"""The ggml engine: ggml's CPU kernels through ctypes, a stage's blocks as ggml graphs over the file's
own quantized blocks, the package's own Q4_K and Q6_K products (native/), huge pages, the KV caches."""

from __future__ import annotations
