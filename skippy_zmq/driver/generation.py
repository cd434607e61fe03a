"""One generation's state machine, socket-free: which messages it needs, and what a token means.

A `Generation` turns the tokens the final stage predicts into text. It finishes at EOS (unless
`ignore_eos`), at a stop string, at `max_tokens` or when the context is full, and streams its
text without ever showing a stop string. It says which messages its session needs next
(docs/PROTOCOL.md §6) but never sends one: `scheduler.py` gives them request ids and the
transport moves the bytes.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.driver.speculation import Speculation, check_draft_max
from skippy_zmq.errors import RequestError, SkippyError, WireError
from skippy_zmq.telemetry import HopTiming, summarize
from skippy_zmq.tokens.constraint import Constraint
from skippy_zmq.tokens.logprobs import TokenLogprobs
from skippy_zmq.tokens.pooling import Pooling
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.tokens.tokenizer import StreamingDetokenizer, Tokenizer
from skippy_zmq.wire.messages import MessageKind, StageMessage, StateHeader
from skippy_zmq.wire.options import GenerationOptions


def _check_drafts(value: int | None) -> None:
    if value is not None:
        check_draft_max(value, "draft_max")


@attrs.frozen
class GenerationRequest:
    """One prompt to complete."""

    prompt: str
    max_tokens: int = 64
    sampling: SamplingParams = attrs.Factory(SamplingParams)
    stop: tuple[str, ...] = ()
    prompt_ids: tuple[int, ...] | None = None
    logprobs: int | None = None  # alternatives per token (0..20) with each token's logprob; None: none
    post_sampling_probs: bool = False  # the logprobs after the sampler's filters (docs/PROTOCOL.md §2.6)
    n: int = 1  # choices: the prompt runs once, its KV is forked for the others (docs/PROTOCOL.md §6)
    embedding: Pooling | None = None  # an embedding request: no tokens, the pooled final hidden state
    cache_prompt: bool = True  # a serving driver may continue a retained session's prefix (PROTOCOL §6)
    constraint: Constraint | None = None  # what the text must match, enforced at the final stage (PROTOCOL §5)
    shown_ids: frozenset[int] = frozenset()  # control tokens whose text the text keeps (tool-call markers)
    progress: bool = False  # report the prompt's progress through the stages (docs/PROTOCOL.md §6, Prompt progress)
    timings: bool = False  # every Delta carries the timings so far (llama-server's timings_per_token)
    draft_max: int | None = attrs.field(default=None, validator=lambda _i, _a, v: _check_drafts(v))
    """Most n-gram drafts a decode step carries (0: one token a step; None: the scheduler's `draft_max`;
    docs/PROTOCOL.md §6, Speculative decoding)."""


@attrs.frozen
class Timing:
    """A result's counts and clock readings at one moment (monotonic seconds; 0.0: not yet), what llama-server's
    `timings` are computed from, for a stream's every chunk as for its end."""

    prompt_tokens: int
    cached_tokens: int
    tokens: int
    started_s: float
    first_token_s: float
    finished_s: float
    drafts: int = 0  # draft tokens its verifications carried (docs/PROTOCOL.md §6, Speculative decoding)
    drafts_accepted: int = 0  # of them, those accepted


