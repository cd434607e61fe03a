"""Draft-free speculative decoding, socket-free: what a session proposes from its own tokens, and how many
drafts it sends (docs/PROTOCOL.md §6, Speculative decoding).

A session's next tokens often repeat an earlier stretch of its own text: a code block copied with a
change, a quoted passage, a list continued. `NgramDrafts` finds the latest earlier occurrence of the
session's last few tokens (the prompt included) and proposes the tokens that followed it, as llama.cpp's
n-gram lookup does. The final stage checks the drafts in one pass with the session's own sampler
(`skippy_zmq.stage.final.FinalOutput.verify`), so a rejected draft costs one wider pass, never a
different text. `DraftPolicy` sizes the drafts from what the session's verifications accepted,
`batch_share` keeps a busy pipeline from spending its passes on drafts, and `allocate` gives a pass's draft rows
only where their expected tokens pay for the time they add (`PassCost`: a pass's time per row, as measured).
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
PRIOR_ROW_SHARE = 0.25
"""What a row adds to a pass, as a share of a one-row pass's time, until passes of several sizes are measured."""
COST_DECAY = 0.98
"""Each measured pass multiplies the weight of those before it by this (the fit follows a changing load)."""
MIN_ROWS_SPREAD = 0.25
"""The least variance of the measured passes' row counts from which their slope is trusted over the prior."""


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


class PassCost:
    """A decode pass's round trip as `fixed + per_row x rows`, fitted by least squares to the passes measured,
    older ones weighing less (`COST_DECAY`); until their row counts vary, a row costs `PRIOR_ROW_SHARE` of the
    fixed part. On a small model a row costs little beside reading the weights; on an 8B model over two cores a
    row of four costs a third of a one-row pass (docs/BENCHMARKS.md, "Speculative decoding")."""

    def __init__(self) -> None:
        self._sums = [0.0] * 5  # weight, rows, seconds, rows^2, rows x seconds

    def observe(self, rows: int, seconds: float) -> None:
        """A pass of `rows` rows took `seconds` from its send to its reply."""
        if rows < 1 or not seconds > 0:
            return
        decayed = [COST_DECAY * value for value in self._sums]
        for place, value in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            decayed[place] += value
        self._sums = decayed

    def fit(self) -> tuple[float, float]:
        """(fixed, per_row) seconds; (1, PRIOR_ROW_SHARE) before any pass is measured (only their ratio matters)."""
        weight, rows, seconds, rows2, cross = self._sums
        if weight <= 0:
            return 1.0, PRIOR_ROW_SHARE
        mean_rows, mean_s = rows / weight, seconds / weight
        spread = rows2 / weight - mean_rows * mean_rows
        if spread >= MIN_ROWS_SPREAD:
            per_row = max((cross / weight - mean_rows * mean_s) / spread, 0.0)
            fixed = max(mean_s - per_row * mean_rows, 0.1 * mean_s)  # a pass never costs its rows alone
            return fixed, (mean_s - fixed) / mean_rows
        fixed = mean_s / (1 + PRIOR_ROW_SHARE * mean_rows)
        return fixed, PRIOR_ROW_SHARE * fixed


def allocate(offers: Sequence[tuple[int, float]], cost: tuple[float, float]) -> list[int]:
    """Drafts each session of a pass sends, of `offers` (the drafts it has, the chance it accepts each): a draft
    row is added, most likely first (a session's j-th draft counts its acceptance to the power j, expected tokens),
    while its expected tokens per added second beat the pass's tokens per second so far."""
    fixed, per_row = cost
    rows = len(offers)
    tokens = float(rows)  # each session's step gives a token
    gains = sorted(((chance ** j, i) for i, (count, chance) in enumerate(offers) for j in range(1, count + 1)),
                   reverse=True)
    taken = [0] * len(offers)
    for gain, i in gains:
        if gain * (fixed + per_row * rows) <= per_row * tokens:
            break
        taken[i] += 1
        tokens += gain
        rows += 1
    return taken


class NgramDrafts:
    """The drafts a session's own tokens suggest: what followed the latest earlier occurrence of its last
    n tokens (n from `NGRAM_SIZES`, longest first), continued as a loop where that runs into the present (the
    text since the occurrence repeating itself: a model caught in a loop of P tokens drafts P at most
    otherwise, a repeated token one). Each token joins once; a lookup is one dict probe per n."""

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
        """`limit` tokens that followed the latest earlier occurrence of the last n tokens, the stretch from there
        to the present repeated as often as `limit` asks; () when no n-gram occurred before."""
        if limit <= 0:
            return ()
        for n, table in self._after.items():
            if len(self.tokens) <= n:
                continue
            start = table.get(tuple(self.tokens[-n:]))
            if start is not None:
                period = len(self.tokens) - start  # what followed the occurrence, up to the present
                return tuple(self.tokens[start + i % period] for i in range(limit))
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
        self.accepted = 0  # drafts its verifications accepted
        self.trials = 0  # drafts they decided on: the accepted ones and each first rejected one

    @property
    def acceptance(self) -> float:
        """The chance it accepts a draft whose predecessors it accepted: (accepted + 1) / (decided + 2)."""
        return (self.accepted + 1) / (self.trials + 2)

    def offer(self, prompt: Sequence[int], output: Sequence[int], room: int) -> int:
        """How many drafts the next step would carry with no batch to share it with (the same arguments as
        `propose`); changes nothing but the tokens indexed."""
        self._index(prompt, output)
        if self.policy.pause > 0:
            return 0
        return len(self.drafts.propose(min(room, self.policy.limit, MAX_DRAFT_TOKENS)))

    def _index(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        done = len(self.drafts.tokens)
        if done < len(prompt):
            self.drafts.extend(prompt[done:])
        self.drafts.extend(output[max(done - len(prompt), 0):])

    def propose(self, prompt: Sequence[int], output: Sequence[int], room: int, share: int) -> tuple[int, ...]:
        """The drafts of the next step: `prompt` and `output` are every token the session holds (only the new
        ones are indexed, with no copy of the rest), `room` the most its request and context allow, `share` what
        the batch allows."""
        self._index(prompt, output)
        allowed = self.policy.allowed()  # a paused step counts whatever the batch allows
        self.in_flight = self.drafts.propose(min(room, share, allowed, MAX_DRAFT_TOKENS))
        return self.in_flight

    def verified(self, accepted: int) -> None:
        """The verification in flight accepted its first `accepted` drafts."""
        self.accepted += accepted
        self.trials += accepted + (accepted < len(self.in_flight))
        self.policy.verified(len(self.in_flight), accepted)
        self.in_flight = ()

