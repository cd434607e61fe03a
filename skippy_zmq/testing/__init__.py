"""Test fixtures, not product: writers of tiny and random-weight GGUF files of real shapes."""

from __future__ import annotations
