"""The token side: the tokenizer and streaming detokenizer, sampling, logprobs, pooling. What the
wire, the gateway and the stages import without touching an engine."""

from __future__ import annotations
