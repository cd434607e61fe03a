"""The gateway tests' fakes: one fake engine (its ticket, its scripts, its embedding vectors), the
tokenizers and chat renderers the gateway is tested with, and the app on a real port (`AppServer`).

The engine is the `Engine` API the gateway drives: submit and cancel from any thread, each request's events
from a thread of its own, as the real one. What a request does is a script of steps; the default script,
`FakeEngine.words`, is the fake pipeline of the HTTP tests, and the ZeroMQ tests pass scripts of their own.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from aiohttp import web

from skippy_zmq.driver.engine import Delta, Done, Event, Failed, Health
from skippy_zmq.driver.generation import GenerationRequest, GenerationResult
from skippy_zmq.driver.stage_figures import StageFigures
from skippy_zmq.driver.watch import StageStatus
from skippy_zmq.errors import RequestCancelled, RequestError, SkippyError
from skippy_zmq.gateway.chat import parse_messages
from skippy_zmq.gateway.http import server_options
from skippy_zmq.testing.tiny import vocab_tokenizer
from skippy_zmq.tokens.logprobs import TokenLogprobs
from skippy_zmq.tokens.tokenizer import TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, Tokenizer

# --- tokenizers and chat renderers -------------------------------------------------------------------


def byte_tokenizer() -> Tokenizer:
    """4 specials then the 256 byte tokens: every text encodes, one id per byte, after BOS 2."""
    tokens = [b"<pad>", b"<eos>", b"<bos>", b"<unk>"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    types = [TOKEN_TYPE_CONTROL] * 3 + [TOKEN_TYPE_UNKNOWN] + [TOKEN_TYPE_BYTE] * 256
    return vocab_tokenizer(tokens, [0.0] * len(tokens), types, bos_id=2, eos_id=1, unk_id=3, pad_id=0)


TOKENIZER = byte_tokenizer()


def render_chat(messages: Sequence[Mapping[str, Any]], **_: Any) -> list[int]:
    """The chat renderer beside TOKENIZER: the messages' contents, one after the other; a tool message is refused."""
    if any(message.get("role") == "tool" for message in messages):
        raise RequestError("messages[0].role: 'tool' is not supported")
    # Validated as the real renderer validates (a message without content is a 400, not a KeyError).
    return TOKENIZER.encode("".join(message.content for message in parse_messages(messages)))


class FakeTokenizer:
    """Ids are the characters' code points; BOS is 2. `hold`, when given, keeps encode waiting until set."""

    n_vocab = 1000

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.hold = hold

    def encode(self, text: str, *, add_special: bool = False) -> list[int]:
        if self.hold is not None:
            assert self.hold.wait(10), "the test never released the tokenizer"
        return [2] * bool(add_special) + [ord(ch) % 1000 for ch in text]

    def decode(self, ids: Any) -> str:
        return "".join(chr(token) for token in ids if token != 2)

    max_piece_chars = 1  # one id per character
    add_bos = False

    def min_tokens(self, n_chars: int, *, add_special: bool = True) -> int:
        return n_chars

    @staticmethod
    def render_chat(messages: Any, **_: Any) -> list[int]:
        """The chat renderer beside FakeTokenizer: BOS, then every message's content as code points."""
        if any(message.get("role") not in ("user", "assistant", "system") for message in messages):
            raise RequestError("messages[0].role: 'robot' is not a role")
        return [2, *(ord(ch) % 1000 for message in messages for ch in str(message["content"]))]


# --- embeddings -------------------------------------------------------------------------------------

N_EMBD = 4


def fake_vector(ids: Sequence[int]) -> npt.NDArray[np.float32]:
    """An input's fake pooled vector: (N_EMBD,) float32 of unit length, a function of the ids, values with many
    digits."""
    raw = np.array([len(ids), sum(ids), ids[0] if len(ids) else 0, 1 / 3], dtype=np.float64)
    return (raw / np.linalg.norm(raw)).astype(np.float32)


# --- the engine -------------------------------------------------------------------------------------

Step = tuple[Any, ...]
Script = Callable[[GenerationRequest], Iterable[Step]]
STEP_S = 0.002  # the default script's time between tokens


def fake_logprobs(tokens: Sequence[int], top: int | None) -> tuple[TokenLogprobs, ...]:
    """A scripted delta's logprobs when the request asks (`top` alternatives): each token -0.25, alternatives
    the next ids below it."""
    if top is None:
        return ()
    return tuple(TokenLogprobs(token, -0.25, tuple((token + k + 1, -1.0 - k) for k in range(top))) for token in tokens)