@attrs.define
class GenerationResult:
    """What one session produced (`tokens` includes EOS when the model emitted it)."""

    prompt: str
    prompt_ids: list[int]
    session_id: int = 0
    tokens: list[int] = attrs.Factory(list)
    text: str = ""
    finish_reason: str = ""
    error: str | None = None
    hops: list[HopTiming] = attrs.Factory(list)
    started_s: float = 0.0
    first_token_s: float = 0.0
    finished_s: float = 0.0
    replays: int = 0  # times the session started over after a stage restart
    choice: int = 0  # which of the request's `n` choices this is
    logprobs: list[TokenLogprobs] = attrs.Factory(list)  # one per token, when the request asked
    embedding: npt.NDArray[np.float32] | None = None  # (n_embd,) an embedding request's vector
    cached_tokens: int = 0  # prompt positions kept from a retained session, not computed again
    drafts: int = 0  # draft tokens its verifications carried (docs/PROTOCOL.md §6, Speculative decoding)
    drafts_accepted: int = 0  # of them, those the final stage accepted
    verifications: int = 0  # steps that carried drafts

    def timing(self) -> Timing:
        """The counts and clock readings now."""
        return Timing(len(self.prompt_ids), self.cached_tokens, len(self.tokens), self.started_s, self.first_token_s,
                      self.finished_s, self.drafts, self.drafts_accepted)

    def stats(self) -> dict[str, Any]:
        """Per-stage timings per token (µs) and throughput figures."""
        decode_tokens = max(len(self.tokens) - 1, 0)
        decode_s = self.finished_s - self.first_token_s
        return {
            "prompt_tokens": len(self.prompt_ids),
            "generated_tokens": len(self.tokens),
            "time_to_first_token_s": round(self.first_token_s - self.started_s, 4),
            "decode_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s > 0 and decode_tokens else None,
            "replays": self.replays,
            "drafts": self.drafts,
            "drafts_accepted": self.drafts_accepted,
            "stages": summarize(self.hops),
        }

    def as_json(self) -> dict[str, Any]:
        """The `--json` object of this prompt."""
        return {
            "prompt": self.prompt,
            "prompt_ids": self.prompt_ids,
            "tokens": self.tokens,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "stats": self.stats(),
        }


class GenerationState(enum.Enum):
    """Where a session is in its life; FINISHED, FAILED and CANCELLED are final."""

    WAITING = "waiting"  # submitted, no lane yet
    RUNNING = "running"  # prefilling or decoding
    STOPPING = "stopping"  # the text is complete; Stop is on its way to free the lanes
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        """True once nothing more will happen to the session."""
        return self in _FINAL_STATES


_FINAL_STATES = frozenset({GenerationState.FINISHED, GenerationState.FAILED, GenerationState.CANCELLED})


@attrs.frozen
class Outgoing:
    """A message a session needs sent to stage 0, before it has a request id."""

    kind: MessageKind
    session_id: int
    prompt_token_count: int
    tokens: tuple[int, ...] = ()
    pos_start: int = 0
    seq_id: int = 0
    decode_step: int = -1
    options: GenerationOptions | None = None
    count: int = 0  # token_count of a control kind: ForkSession's positions to copy

    def message(self, request_id: int, driver_incarnation: int = 0) -> StageMessage:
        """The stage message as the driver sends it (docs/PROTOCOL.md §2.2), carrying the
        driver's `driver_incarnation` word (§6, Driver restarts)."""
        state = StateHeader.for_kind(
            self.kind,
            seq_id=self.seq_id,
            prompt_token_count=self.prompt_token_count,
            decode_step=self.decode_step,
            current_token=self.tokens[0] if self.kind.decodes else -1,
            options=self.options is not None,
            driver_incarnation=driver_incarnation,
        )
        return StageMessage(
            kind=self.kind,
            pos_start=self.pos_start,
            token_count=len(self.tokens) if self.kind.carries_tokens else self.count,
            state=state,
            request_id=request_id,
            session_id=self.session_id,
            options=self.options,
            tokens=np.asarray(self.tokens, dtype=np.int32),
        )


