"""Numpy model runtime: GGUF loading, architectures, KV cache, sampling, tokenizer."""

from __future__ import annotations
