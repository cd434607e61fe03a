"""A stage's sessions, socket-free: lanes, the creation rule, position rules, trim, fork, TTL
expiry, and what each session asked for (sampling, logprobs, embedding, kept logits) (docs/PROTOCOL.md §5).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq import defaults
from skippy_zmq.config import StageConfig
from skippy_zmq.errors import LaneLimitError, SessionError
from skippy_zmq.stage.drivers import DriverRestart, DriverTable
from skippy_zmq.telemetry import StageMetrics
from skippy_zmq.tokens.constraint import Constraint
from skippy_zmq.tokens.grammar import SessionGrammar
from skippy_zmq.tokens.pooling import PooledRows
from skippy_zmq.tokens.sampling import Sampler, SamplingParams
from skippy_zmq.wire.messages import MessageKind, StageMessage
from skippy_zmq.wire.options import GenerationOptions

if TYPE_CHECKING:
    from skippy_zmq.model.gguf_model import ModelHParams
    from skippy_zmq.runtime.kernels import Kernel

F32: TypeAlias = npt.NDArray[np.float32]
DECODING_RECENT_S = 2.0
"""A session that ran a decode step this recently is expected to send its next one soon."""


class StageRuntimeLike(Protocol):
    """What a stage core drives: `skippy_zmq.runtime.stage.StageRuntime` or a test double."""

    is_last: bool
    ctx_size: int
    hparams: ModelHParams
    kernel: Kernel

    @property
    def invariant(self) -> bool:
        """True when a row's numbers do not depend on its pass (docs/ARCHITECTURE.md, "Batch-invariant mode")."""

    def open_session(self, session_id: int) -> None:
        """Start an empty session."""

    def close_session(self, session_id: int) -> None:
        """Free a session's KV cache (unknown ids are a no-op)."""

    def has_session(self, session_id: int) -> bool:
        """True while the session holds KV state."""

    def session_length(self, session_id: int) -> int:
        """Positions held in the session's KV cache."""

    def trim_session(self, session_id: int, n_positions: int) -> None:
        """Keep the first `n_positions` positions."""

    def check_step(self, session_id: int, pos_start: int, n_tokens: int, *, what: str = "pos_start") -> None:
        """SessionError unless the step continues the session and fits the context."""

    def forward(self, session_id: int, pos_start: int, inputs: npt.NDArray[Any]) -> F32:
        """Run the stage's layers on token ids (stage 0) or hidden rows: (T, n_embd) out."""

    def forward_many(
        self, session_ids: Sequence[int], positions: Sequence[int], counts: Sequence[int], inputs: npt.NDArray[Any]
    ) -> F32:
        """Several sessions' rows (prefill chunks, decode steps) in one pass: (sum(counts), n_embd)."""

    def logits(self, hidden: npt.NDArray[np.float32], *, reuse: bool = False) -> F32:
        """Output norm and head (final stage): (T, n_embd) -> (T, n_vocab); with `reuse`, possibly
        the head's own buffer, valid until its next call."""

    def normed(self, hidden: npt.NDArray[np.float32]) -> F32:
        """The output norm alone (final stage): (T, n_embd) -> (T, n_embd), what embeddings pool."""

    def fork_session(self, source_id: int, target_id: int, n_positions: int) -> None:
        """Open `target_id` holding a copy of the first `n_positions` positions of `source_id`."""

    def release_free_caches(self) -> int:
        """Give the pages of freed session caches back to the system; how many caches."""


# --- sessions ---------------------------------------------------------------------------------


@attrs.define
class StageSession:
    """One session on this stage: its sampler, token history (final stage) and last use.

    The KV cache lives in the runtime; `SessionTable` is the one owner that opens, trims and
    frees both together. A session is in its prefill phase from its birth (first prefill chunk
    or ConfigureGeneration) until this stage admits a decode step for it (`decoded`); a
    completed prompt does not end the phase, since a client that prefills and never decodes
    is exactly what must not hold a lane for long.
    """

    session_id: int
    last_used: float
    params: SamplingParams = attrs.Factory(SamplingParams)
    sampler: Sampler | None = None
    history: list[int] = attrs.Factory(list)
    last_decode: float = float("-inf")
    decode_batch: int = -1  # index of the newest batch with decode steps that held one of its steps
    decoded: bool = False
    driver: int = 0  # the driver_incarnation word of the message that opened it (0: none given)
    prompt_tokens: int = 0  # the prompt's length: the history after it is what the session generated
    logprobs: int | None = None  # alternatives its tokens' logprobs carry; None: no logprobs (§2.6)
    post_sampling: bool = False  # the logprobs are of the sampler's final candidates (§2.6)
    pooled: PooledRows | None = None  # an embedding session's pooled rows (final stage)
    progress: bool = False  # the final stage acknowledges its prompt chunks but the last (§6, Prompt progress)
    keep_logits: bool = False  # keep the prompt's last logits for forks (final stage)
    kept: tuple[int, F32] | None = None  # (position, its raw logits (n_vocab,)) kept for forks
    constraint: Constraint | None = None  # what its text must match (final stage)
    grammar: SessionGrammar | None = None  # the constraint's matcher, made by the final stage

    @property
    def phase(self) -> str:
        """"prefill" until the session's first decode step here, then "decode"."""
        return "decode" if self.decoded else "prefill"


