"""What the final stage answers, socket-free: the sampled token with its logprobs when asked, the
logits a fork source keeps, an embedding session's pooled vector, a fork's first token
(docs/PROTOCOL.md §5, Final stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import SessionError
from skippy_zmq.stage.sessions import SessionTable, StageRuntimeLike, StageSession
from skippy_zmq.tokens import exp_sum
from skippy_zmq.tokens.constraint import ConstraintError
from skippy_zmq.tokens.exp_sum import RowSum
from skippy_zmq.tokens.grammar import GrammarBook
from skippy_zmq.tokens.logprobs import (
    MAX_TOP_LOGPROBS,
    LogSoftmax,
    TokenLogprobs,
    pass_sums,
    post_sampling_logprobs,
)
from skippy_zmq.tokens.pooling import Pooling, RankHead
from skippy_zmq.wire.messages import MessageKind, StageMessage
from skippy_zmq.wire.replies import ReplyKind

F32: TypeAlias = npt.NDArray[np.float32]
_NONE = np.zeros(0, dtype=np.int64)


@attrs.frozen(eq=False)
class FinalAnswer:
    """The fields of the final stage's reply to one message (None: nobody waits for one)."""

    kind: ReplyKind
    token: int = -1
    logprobs: TokenLogprobs | None = None
    embedding: F32 | None = None
    tokens: tuple[int, ...] = ()  # a verification's accepted run (PredictedTokens)
    token_logprobs: tuple[TokenLogprobs, ...] = ()  # with each token's logprobs, when the session asked


