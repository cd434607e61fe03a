"""Socket-free ZAP decisions: which CURVE key may reach which server domain, and which refusals
are logged (docs/PROTOCOL.md §10).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import attrs
from zmq.utils import z85

REFUSAL_LOG_INTERVAL_S = 60.0
"""A refused peer (address and key) is logged at most once per interval, with a count."""


@attrs.frozen
class ZapDecision:
    """One answer to a ZAP request: status 200 admits, 400 refuses; `log` says whether to log it."""

    admitted: bool
    text: str
    user_id: str = ""
    log: bool = False
    suppressed: int = 0

    @property
    def status(self) -> bytes:
        """The RFC 27 status code."""
        return b"200" if self.admitted else b"400"


class Admission:
    """Decides ZAP requests: CURVE only, and only the keys admitted for the socket's domain.

    Socket-free and clock-injectable. Refusals are counted per domain; each refused peer
    (address and key) is marked for logging at most once per `log_interval_s`, the next log
    carrying how many refusals were not logged in between.
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
        self._last_logged: dict[tuple[str, bytes], tuple[float, int]] = {}
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
        now = self._clock()
        peer = (address, key)
        last = self._last_logged.get(peer)
        if last is None or now - last[0] >= self._log_interval_s:
            suppressed = 0 if last is None else last[1]
            self._last_logged[peer] = (now, 0)
            if len(self._last_logged) > 4096:  # bounded memory under a flood of addresses
                self._last_logged = {peer: (now, 0)}
            return ZapDecision(admitted=False, text=why, log=True, suppressed=suppressed)
        self._last_logged[peer] = (last[0], last[1] + 1)
        return ZapDecision(admitted=False, text=why)
