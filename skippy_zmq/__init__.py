"""skippy-zmq: pipeline-parallel LLM stage workers chained by ZeroMQ."""

from __future__ import annotations

__version__ = "0.1.0"