class FinalOutput:
    """The final stage's outputs for its sessions."""

    def __init__(self, sessions: SessionTable, runtime: StageRuntimeLike, grammars: GrammarBook | None = None,
                 rank_head: RankHead | None = None) -> None:
        self.sessions = sessions
        self.runtime = runtime
        self.grammars = grammars  # None: this stage refuses constrained sessions
        self.rank_head = rank_head or RankHead()  # the model's reranker head (none: a rank scores by its row)
        self._scratch: F32 | None = None  # (n_vocab,) the sampler's working row
        self._exp_sum: exp_sum.ExpSum | None = None  # the logprobs normalizer's kernel, made at first use

    def start_constraint(self, session: StageSession) -> None:
        """On the final stage, compile (or find cached) the constraint a ConfigureGeneration or ForkSession
        gave `session`; SessionError or ConstraintError naming what is wrong, answered to that message."""
        if session.constraint is None or not self.runtime.is_last:
            return
        if self.grammars is None:
            raise SessionError(f"session {session.session_id} carries a {session.constraint.name} constraint, but "
                               "this final stage was started without its vocabulary for constraints")
        if session.pooled is not None:
            raise ConstraintError(f"session {session.session_id} is an embedding session: it cannot carry a "
                                  "constraint")
        session.grammar = self.grammars.start(session.constraint)

    def _allowed(self, session: StageSession) -> npt.NDArray[np.int32] | None:
        """The bitmask of the ids `session`'s constraint allows next, its matcher brought to the
        session's history first; None for an unconstrained session."""
        if session.constraint is None:
            return None
        if session.grammar is None:
            self.start_constraint(session)
        assert session.grammar is not None
        session.grammar.follow(session.history, session.prompt_tokens)
        return session.grammar.mask(keep_generating=session.params.ignore_eos)

    @staticmethod
    def wants_logits(message: StageMessage, session: StageSession) -> bool:
        """Whether answering `message` needs its last row's logits (an embedding never does)."""
        return message.kind.expects_reply and session.pooled is None

    def exp_sums(self, logits: F32, sessions: list[StageSession]) -> dict[int, RowSum]:
        """Before a pass's rows are answered: the logprobs normalizer's sums of the rows of `logits`
        (R, n_vocab) whose sessions (one per row) asked for logprobs, keyed by row, in one kernel
        run for each stretch of adjacent such rows instead of one a row."""
        wanted = [index for index, session in enumerate(sessions)
                  if session.logprobs is not None and not session.post_sampling]
        if not wanted:
            return {}
        return pass_sums(logits, wanted, self._normalizer())

    def _normalizer(self) -> exp_sum.ExpSum:
        if self._exp_sum is None:
            self._exp_sum = exp_sum.best(self.runtime.kernel.threads)
        return self._exp_sum

    def answer(self, message: StageMessage, session: StageSession, rows: F32, logits: F32 | None,
               summed: RowSum | None = None) -> FinalAnswer | None:
        """The answer to a compute message whose layers ran: `rows` (T, n_embd) are its hidden
        states; `logits` (n_vocab,) its last row's, when already projected with the batch, and
        `summed` that row's exp-sum when computed with the pass (`exp_sums`)."""
        if session.pooled is not None:
            return self._embedding(message, session, rows)
        if message.kind is MessageKind.PREFILL_EMBD:
            # A non-final prefill chunk only fills the KV cache: nobody waits for it, but a session that asked
            # for its prompt's progress hears how many positions it now holds (§6, Prompt progress).
            held = message.pos_start + message.token_count
            return FinalAnswer(ReplyKind.ACK, held) if session.progress else None
        if logits is None:
            logits = self.runtime.logits(rows[-1:], reuse=True)[0]  # read before the head runs again
        keep = session.keep_logits and message.kind is MessageKind.PREFILL_FINAL_EMBD
        token, logprobs = self.pick(session, logits, owned=not keep, summed=summed)
        if keep:  # the row that predicts the prompt's next position, for its forks; a copy, so that
            # a batch's whole (rows, n_vocab) logits are not held by one row's view of them
            session.kept = (message.pos_start + message.token_count - 1, np.array(logits))
        return FinalAnswer(ReplyKind.PREDICTED_TOKEN, token, logprobs)

    def verify(self, message: StageMessage, session: StageSession, rows: F32, logits: F32 | None,
               sums: Sequence[RowSum | None] = ()) -> FinalAnswer:
        """A verification's answer (docs/PROTOCOL.md §5, Speculative decoding): each row sampled in turn by
        the session's own sampler, exactly as decode steps one at a time would (the same history, the draw of
        the same position), while the pick equals the draft that follows; the run ends with the first pick
        that differs, the last row's pick, or an end of generation. The cache keeps the accepted positions.
        `rows` (T, n_embd) its hidden states; `logits` (T, n_vocab) when the pass projected them, with `sums`."""
        if session.pooled is not None:
            raise SessionError(f"session {message.session_id} is an embedding session: it takes prefill chunks, "
                               "not verifications")
        if logits is None:
            logits = self.runtime.logits(rows, reuse=True)
        drafts = [int(t) for t in message.tokens[1:]]
        tokens: list[int] = []
        entries: list[TokenLogprobs] = []
        for index in range(message.token_count):
            summed = sums[index] if index < len(sums) else None
            token, logprobs = self.pick(session, logits[index], owned=True, summed=summed)
            tokens.append(token)
            if logprobs is not None:
                entries.append(logprobs)
            ends = token in self.sessions.eog_ids and not session.params.ignore_eos
            if index == len(drafts) or token != drafts[index] or ends:
                break
            session.history.append(token)  # the draft is the pick: it is the next position's token
        # The rejected drafts' positions go (the other stages drop theirs at the session's next step).
        self.sessions.trim(session, message.pos_start + len(tokens))
        return FinalAnswer(ReplyKind.PREDICTED_TOKENS, tokens[-1], tokens=tuple(tokens), token_logprobs=tuple(entries))

    def pick(self, session: StageSession, logits: F32, *, owned: bool, summed: RowSum | None = None
             ) -> tuple[int, TokenLogprobs | None]:
        """The session's next token from a raw logits row, and its logprobs when the session asked
        for them (`summed`: the row's exp-sum, if computed with its pass); `owned`: nobody reads the
        row afterwards (the sampler may change it in place)."""
        sampler = self.sessions.sampler(session)
        allowed = self._allowed(session)
        if self._scratch is None or self._scratch.shape != logits.shape:
            self._scratch = np.empty(logits.shape, dtype=np.float32)
        if session.logprobs is None:
            token = sampler.sample(logits, session.history, scratch=owned, prompt_tokens=session.prompt_tokens,
                                   work=None if owned else self._scratch, allowed=allowed)
            return token, None
        if session.post_sampling:
            token, candidates = sampler.sample_candidates(
                logits, session.history, scratch=owned, prompt_tokens=session.prompt_tokens,
                work=None if owned else self._scratch, allowed=allowed)
            return token, post_sampling_logprobs(token, candidates.ids, candidates.probs, session.logprobs)
        # Read the raw row first; then the sampler may change it in place, the few ids it may touch
        # saved so the token's raw logit is known whichever it picks.
        # A greedy pick follows from the largest ids the table finds anyway: ask for enough of
        # them to decide it, and the sampler's own pass over the row is saved.
        depth = sampler.greedy_depth if allowed is None else 0  # a mask decides after the table is read
        wanted = max(session.logprobs, depth) if depth <= MAX_TOP_LOGPROBS else session.logprobs
        table = LogSoftmax.of(logits, wanted, exp_sum=self._normalizer(), summed=summed)
        known = None if depth == 0 else sampler.greedy_from_top([i for i, _ in table.top], session.history,
                                                                session.prompt_tokens)
        if known is not None:
            return known, table.token(known, float(logits[known]), session.logprobs)
        touched = sampler.touched(session.history, session.prompt_tokens) if owned else _NONE
        saved = logits[touched]
        token = sampler.sample(logits, session.history, scratch=owned, prompt_tokens=session.prompt_tokens,
                               work=None if owned else self._scratch, allowed=allowed)
        where = np.flatnonzero(touched == token)
        raw = float(saved[where[0]]) if where.size else float(logits[token])
        return token, table.token(token, raw, session.logprobs)

    def forked(self, message: StageMessage, source: StageSession, target: StageSession) -> FinalAnswer:
        """A fork's first token: sampled by the target's own sampler (and constraint) from the logits the
        source kept."""
        self.start_constraint(target)
        position = message.token_count - 1
        if source.kept is None or source.kept[0] != position:
            held = "none" if source.kept is None else f"those of position {source.kept[0]}"
            raise SessionError(
                f"fork of {message.token_count} positions from session {source.session_id}: the final stage kept "
                f"{held}; a fork needs the logits of position {position} (the source's ConfigureGeneration must "
                "ask to keep them, and its prompt must end there)")
        token, logprobs = self.pick(target, source.kept[1], owned=False)
        return FinalAnswer(ReplyKind.PREDICTED_TOKEN, token, logprobs)

    def _embedding(self, message: StageMessage, session: StageSession, rows: F32) -> FinalAnswer | None:
        pooled = session.pooled
        assert pooled is not None
        if message.kind is MessageKind.DECODE_EMBD:
            raise SessionError(f"session {message.session_id} is an embedding session: it takes prefill chunks, "
                               "not decode steps")
        pooled.add(self.runtime.normed(rows))
        if message.kind is MessageKind.PREFILL_EMBD:
            return None
        vector = pooled.vector()
        if pooled.pooling is Pooling.RANK:
            vector = self.rank_head.scores(vector)
        return FinalAnswer(ReplyKind.EMBEDDING, embedding=vector)