@attrs.define(eq=False)
class FakeTicket:
    """What FakeEngine.submit returns: the request, where its events go, and whether it was cancelled."""

    request_id: str
    request: GenerationRequest
    on_event: Callable[[Event], None]
    cancelled: threading.Event = attrs.Factory(threading.Event)


class FakeEngine:
    """The Engine API over a script: submit/cancel from any thread, each request's events from a thread of its own.

    A script turns a request into steps, taken one at a time while the request runs (a generator sees the
    engine's knobs as they are then):
      ("sleep", s)                               wait s seconds (a cancel ends the wait)
      ("delta", text, ids[, choice[, logprobs]]) a Delta of that choice (else 0), kept in its result; logprobs
                                                 default to fake_logprobs(ids, request.logprobs)
      ("finish", choice, reason)                 that choice's result ends with `reason` (no event)
      ("end",)                                   Done with every choice's result as the steps made it
      ("done", reason, text, ids)                Done with one result: these, and the logprobs of `ids`
      ("done_all", [(reason, text, ids), ...])   Done with one result per choice: these, and their logprobs
      ("fail", error)                            Failed(error) with the results so far
      ("embed",)                                 Done with fake_vector(the prompt's ids)
    A cancel, or running out of steps and then a cancel (within 30 s), ends it with Failed(RequestCancelled).

    Knobs, read as the engine runs: `refuse` is raised by submit (once `refuse_after` requests were taken, when
    given); `ready`, `silent`, `starved` and `stages` are its health; `failure`, `fail_after`, `hang` and
    `step_s` steer the default script. `submitted` and `cancelled` hold tickets, in order.
    """

    def __init__(self, script: Script | None = None, *, ctx_size: int = 64, max_sessions: int = 2,
                 request_timeout_s: float = 5.0, step_s: float = STEP_S, refuse: SkippyError | None = None,
                 refuse_after: int | None = None) -> None:
        self.script: Script = script or self.words
        self.ctx_size = ctx_size
        self.max_sessions = max_sessions
        self.request_timeout_s = request_timeout_s
        self.step_s = step_s
        self.refuse = refuse
        self.refuse_after = refuse_after  # submits taken before `refuse` is raised (None: refused from the first)
        self.ready = True
        self.silent: tuple[str, ...] = ()
        self.starved: tuple[str, ...] = ()
        self.stages: tuple[StageStatus, ...] = ()
        self.figures: tuple[StageFigures, ...] = ()
        self.failure: SkippyError | None = None
        self.fail_after = 0
        self.hang = False
        self.queue_depth = 3
        self.running = 1
        self.submitted: list[FakeTicket] = []
        self.cancelled: list[FakeTicket] = []

    def health(self) -> Health:
        return Health(ready=self.ready, silent=self.silent, starved=self.starved, stages=self.stages,
                      figures=self.figures)

    def submit(self, request: GenerationRequest, on_event: Callable[[Event], None]) -> FakeTicket:
        if self.refuse is not None and (self.refuse_after is None or len(self.submitted) >= self.refuse_after):
            raise self.refuse
        ticket = FakeTicket(f"req-{len(self.submitted) + 1}", request, on_event)
        self.submitted.append(ticket)
        threading.Thread(target=self._play, args=(ticket,), daemon=True).start()
        return ticket

    def cancel(self, ticket: FakeTicket) -> None:
        if not ticket.cancelled.is_set():
            self.cancelled.append(ticket)
        ticket.cancelled.set()

    def wait_cancelled(self, count: int = 1, timeout_s: float = 5.0) -> None:
        """Block until `count` requests were cancelled (bounded)."""
        deadline = time.monotonic() + timeout_s
        while len(self.cancelled) < count:
            assert time.monotonic() < deadline, f"{len(self.cancelled)} of {count} cancels within {timeout_s} s"
            time.sleep(0.01)

    def words(self, request: GenerationRequest) -> Iterator[Step]:
        """The default script: every `step_s`, each running choice says its next word. Choice 0 says " w0",
        " w1", ... (ids 10, 11, ...) up to max_tokens ("length"); choice c says " c<c>w0", ... and ends with an
        EOS (id 1, no text) after max_tokens - c tokens. The i-th token's logprob is -0.5 * (i + 1), its
        alternatives ids 20, 21, ... at -0.01, -0.02, .... `hang` holds it; `failure` ends it once choice 0 has
        `fail_after` tokens. An embedding request gets its fake_vector (or the `failure`) at once."""
        if request.embedding is not None:
            yield ("embed",) if self.failure is None else ("fail", self.failure)
            return
        made = [0] * request.n
        ended = [False] * request.n
        while True:
            yield ("sleep", self.step_s)
            if self.hang:
                continue
            if self.failure is not None and made[0] >= self.fail_after:
                yield ("fail", self.failure)
                return
            running = [choice for choice in range(request.n) if not ended[choice]]
            if not running:
                yield ("end",)
                return
            for choice in running:
                last = max(request.max_tokens - choice, 1)
                index = made[choice]
                if index >= last:
                    ended[choice] = True
                    yield ("finish", choice, "length")
                    continue
                eos = choice > 0 and index == last - 1
                token, piece = (1, "") if eos else (10 + index, f" {f'c{choice}' if choice else ''}w{index}")
                logprobs = () if request.logprobs is None else (TokenLogprobs(
                    token, -0.5 * (index + 1), tuple((20 + k, -0.01 * (k + 1)) for k in range(request.logprobs))),)
                made[choice] += 1
                yield ("delta", piece, (token,), choice, logprobs)
                if eos:
                    ended[choice] = True
                    yield ("finish", choice, "eos")

    def _play(self, ticket: FakeTicket) -> None:
        request = ticket.request
        results = [_result(request, choice) for choice in range(request.n)]
        # Each choice's text as pieces, joined when an event carries the results: a script of 20,000
        # deltas of 1,000 characters must not copy its growing text at every step (the GIL it would hold
        # starves the gateway's loop).
        pieces: list[list[str]] = [[] for _ in results]

        def joined() -> list[GenerationResult]:
            for result, parts in zip(results, pieces, strict=True):
                result.text = "".join(parts)
            return results

        for step in self.script(request):
            if ticket.cancelled.is_set():
                break
            if step[0] == "sleep":
                ticket.cancelled.wait(step[1])
            elif step[0] == "delta":
                choice = step[3] if len(step) > 3 else 0
                logprobs = step[4] if len(step) > 4 else fake_logprobs(step[2], request.logprobs)
                result = results[choice]
                pieces[choice].append(step[1])
                result.tokens += step[2]
                result.logprobs += logprobs
                ticket.on_event(Delta(step[1], step[2], choice, logprobs))
            elif step[0] == "finish":
                results[step[1]].finish_reason = step[2]
            else:
                ticket.on_event(_ending(step, request, joined()))
                return
        ticket.cancelled.wait(30.0)
        ticket.on_event(Failed(RequestCancelled(f"request {ticket.request_id} was cancelled"), joined()[0],
                               tuple(results)))