class Generation:
    """One prompt's generation: the messages it needs, its positions, tokens, text and finish."""

    def __init__(self, index: int, session_id: int, request: GenerationRequest, prompt_ids: Sequence[int],
                 tokenizer: Tokenizer, ctx_size: int, choice: int = 0) -> None:
        """A waiting session; `create` is the constructor that also checks the request."""
        self.index = index
        self.session_id = session_id
        self.request = request
        self.choice = choice
        self.result = GenerationResult(prompt=request.prompt, prompt_ids=list(prompt_ids), session_id=session_id,
                                       choice=choice)
        self.forks: list[Generation] = []  # the other choices of a request with n > 1 (on its first choice)
        self.parent: Generation | None = None  # on those other choices: the first, whose prompt they fork
        self.state = GenerationState.WAITING
        self.error: SkippyError | None = None
        self.position = 0  # positions the stages hold once every message sent so far has run
        self.step = 0  # decode steps sent
        self.next_token: int | None = None  # the token the next decode step feeds, once it is in
        self.ready_at = 0.0  # when `next_token` arrived
        self.pass_rows = 1  # rows of the decode pass its latest step went in (speculation.PassCost)
        self._tokenizer = tokenizer
        self.ctx_size = ctx_size
        self._text = StreamedText(tokenizer, request.stop, self.result, request.shown_ids)
        self._chunks: deque[Outgoing] = deque()  # prompt chunks not sent yet
        self.next_chunk_at = 0.0  # when the scheduler may send the next one
        self.progress_reported = -1  # prompt positions last reported run (a request that asked for progress)
        # Drafts for its decode steps (None: one token a step; an embedding never decodes).
        wants = bool(request.draft_max) and request.embedding is None
        self.speculation: Speculation | None = Speculation(request.draft_max or 0) if wants else None

    @classmethod
    def create(
        cls, index: int, session_id: int, request: GenerationRequest, tokenizer: Tokenizer, ctx_size: int
    ) -> Generation:
        """A session for `request`, tokenized; one that cannot run comes back already final."""
        ids = tokenizer.encode(request.prompt) if request.prompt_ids is None else list(request.prompt_ids)
        session = cls(index, session_id, request, ids, tokenizer, ctx_size)
        if not ids:
            session._end(GenerationState.FAILED, "error", RequestError(f"prompt {index} tokenizes to no tokens"))
        elif request.embedding is not None:
            if len(ids) > ctx_size:
                session._end(GenerationState.FAILED, "error", RequestError(
                    f"input {index} has {len(ids)} tokens; the pipeline's ctx_size is {ctx_size}"))
        elif len(ids) >= ctx_size:
            session._end(GenerationState.FAILED, "error", RequestError(
                f"prompt {index} has {len(ids)} tokens; the pipeline's ctx_size {ctx_size} leaves no room to generate"
            ))
        elif request.max_tokens < 1:
            session._end(GenerationState.FINISHED, "length", None)
        return session

    def add_choices(self, new_session_id: Callable[[], int]) -> None:
        """The request's other n - 1 choices, waiting to fork this one's prompt; each draws with
        seed + its index, so n choices with one seed are reproducible."""
        request = self.request
        for choice in range(1, request.n):
            seed = (request.sampling.seed + choice) % 2**64
            fork = Generation(self.index, new_session_id(),
                              attrs.evolve(request, sampling=attrs.evolve(request.sampling, seed=seed)),
                              self.result.prompt_ids, self._tokenizer, self.ctx_size, choice=choice)
            fork.parent = self
            self.forks.append(fork)

    @property
    def done(self) -> bool:
        """True once the session is final (finished, failed or cancelled)."""
        return self.state.is_final

    @property
    def running(self) -> bool:
        """True while the session prefills or decodes (its text is not complete)."""
        return self.state is GenerationState.RUNNING

    # --- what to send -----------------------------------------------------------------------

    def start(self, prefill_chunk: int, now: float, *, retained: int | None = None, keep: int = 0) -> list[Outgoing]:
        """Take a lane: ConfigureGeneration and the prompt's first chunk of `prefill_chunk` tokens; the other
        chunks wait for `next_chunk` (so the scheduler can interleave them with other sessions' decode steps).
        With a `retained` session id, take over that session, whose first `keep` positions hold this prompt's
        first tokens: TrimSession to them first, and the chunks start at `keep` (docs/PROTOCOL.md §6, Prompt cache)."""
        assert 0 <= keep < len(self.result.prompt_ids) and (keep == 0 or retained is not None), "a prompt row runs"
        if retained is not None:
            self.session_id = self.result.session_id = retained
        self.state = GenerationState.RUNNING
        self.result.started_s, self.result.cached_tokens = now, keep
        self._prefill(self.result.prompt_ids, prefill_chunk, first=keep)
        trim = [] if retained is None else [self._outgoing(MessageKind.TRIM_SESSION, count=keep)]
        configure = self._outgoing(MessageKind.CONFIGURE_GENERATION, options=self.options())
        return [*trim, configure, self._chunks.popleft()]

    def options(self, *, fork_from: int | None = None) -> GenerationOptions:
        """The session's generation options (docs/PROTOCOL.md §2.6); the first choice of a request
        whose other choices still wait to fork asks the final stage to keep its prompt's logits."""
        request = self.request
        return GenerationOptions(
            sampling=request.sampling, logprobs=request.logprobs,
            post_sampling=request.post_sampling_probs and request.logprobs is not None, embedding=request.embedding,
            keep_logits=fork_from is None and any(f.state is GenerationState.WAITING for f in self.forks),
            fork_from=fork_from, constraint=request.constraint, progress=request.progress and fork_from is None,
        )

    def fork(self, now: float) -> list[Outgoing]:
        """Take a lane as a copy of the first choice's prompt (its KV on every stage): one
        ForkSession, whose reply is this choice's first token, sampled with its own draw."""
        assert self.parent is not None, "only a request's later choices fork"
        self.state = GenerationState.RUNNING
        self.result.started_s = now
        self.position = len(self.result.prompt_ids)
        fork = self._outgoing(MessageKind.FORK_SESSION, options=self.options(fork_from=self.parent.session_id),
                              count=self.position)
        return [fork]

    def replay(self, prefill_chunk: int, *, count: bool = True) -> list[Outgoing]:
        """Start over after a stage lost this session (docs/PROTOCOL.md §6, Recovery): Stop (what the surviving
        stages hold goes), ConfigureGeneration, then the prompt plus every token generated so far as prefill
        chunks. The last chunk's reply is the token the lost decode step would have produced: same positions,
        same history, and a sampler whose draw depends only on the seed and the position. `count`: a replay
        after a stage failure (not a start-over for lack of a lane), counted in the result's `replays`."""
        assert self.running, "only a running session is replayed"
        self.next_token = None
        self._prefill([*self.result.prompt_ids, *self.result.tokens], prefill_chunk)
        self.result.replays += count
        configure = self._outgoing(MessageKind.CONFIGURE_GENERATION, options=self.options())
        return [self.stop(), configure, self._chunks.popleft()]

    def pause(self) -> None:
        """Send nothing more until the session starts over (`replay`): a stage refused its run."""
        self._chunks.clear()
        self.next_token = None

    def _prefill(self, ids: Sequence[int], prefill_chunk: int, *, first: int = 0) -> None:
        """Queue `ids[first:]` as prefill chunks from position `first`; `position` is where they end."""
        self._chunks.clear()
        for seq_id, start in enumerate(range(first, len(ids), prefill_chunk)):
            chunk = tuple(ids[start : start + prefill_chunk])
            last = start + len(chunk) == len(ids)
            kind = MessageKind.PREFILL_FINAL_EMBD if last else MessageKind.PREFILL_EMBD
            self._chunks.append(self._outgoing(kind, tokens=chunk, pos_start=start, seq_id=seq_id))
        self.position = len(ids)  # once every chunk has run

    @property
    def has_chunks(self) -> bool:
        """True while prompt chunks wait to be sent."""
        return bool(self._chunks)

    def next_chunk(self) -> Outgoing:
        """The prompt's next chunk (only while `has_chunks`)."""
        return self._chunks.popleft()

    def next_decode(self, share: int = 0) -> Outgoing:
        """The decode step that feeds the token just received, at the next position: with drafts (up to
        `share`, what the batch allows) a verification of them (docs/PROTOCOL.md §6, Speculative decoding)."""
        token = self.next_token
        assert token is not None, "next_decode() before a token arrived"
        self.next_token = None
        self.step += 1
        room = draft_room(self)
        position = self.position
        self.position += 1
        drafts: tuple[int, ...] = ()
        if self.speculation is not None:
            drafts = self.speculation.propose(self.result.prompt_ids, self.result.tokens, room, share)
        if drafts:
            return self._outgoing(MessageKind.VERIFY_EMBD, tokens=(token, *drafts), pos_start=position,
                                  decode_step=self.step)
        return self._outgoing(MessageKind.DECODE_EMBD, tokens=(token,), pos_start=position, decode_step=self.step)

    def stop(self) -> Outgoing:
        """The Stop that frees this session's KV and lane on every stage."""
        return self._outgoing(MessageKind.STOP)

    def _outgoing(self, kind: MessageKind, **fields: Any) -> Outgoing:
        return Outgoing(kind, self.session_id, len(self.result.prompt_ids), **fields)

    # --- what came back ---------------------------------------------------------------------

    def accept(self, token: int, now: float, hops: Sequence[HopTiming] = (),
               logprobs: TokenLogprobs | None = None) -> str:
        """Take a predicted token (with its logprobs when the request asked); the text it releases to the
        stream (maybe ""). Then the session is STOPPING (send `stop()`) or has `next_token` (send `next_decode()`)."""
        result = self.result
        if self.request.logprobs is not None:
            if logprobs is None or logprobs.token != token:
                raise WireError(f"session {self.session_id}: the final stage sent token {token} without the "
                                   "logprobs the request asked for")
            result.logprobs.append(logprobs)
        if not result.tokens:
            result.first_token_s = now
        result.finished_s = now
        result.tokens.append(token)
        result.hops.extend(hops)
        reason = self._finish_reason(token)
        if reason:
            self.state = GenerationState.STOPPING
            result.finish_reason = reason
        else:
            self.next_token = token
            self.ready_at = now
        return self._text.release(final=bool(reason))

    def accept_embedding(self, vector: npt.NDArray[np.float32], now: float, hops: Sequence[HopTiming] = ()) -> None:
        """Take an embedding request's pooled vector: the session is complete (STOPPING)."""
        if self.request.embedding is None:
            raise WireError(f"session {self.session_id}: the final stage sent an embedding for a generation")
        self.result.embedding = vector
        self.result.first_token_s = self.result.finished_s = now
        self.result.hops.extend(hops)
        self.result.finish_reason = "stop"
        self.state = GenerationState.STOPPING

    def _finish_reason(self, token: int) -> str:
        request = self.request
        # A constrained session's final stage sends an end-of-generation id despite `ignore_eos` only
        # where the constraint allows nothing else: the text is complete.
        if self._tokenizer.is_eog(token) and not (request.sampling.ignore_eos and request.constraint is None):
            reason = "eos"  # the EOS token is reported in `tokens`, never rendered as text
        elif self._text.push(token):
            return "stop"
        elif len(self.result.tokens) >= request.max_tokens or self.position >= self.ctx_size:
            reason = "length"  # max_tokens, or the KV cache is full and nothing more fits
        else:
            return ""
        # The bytes the detokenizer still holds end the text; they may complete a stop string.
        return "stop" if self._text.flush() else reason

    # --- endings ----------------------------------------------------------------------------

    def stopped(self, now: float) -> None:
        """The Stop was answered, lost or refused: the text is complete either way."""
        self.result.finished_s = self.result.finished_s or now
        self.state = GenerationState.FINISHED

    def fail(self, error: SkippyError, now: float) -> str:
        """End with `error`; returns the text that was held back, now released to the stream."""
        self.result.finished_s = now
        self._end(GenerationState.FAILED, "error", error)
        return self._text.release(final=True)

    def cancel(self, now: float) -> None:
        """Give up on the session (its caller went away); a complete text stays finished."""
        self.result.finished_s = self.result.finished_s or now
        self.state = GenerationState.FINISHED if self.state is GenerationState.STOPPING else GenerationState.CANCELLED

    def _end(self, state: GenerationState, reason: str, error: SkippyError | None) -> None:
        self.state = state
        self.result.finish_reason = reason
        self.error = error
        self.result.error = None if error is None else str(error)


