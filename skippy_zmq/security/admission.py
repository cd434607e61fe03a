"""Socket-free ZAP decisions: which CURVE key may reach which server domain, and which refusals
are logged (docs/PROTOCOL.md §10).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import attrs
from zmq.utils import z85

REFUSAL_LOG_INTERVAL_S = 60.0
"""A refusing domain logs one peer address at most once per interval, whatever keys it tries."""
MAX_WINDOWS = 4096
"""Peer addresses tracked for the rate limit; beyond them the table starts afresh (bounded memory)."""
MAX_KEYS_COUNTED = 1024
"""Distinct keys counted per address and interval; a summary says "at least" this many beyond it."""
SUMMARY_SCAN_S = 1.0
"""How often the table is looked through for summaries due (not at every ZAP request of a flood)."""


@attrs.frozen
class ZapDecision:
    """One answer to a ZAP request: status 200 admits, 400 refuses; `log` says whether to log it."""

    admitted: bool
    text: str
    user_id: str = ""
    log: bool = False
    suppressed: int = 0  # refusals of this address not logged since its previous line
    keys: int = 0  # distinct CURVE keys among those (at most MAX_KEYS_COUNTED)
    summary: bool = False  # not a new refusal: the line summing up an interval's unlogged ones

    @property
    def status(self) -> bytes:
        """The RFC 27 status code."""
        return b"200" if self.admitted else b"400"


@attrs.define
class _Window:
    """One peer address's refusals since its last logged line."""

    started: float
    suppressed: int = 0
    keys: set[bytes] = attrs.Factory(set)


@attrs.frozen
class RefusalSummary:
    """The refusals of one address in one domain that were not logged: how many, from how many keys."""

    domain: str
    address: str
    suppressed: int
    keys: int

    def decision(self) -> ZapDecision:
        """The summary as a decision to log (`summary`: its refusals were counted already)."""
        many = "at least " if self.keys >= MAX_KEYS_COUNTED else ""
        text = f"{self.suppressed} more refused handshakes ({many}{self.keys} distinct CURVE keys)"
        return ZapDecision(admitted=False, text=text, log=True, suppressed=self.suppressed, keys=self.keys,
                           summary=True)


class Admission:
    """Decides ZAP requests: CURVE only, and only the keys admitted for the socket's domain.

    Socket-free and clock-injectable. Refusals are counted per domain. Logging is rate-limited
    per peer address, across keys: an address's refusal is marked for logging at most once per
    `log_interval_s`; the ones in between are counted with their distinct keys, carried by the
    address's next logged line or, once the interval has passed, by a summary (`summaries`).
    """

    def __init__(
        self,
        admitted: Mapping[str, frozenset[bytes]],
        *,
        log_interval_s: float = REFUSAL_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._admitted = {domain: frozenset(z85.decode(k) for k in keys) for domain, keys in admitted.items()}
        self._log_interval_s = log_interval_s
        self._clock = clock
        self._windows: dict[tuple[str, str], _Window] = {}
        self._next_scan = float("-inf")
        self.refused: dict[str, int] = {}
        self.admitted_count: dict[str, int] = {}

    def decide(self, domain: str, address: str, mechanism: bytes, credentials: Iterable[bytes]) -> ZapDecision:
        """Admit a CURVE peer whose public key is admitted in `domain`; refuse anything else."""
        creds = list(credentials)
        key = creds[0] if mechanism == b"CURVE" and len(creds) == 1 and len(creds[0]) == 32 else b""
        allowed = self._admitted.get(domain)
        if allowed is not None and key and key in allowed:
            self.admitted_count[domain] = self.admitted_count.get(domain, 0) + 1
            return ZapDecision(admitted=True, text="OK", user_id=z85.encode(key).decode())
        if allowed is None:
            why = f"unknown ZAP domain {domain!r}"
        elif mechanism != b"CURVE":
            why = f"mechanism {mechanism.decode(errors='replace')!r} is not CURVE"
        else:
            why = "public key not admitted"
        self.refused[domain] = self.refused.get(domain, 0) + 1
        return self._rate_limited(domain, address, key, why)

    def _rate_limited(self, domain: str, address: str, key: bytes, why: str) -> ZapDecision:
        now = self._clock()
        peer = (domain, address)
        window = self._windows.get(peer)
        if window is None or now - window.started >= self._log_interval_s:
            self._windows[peer] = _Window(now)
            if len(self._windows) > MAX_WINDOWS:  # bounded memory under a flood of addresses
                self._windows = {peer: self._windows[peer]}
            suppressed, keys = (0, 0) if window is None else (window.suppressed, len(window.keys))
            return ZapDecision(admitted=False, text=why, log=True, suppressed=suppressed, keys=keys)
        window.suppressed += 1
        if key and len(window.keys) < MAX_KEYS_COUNTED:
            window.keys.add(key)
        return ZapDecision(admitted=False, text=why)

    def summaries(self) -> list[RefusalSummary]:
        """The unlogged refusals of every address whose interval has passed, each once; an
        address with none is forgotten. Looks at most once per SUMMARY_SCAN_S."""
        now = self._clock()
        due: list[RefusalSummary] = []
        if now < self._next_scan:
            return due
        self._next_scan = now + min(SUMMARY_SCAN_S, self._log_interval_s)
        for (domain, address), window in list(self._windows.items()):
            if now - window.started < self._log_interval_s:
                continue
            if window.suppressed:
                due.append(RefusalSummary(domain, address, window.suppressed, len(window.keys)))
                self._windows[domain, address] = _Window(now)  # its next refusal waits an interval again
            else:
                del self._windows[domain, address]
        return due
