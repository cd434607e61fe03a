"""The stage runtime: one stage's layers on the engine chosen at load (ggml graphs over the file's
blocks, or float32 products), its sessions' KV caches, embeddings on the first stage and the head on
the last."""

from __future__ import annotations