def draft_room(session: Generation) -> int:
    """The most drafts the request's max_tokens and the context leave a session's next step (a verification
    answers up to 1 + drafts tokens, each at a position)."""
    return min(session.request.max_tokens - len(session.result.tokens) - 1, session.ctx_size - session.position - 1)


def draft_offer(session: Generation, share: int) -> tuple[int, float]:
    """(the drafts a session's next step could carry, up to `share`; the chance it accepts each) for the pass's
    allocation (speculation.allocate); (0, 0) without speculation."""
    if session.speculation is None or share <= 0:
        return 0, 0.0
    offered = session.speculation.offer(session.result.prompt_ids, session.result.tokens, draft_room(session))
    return min(offered, share), session.speculation.acceptance


def take_run(session: Generation, tokens: Sequence[int], now: float, hops: Sequence[HopTiming] = (),
             logprobs: Sequence[TokenLogprobs] = ()) -> str:
    """Give `session` a verification's answer: the drafts it accepted and the token after them (each with its
    logprobs when the request asked), as if each had come from a decode step of its own; the text they release.
    Tokens past the end of the text (a stop string, EOS, max_tokens) are dropped: one token a step would never have
    produced them. WireError when the answer is not the drafts' prefix plus one token."""
    speculation = session.speculation
    drafts = () if speculation is None else speculation.in_flight
    run = [int(t) for t in tokens]
    if not 1 <= len(run) <= len(drafts) + 1 or run[:-1] != list(drafts[: len(run) - 1]):
        raise WireError(f"session {session.session_id}: the final stage answered a verification of drafts "
                        f"{list(drafts)} with tokens {run}; expected the accepted drafts and one token more")
    asked = session.request.logprobs is not None
    if asked and len(logprobs) != len(run):
        raise WireError(f"session {session.session_id}: the final stage sent {len(run)} tokens with "
                        f"{len(logprobs)} logprobs; the request asked for each token's")
    assert speculation is not None
    speculation.verified(len(run) - 1)
    session.result.drafts += len(drafts)
    session.result.drafts_accepted += len(run) - 1
    session.result.verifications += 1 if drafts else 0
    texts = []
    for index, token in enumerate(run):
        if index:
            session.position += 1  # the previous token was the draft that ran at the next position
            session.next_token = None  # ... so it is fed already; the token after it is next, if any
        texts.append(session.accept(token, now, hops if index == 0 else (), logprobs[index] if asked else None))
        if not session.running:
            break
    return "".join(texts)