class SessionTable:
    """The live sessions of a stage: lanes, creation rule, position rules, trim, TTL expiry.

    Idle expiry has two TTLs: a session that never ran a decode step here is freed after
    `prefill_ttl_s` idle, one that did after `session_ttl_s`, so fresh sessions that only
    prefill cannot hold every lane for long (docs/PROTOCOL.md §5).
    """

    def __init__(self, stage: StageConfig, runtime: StageRuntimeLike, metrics: StageMetrics,
                 eog_ids: Sequence[int] = ()) -> None:
        self.stage = stage
        self.runtime = runtime
        self.metrics = metrics
        self.eog_ids = tuple(eog_ids)
        self._sessions: dict[int, StageSession] = {}
        self.drivers = DriverTable()
        self._used_at: float | None = None  # the last use of any session; None once caches are released
        self._decode_batch = 0  # batches run that held decode steps
        metrics.lanes(0, stage.lane_count)

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def get(self, session_id: int, *, create: bool, now: float, driver: int = 0) -> StageSession:
        """The session, opened for `driver` (a driver_incarnation word) when `create` (within the
        lane limit); SessionError otherwise."""
        session = self._sessions.get(session_id)
        if session is None:
            # A replaced driver's message admitted just before its successor's: it opens nothing.
            self.drivers.check(driver)
            if not create:
                raise SessionError(
                    f"session {session_id} is not open on this stage (never started, stopped, "
                    f"or expired after {self.stage.session_ttl_s:g} s idle; "
                    f"{self.stage.prefill_ttl_s:g} s before its first decode step)"
                )
            if len(self._sessions) >= self.stage.lane_count:
                self.metrics.lane_exhausted()
                raise LaneLimitError(
                    f"lane limit reached: {len(self._sessions)} live sessions (lane_count "
                    f"{self.stage.lane_count}); session {session_id} rejected. Stop a session "
                    f"or raise lane_count"
                )
            if not self.runtime.has_session(session_id):
                self.runtime.open_session(session_id)
            session = StageSession(session_id, now, driver=driver)
            self._sessions[session_id] = session
            self.metrics.lanes(len(self._sessions), self.stage.lane_count)
        session.last_used = self._used_at = now
        return session

    def prepare(self, message: StageMessage, now: float) -> StageSession:
        """Session lookup and the position rules of a prefill chunk or decode step (§5)."""
        if message.kind.decodes:
            session = self.get(message.session_id, create=False, now=now)
            session.last_decode, session.decode_batch = now, self._decode_batch
            length = self.runtime.session_length(message.session_id)
            if message.pos_start > length:
                step = "decode" if message.kind is MessageKind.DECODE_EMBD else "verification"
                raise SessionError(
                    f"{step} at pos_start {message.pos_start} but session {message.session_id} holds "
                    f"only {length} positions"
                )
            # A decode step or verification carries the authoritative position: roll back to it (this also
            # drops the draft positions an earlier verification did not accept, §5 Speculative decoding).
            self.trim(session, message.pos_start)
        else:
            # A session is born at its first prefill chunk (or ConfigureGeneration), so stray
            # messages for unknown sessions never hold a lane.
            session = self.get(message.session_id, create=message.pos_start == 0, now=now,
                               driver=message.state.driver_incarnation)
        self.runtime.check_step(message.session_id, message.pos_start, message.token_count)
        if message.kind.decodes:
            session.decoded = True  # admitted: from now on the session keeps session_ttl_s
        return session

    def configure(self, session: StageSession, options: GenerationOptions, prompt_tokens: int) -> None:
        """New generation options: a fresh sampler seeded by them, and what the replies carry."""
        session.params = options.sampling
        session.constraint, session.grammar = options.constraint, None
        session.sampler = None  # made by `sampler`, which knows the constraint
        session.prompt_tokens = max(prompt_tokens, 0)
        session.logprobs = options.logprobs
        session.post_sampling = options.post_sampling
        session.keep_logits = options.keep_logits
        session.progress = options.progress
        session.pooled = None if options.embedding is None else PooledRows(options.embedding,
                                                                             self.runtime.hparams.n_embd)

    def fork(self, message: StageMessage, now: float) -> tuple[StageSession, StageSession]:
        """ForkSession (§5, Forks): open the message's session as a copy of the first `token_count`
        positions (KV and history) of the session its options name; (source, target)."""
        options = message.options
        assert options is not None and options.fork_from is not None, "checked by the wire (§2.6)"
        source = self.get(options.fork_from, create=False, now=now)
        if message.session_id in self._sessions:
            raise SessionError(f"fork target session {message.session_id} is already open on this stage")
        length = self.runtime.session_length(source.session_id)
        if message.token_count > length:
            raise SessionError(f"fork of {message.token_count} positions from session {source.session_id}, which "
                               f"holds {length}")
        self.runtime.fork_session(source.session_id, message.session_id, message.token_count)
        try:  # the lane and driver rules; the copy is the open cache they find
            target = self.get(message.session_id, create=True, now=now, driver=message.state.driver_incarnation)
        except BaseException:
            self.runtime.close_session(message.session_id)
            raise
        target.history = source.history[: message.token_count]
        self.configure(target, options, message.state.prompt_token_count)
        return source, target

    def sampler(self, session: StageSession) -> Sampler:
        """The session's sampler (made from its settings on first use); a constrained session's
        end-of-generation ids are the constraint's to allow (`SessionGrammar.mask`), not banned here."""
        if session.sampler is None:
            session.sampler = Sampler(session.params, eog_ids=() if session.constraint else self.eog_ids)
        return session.sampler

    def record(self, session: StageSession, message: StageMessage) -> None:
        """Append the tokens a compute message ran to the history the sampler reads (final stage); of a
        verification only its first, the session's own token: each draft joins as the sampler accepts it."""
        tokens = message.tokens[:1] if message.kind is MessageKind.VERIFY_EMBD else message.tokens
        session.history.extend(int(t) for t in tokens)

    def trim(self, session: StageSession, n_positions: int) -> None:
        """Keep the first `n_positions` positions of the KV cache and of the token history."""
        self.runtime.trim_session(session.session_id, n_positions)
        del session.history[n_positions:]

    def free(self, session_id: int) -> None:
        """Forget a session and free its KV cache (unknown ids are a no-op)."""
        self._sessions.pop(session_id, None)
        self.runtime.close_session(session_id)
        self.metrics.lanes(len(self._sessions), self.stage.lane_count)

    def see_driver(self, word: int) -> DriverRestart | None:
        """Note a message's driver word (`DriverTable.see`); on a new incarnation of a driver,
        every session its predecessor opened is freed: that process is gone (§5, Driver restarts)."""
        restart = self.drivers.see(word)
        if restart is None:
            return None
        freed = [s.session_id for s in self._sessions.values() if s.driver == restart.replaced]
        for session_id in freed:
            self.free(session_id)
        self.metrics.driver_restart(len(freed))
        return attrs.evolve(restart, freed=tuple(freed))

    def ttl(self, session: StageSession) -> float:
        """Idle seconds after which `session` is freed: prefill_ttl_s until its first decode step."""
        return self.stage.session_ttl_s if session.decoded else self.stage.prefill_ttl_s

    def expire(self, now: float) -> list[StageSession]:
        """Free the sessions idle longer than their TTL; returns them."""
        expired = [s for s in self._sessions.values() if now - s.last_used > self.ttl(s)]
        for session in expired:
            self.free(session.session_id)
            self.metrics.expired(session.phase)
        return expired

    def release_idle_caches(self, now: float) -> int | None:
        """After `defaults.WARM_CACHE_IDLE_S` without a session used, give back the pages the freed
        caches kept for the next sessions, once per idle spell; how many caches, or None."""
        if self._used_at is None or now - self._used_at <= defaults.WARM_CACHE_IDLE_S:
            return None
        self._used_at = None
        return self.runtime.release_free_caches()

    def begin_batch(self, *, decodes: bool) -> None:
        """A batch starts running; one that holds decode steps becomes the batch the next one waits to
        match (`decoding`)."""
        if decodes:
            self._decode_batch += 1

    def decoding(self, now: float) -> int:
        """The decode steps worth waiting for in the next batch: those of the sessions that decoded in
        the newest batch with decode steps, within the last `DECODING_RECENT_S`. A session that stopped
        decoding without leaving (kept by a driver's prompt cache, or waiting for a client) is waited
        for once at most, not for seconds (docs/PROTOCOL.md §5, Batching)."""
        recent = now - DECODING_RECENT_S
        return sum(1 for session in self._sessions.values()
                   if session.last_decode >= recent and session.decode_batch == self._decode_batch)


