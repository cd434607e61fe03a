"""The prompt cache of a serving driver, socket-free: finished sessions whose KV the stages keep,
and which of them a new prompt continues (docs/PROTOCOL.md §6, Prompt cache).

A session that finished cleanly is not stopped: its lane and its positions stay on every stage,
and the tokens those positions hold are kept here. A new request whose prompt starts with some
of those tokens takes the lane over: the stages cut the session back to the shared prefix
(`TrimSession`) and only the rest of the prompt is computed. llama-server does the same per slot
(`cache_prompt`, on by default there too).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from skippy_zmq.driver.generation import Generation, GenerationState
from skippy_zmq.driver.lanes import Action, Lanes, progress_report
from skippy_zmq.errors import ConfigError

SIMILARITY = 0.5
"""A retained session is taken over while free lanes remain only when it holds at least this
share of the new prompt (llama-server's `--slot-prompt-similarity` default); with no lane free
the best one is taken over whatever it shares."""


def reusable_length(held: Sequence[int], prompt: Sequence[int]) -> int:
    """Positions of `held` a session for `prompt` can keep: their common prefix, leaving at least
    the prompt's last token to compute (its logits give the first new token)."""
    limit = min(len(held), len(prompt) - 1)
    shared = 0
    while shared < limit and held[shared] == prompt[shared]:
        shared += 1
    return shared


@attrs.define
class Retained:
    """A finished session still open on every stage: its id's generation, the tokens its positions
    hold, and when it finished."""

    generation: Generation
    tokens: tuple[int, ...]
    since: float

    @property
    def session_id(self) -> int:
        """The stages' session id."""
        return self.generation.session_id


@attrs.frozen
class Reuse:
    """Take over `retained`, keeping its first `keep` positions."""

    retained: Retained
    keep: int


class PrefixCache:
    """Retained sessions, oldest first, each given up after `retain_s` (below the stages' session TTL,
    so a stage never frees one the driver still counts on)."""

    def __init__(self, retain_s: float) -> None:
        if not retain_s > 0:
            raise ConfigError(f"prompt cache retain_s {retain_s} must be positive")
        self.retain_s = retain_s
        self._entries: list[Retained] = []

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def reusing(session: Generation) -> bool:
        """Whether `session` may keep or take over a retained session's positions: a plain generation
        (one choice, not an embedding) that asked for the cache."""
        request = session.request
        return request.cache_prompt and request.embedding is None and request.n == 1 and session.parent is None

    @classmethod
    def retainable(cls, session: Generation) -> bool:
        """Whether a session that is ending is kept: `reusing`, and it ran a decode step, so every stage
        keeps it for its `session_ttl_s` (a session that only prefilled has the shorter prefill TTL)."""
        return cls.reusing(session) and session.step > 0 and session.state is GenerationState.STOPPING

    def retain(self, session: Generation, now: float) -> None:
        """Keep `session`'s lane and positions: the prompt and every generated token that ran."""
        held = (*session.result.prompt_ids, *session.result.tokens)[: session.position]
        self._entries.append(Retained(session, tuple(held), now))

    def choose(self, prompt: Sequence[int], *, lane_free: bool) -> Reuse | None:
        """The retained session a new prompt takes over, or None to open a new one: the longest
        shared prefix (the newest on a tie), when it is similar enough or no lane is free."""
        best: Reuse | None = None
        for entry in self._entries:
            keep = reusable_length(entry.tokens, prompt)
            if best is None or keep >= best.keep:
                best = Reuse(entry, keep)
        if best is None or (lane_free and (best.keep == 0 or best.keep < SIMILARITY * len(prompt))):
            return None
        return best

    def take(self, entry: Retained) -> None:
        """`entry` is taken over (or stopped): it leaves the cache."""
        self._entries.remove(entry)

    def oldest(self) -> Retained | None:
        """The entry retained longest ago (the first to give up for a lane), or None."""
        return self._entries[0] if self._entries else None

    def expired(self, now: float) -> list[Retained]:
        """Remove and return the entries retained for longer than `retain_s`."""
        old: list[Retained] = []
        kept: list[Retained] = []
        for entry in self._entries:
            (old if now - entry.since > self.retain_s else kept).append(entry)
        self._entries = kept
        return old

    def clear(self) -> list[Retained]:
        """Remove and return every entry (a stage was lost: what it held is gone)."""
        entries, self._entries = self._entries, []
        return entries


class PromptCache:
    """What the scheduler does with retained sessions: keep a session that ends instead of stopping
    it, start a waiting one in a retained lane, and stop retained ones when their lanes are needed,
    they grow old, or a stage was lost (docs/PROTOCOL.md §6, Prompt cache)."""

    def __init__(self, lanes: Lanes, retain_s: float, *, enabled: bool) -> None:
        self.enabled = enabled
        self.cache = PrefixCache(retain_s)
        self._lanes = lanes

    def __len__(self) -> int:
        return len(self.cache)

    def admit(self, max_sessions: int, prefill_chunk: int, now: float, step_s: float) -> list[Action]:
        """Start the waiting sessions in order, up to `max_sessions` lanes: in a retained session's lane
        when it holds enough of the prompt (or no lane is free), else in new lanes, stopping retained
        sessions, the oldest first, to make room."""
        lanes, actions = self._lanes, list[Action]()

        def free() -> int:  # lanes neither held by a session nor by a retained one
            return max_sessions - lanes.held - len(self.cache)

        while lanes.waiting:
            session, needed = lanes.waiting[0], 1 + len(lanes.waiting[0].forks)
            reuse = self.choose(session, lane_free=free() > 0)
            if reuse is None and free() < needed:
                actions += self.stop_oldest(needed - free())
                if free() < needed:
                    break
            lanes.waiting.popleft()
            if reuse is None:
                outs = session.start(prefill_chunk, now)
            else:
                self.cache.take(reuse.retained)
                outs = session.start(prefill_chunk, now, retained=reuse.retained.session_id, keep=reuse.keep)
            lanes.open(session)  # under the session id it now has
            session.next_chunk_at = now + step_s  # its first chunk leaves now
            actions += progress_report(session, session.result.cached_tokens, now)  # before any position runs
            actions += [lanes.send(session, out) for out in outs]
        return actions

    def keep(self, session: Generation, now: float) -> list[Action] | None:
        """A session at its end: retained (it leaves the scheduler, its lane and KV stay), or None
        when it is to be stopped as usual."""
        if not (self.enabled and self.cache.retainable(session)):
            return None
        self.cache.retain(session, now)
        session.stopped(now)
        return self._lanes.retire(session)

    def choose(self, session: Generation, *, lane_free: bool) -> Reuse | None:
        """The retained session `session` takes over, or None (it opens a new lane)."""
        if not (self.enabled and self.cache.reusing(session)):
            return None
        return self.cache.choose(session.result.prompt_ids, lane_free=lane_free)

    def stop_oldest(self, lanes: int) -> list[Action]:
        """Stop up to `lanes` retained sessions, the oldest first, for a session that needs new lanes."""
        actions: list[Action] = []
        while lanes > 0 and (entry := self.cache.oldest()) is not None:
            self.cache.take(entry)
            actions.append(self._stop(entry))
            lanes -= 1
        return actions

    def expire(self, now: float) -> list[Action]:
        """Stop the sessions retained longer than the cache keeps them."""
        return [self._stop(entry) for entry in self.cache.expired(now)]

    def drop(self) -> list[Action]:
        """Stop every retained session (best effort: a stage was lost, and with it what they held there)."""
        return [self._stop(entry) for entry in self.cache.clear()]

    def _stop(self, entry: Retained) -> Action:
        session = entry.generation
        return self._lanes.send(session, session.stop(), block=False)