class StreamedText:
    """A session's text (kept in its result): detokenized token by token, ended before the first
    stop string, and streamed holding back what may be the start of one (docs/PROTOCOL.md §6)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], result: GenerationResult,
                 shown: frozenset[int] = frozenset()) -> None:
        self._detok = StreamingDetokenizer(tokenizer, shown)
        self._stops = stops
        self._result = result
        self._streamed = 0  # characters of `result.text` handed to the stream
        self._hold = max((len(stop) - 1 for stop in stops if stop), default=0)

    def push(self, token: int) -> bool:
        """Add a token's text; True when that completes a stop string (the text then ends before it)."""
        return self._append(self._detok.push(token))

    def flush(self) -> bool:
        """Add the bytes the detokenizer still holds (the text ends); True when they complete a stop string."""
        return self._append(self._detok.flush())

    def _append(self, piece: str) -> bool:
        before = len(self._result.text)
        text = self._result.text + piece
        cut = _find_stop(text, self._stops, before)
        self._result.text = text if cut is None else text[:cut]
        return cut is not None

    def release(self, *, final: bool) -> str:
        """New text for the stream. Until the session ends, the last (longest stop string - 1)
        characters wait: they may be the start of a stop string."""
        text = self._result.text
        upto = len(text) if final else len(text) - self._hold
        upto = max(upto, self._streamed)
        piece = text[self._streamed : upto]
        self._streamed = upto
        return piece


def _find_stop(text: str, stops: Sequence[str], since: int) -> int | None:
    """Where the first stop string in `text` begins, looking only at occurrences that end
    after `since` (every earlier one would have been found before)."""
    hits = [text.find(stop, max(since - len(stop) + 1, 0)) for stop in stops if stop]
    found = [hit for hit in hits if hit >= 0]
    return min(found) if found else None
