"""Draft-free speculative decoding, socket-free: what a session proposes from its own tokens, and how many
drafts it sends (docs/PROTOCOL.md §6, Speculative decoding).

A session's next tokens often repeat an earlier stretch of its own text: a code block copied with a
change, a quoted passage, a list continued. `NgramDrafts` finds the latest earlier occurrence of the
session's last few tokens (the prompt included) and proposes the tokens that followed it, as llama.cpp's
n-gram lookup does. The final stage checks the drafts in one pass with the session's own sampler
(`skippy_zmq.stage.final.FinalOutput.verify`), so a rejected draft costs one wider pass, never a
different text. `DraftPolicy` sizes the drafts from what the session's verifications accepted, and
`batch_share` keeps a busy pipeline from spending its passes on drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from skippy_zmq.errors import ConfigError
from skippy_zmq.wire.messages import MAX_DRAFT_TOKENS

NGRAM_SIZES = (4, 3, 2)
"""The lengths of the session's last tokens looked up, longest first: a longer match predicts better, a
shorter one more often (single tokens repeat too freely to be worth a pass)."""
BATCH_DRAFT_ROWS = 8
"""Rows of drafts a pass of several sessions may carry in all: a decode pass costs about the same for a few rows
more while the weights' reading dominates; a wide batch is already bound by compute. Sessions still prefilling
count: they decode a moment later, and drafts sent meanwhile slowed a 16-client serve by 3 %."""
MAX_PAUSE_STEPS = 32
"""Most decode steps a session waits before drafting again after verifications that accepted nothing."""


def check_draft_max(value: object, where: str) -> None:
    """ConfigError naming `where` unless `value` is a draft count 0..MAX_DRAFT_TOKENS."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"{where} {value!r} must be an integer from 0 (no speculation) to {MAX_DRAFT_TOKENS}")


def batch_share(sessions: int) -> int:
    """Drafts one session may send while `sessions` hold a lane: as many as it wants alone, a share of
    `BATCH_DRAFT_ROWS` (less its own row) in a batch, none once the batch is wide."""
    if sessions <= 1:
        return MAX_DRAFT_TOKENS
    return max(0, BATCH_DRAFT_ROWS // sessions - 1)


class NgramDrafts:
    """The drafts a session's own tokens suggest: what followed the latest earlier occurrence of its last
    n tokens (n from `NGRAM_SIZES`, longest first). Each token joins once; a lookup is one dict probe per n."""

    def __init__(self, sizes: Sequence[int] = NGRAM_SIZES) -> None:
        self.tokens: list[int] = []
        # n -> (n tokens) -> index of the token that followed their latest occurrence
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}

    def extend(self, tokens: Sequence[int]) -> None:
        """Add the session's next tokens (in order)."""
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens) - 1  # the n-grams ending just before the new token now have a follower
            for n, table in self._after.items():
                if end >= n:
                    table[tuple(self.tokens[end - n : end])] = end

    def propose(self, limit: int) -> tuple[int, ...]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the last n tokens; () when none."""
        if limit <= 0:
            return ()
        for n, table in self._after.items():
            if len(self.tokens) <= n:
                continue
            start = table.get(tuple(self.tokens[-n:]))
            if start is not None:
                return tuple(self.tokens[start : start + limit])
        return ()


@attrs.define
class DraftPolicy:
    """How many drafts a session sends: up to `draft_max`, doubled after a verification that accepted every
    draft, cut to one more than it accepted otherwise; after verifications that accepted nothing the session
    decodes plainly for a while (1, 2, 4 ... `MAX_PAUSE_STEPS` steps), so text that does not repeat itself
    costs almost nothing."""

    draft_max: int
    limit: int = attrs.field()
    misses: int = 0  # verifications in a row that accepted no draft
    pause: int = 0  # decode steps left before the session drafts again

    @limit.default
    def _limit(self) -> int:
        return self.draft_max

    def allowed(self) -> int:
        """Drafts the next step may carry (0: a plain decode step); counts a paused step."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.limit

    def verified(self, sent: int, accepted: int) -> None:
        """A verification of `sent` drafts accepted the first `accepted`."""
        if accepted >= sent:
            self.limit = min(2 * self.limit, self.draft_max)
            self.misses = 0
        elif accepted:
            self.limit = accepted + 1
            self.misses = 0
        else:
            self.limit = 1
            self.misses += 1
            self.pause = min(2 ** (self.misses - 1), MAX_PAUSE_STEPS)


class Speculation:
    """A session's speculation: its n-gram drafts and draft policy, and the drafts of the verification in flight."""

    def __init__(self, draft_max: int) -> None:
        self.drafts = NgramDrafts()
        self.policy = DraftPolicy(draft_max)
        self.in_flight: tuple[int, ...] = ()  # the drafts the verification awaiting its reply carries

    def propose(self, prompt: Sequence[int], output: Sequence[int], room: int, share: int) -> tuple[int, ...]:
        """The drafts of the next step: `prompt` and `output` are every token the session holds (only the new
        ones are indexed, with no copy of the rest), `room` the most its request and context allow, `share` what
        the batch allows."""
        done = len(self.drafts.tokens)
        if done < len(prompt):
            self.drafts.extend(prompt[done:])
        self.drafts.extend(output[max(done - len(prompt), 0):])
        self.in_flight = ()
        limit = min(room, share, MAX_DRAFT_TOKENS)
        if limit <= 0:
            return ()
        allowed = self.policy.allowed()
        self.in_flight = self.drafts.propose(min(limit, allowed))
        return self.in_flight

    def verified(self, accepted: int) -> None:
        """The verification in flight accepted its first `accepted` drafts."""
        self.policy.verified(len(self.in_flight), accepted)
        self.in_flight = ()

