"""The driver's transport over real sockets on 127.0.0.1: how it takes the stages' replies."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import zmq

from skippy_zmq.config import TopologyConfig
from skippy_zmq.driver.lanes import Action
from skippy_zmq.driver.transport import PipelineTransport
from skippy_zmq.tokens.tokenizer import Tokenizer
from skippy_zmq.wire.messages import MessageKind
from skippy_zmq.wire.replies import Reply, ReplyKind, encode_reply
from tests.conftest import TINY_LLAMA_LAYERS
from tests.pipeline_helpers import write_topology


def _token(session: int, *, more: bool) -> Reply:
    return Reply(kind=ReplyKind.PREDICTED_TOKEN, request_id=session, session_id=session, stage_index=0,
                 answered=MessageKind.DECODE_EMBD, predicted_token=5, pass_continues=more)


def test_receive_waits_for_the_rest_of_a_pass_s_replies(tmp_path: Path, tiny_llama_path: Path) -> None:
    """The final stage marked the first of a pass's two tokens PASS_CONTINUES; the second comes
    200 ms later. `receive` hands both to the scheduler before it returns, so the next decode step
    carries both sessions (docs/PROTOCOL.md §6)."""
    topology = TopologyConfig.from_toml(write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 1))
    context: zmq.Context[Any] = zmq.Context()
    first = context.socket(zmq.PUSH)
    seen: list[tuple[int, bool]] = []

    def send_the_last() -> None:
        late = context.socket(zmq.PUSH)  # a socket of this thread's own
        try:
            late.connect(topology.driver.return_connect)
            late.send_multipart(encode_reply(_token(2, more=False)))
        finally:
            late.close(linger=2000)

    def record(reply: Reply, _now: float, _received_us: int = 0) -> list[Action]:
        seen.append((reply.session_id, reply.pass_continues))
        return []

    try:
        with PipelineTransport(topology, Tokenizer.from_gguf(tiny_llama_path)) as transport:
            transport.rest_of_pass_max_s = 10.0  # far above the gap: only a missing wait can split them
            transport.scheduler.on_reply = record  # type: ignore[method-assign]
            first.connect(topology.driver.return_connect)
            first.send_multipart(encode_reply(_token(1, more=True)))
            later = threading.Timer(0.2, send_the_last)
            later.start()
            transport.receive(5.0, None)
            later.join(5)
        assert seen == [(1, True), (2, False)]
    finally:
        first.close(linger=0)
        context.term()