def _result(request: GenerationRequest, choice: int, **fields: Any) -> GenerationResult:
    return GenerationResult(prompt=request.prompt, prompt_ids=list(request.prompt_ids or ()), choice=choice, **fields)


def _ending(step: Step, request: GenerationRequest, results: list[GenerationResult]) -> Done | Failed:
    """The event a script's last step ends its request with."""
    if step[0] == "end":
        return Done(results[0], tuple(results))
    if step[0] == "fail":
        return Failed(step[1], results[0], tuple(results))
    if step[0] == "embed":
        return Done(_result(request, 0, embedding=fake_vector(request.prompt_ids or ()), finish_reason="stop"))
    if step[0] == "done":
        return Done(_finished(request, 0, *step[1:]))
    assert step[0] == "done_all", f"not a step: {step!r}"
    done = [_finished(request, choice, *end) for choice, end in enumerate(step[1])]
    return Done(done[0], tuple(done))


def _finished(request: GenerationRequest, choice: int, reason: str, text: str, ids: Sequence[int]) -> GenerationResult:
    return _result(request, choice, finish_reason=reason, text=text, tokens=list(ids),
                   logprobs=list(fake_logprobs(ids, request.logprobs)))


# --- the app on a real port --------------------------------------------------------------------------


class AppServer:
    """The gateway's aiohttp app on 127.0.0.1 (a free port) from a thread of its own, as serve runs it."""

    def __init__(self, app: web.Application) -> None:
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app, **server_options())
        started = threading.Event()
        self.url = ""

        async def start() -> None:
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            server: Any = site._server
            self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            started.set()

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        assert started.wait(10), "the app did not start listening within 10 s"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
