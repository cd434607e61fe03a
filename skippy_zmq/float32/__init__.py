"""The float32 engine: the block math in numpy over dequantized weights, products by ONNX Runtime or
numpy, and the on-disk cache of dequantized weights."""

from __future__ import annotations
