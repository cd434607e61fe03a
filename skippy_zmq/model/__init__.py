"""The model file: GGUF reading, hyper-parameters, the architecture table, tensor checks, the
packaged model. Imports no engine."""

from __future__ import annotations
