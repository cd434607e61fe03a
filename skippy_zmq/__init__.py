"""skippy-zmq: pipeline-parallel LLM stage workers chained by ZeroMQ."""

from __future__ import annotations

from skippy_zmq.client import Client

__all__ = ["Client"]

__version__ = "0.1.0"
