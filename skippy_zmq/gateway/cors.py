"""Cross-origin requests from web pages (`serve --cors-origins`, docs/PROTOCOL.md §9.7); socket-free.

`CorsPolicy` decides; the HTTP gateway only applies its answers. A preflight (an OPTIONS request
with `Origin` and `Access-Control-Request-Method`) from an allowed origin is answered 204 with
the `Access-Control-Allow-*` headers, without the API key (browsers never send credentials on a
preflight); one from any other origin gets no Access-Control headers. An allowed origin's other
requests get `Access-Control-Allow-Origin` (the origin itself, never `*`, so a page may send
`Authorization`) and `Vary: Origin` on every answer, errors and streams included; other origins
get nothing, so their pages cannot read the answers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import attrs

from skippy_zmq.errors import ConfigError

ANY_ORIGIN = "*"
"""The `--cors-origins` entry that allows every origin."""
ALLOWED_METHODS = "GET, POST, OPTIONS"
"""The methods the gateway's routes answer."""
DEFAULT_HEADERS = "Authorization, Content-Type, X-Api-Key"
"""The request headers a preflight is allowed when it names none (or names them in a form not accepted)."""
MAX_AGE_S = 600
"""How long a browser may cache a preflight's answer (Chromium caps it at 2 hours)."""
_ORIGIN = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?")
# RFC 9110 field names (tokens), comma-separated: anything else is not echoed back.
_HEADER_LIST = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+(\s*,\s*[!#$%&'*+.^_`|~0-9A-Za-z-]+)*")
_MAX_HEADER_LIST = 1024


def _origin(text: str) -> str:
    """An origin as browsers serialize it: lower-case scheme and host, no trailing slash."""
    return text.strip().rstrip("/").lower()


def _check_origins(_: object, __: attrs.Attribute[frozenset[str]], value: frozenset[str]) -> None:
    for origin in value:
        if origin != ANY_ORIGIN and not _ORIGIN.fullmatch(origin):
            raise ConfigError(f"--cors-origins: {origin!r} is not an origin; expected scheme://host[:port] with "
                              "scheme http or https (e.g. http://localhost:5173), or * for any origin")


@attrs.frozen
class CorsPolicy:
    """Which web origins may call the API from a browser (none by default)."""

    origins: frozenset[str] = attrs.field(default=frozenset(), validator=_check_origins)

    @classmethod
    def parse(cls, text: str | None) -> CorsPolicy:
        """`--cors-origins`: comma-separated origins, `*` for any; None or "" allows none. ConfigError
        naming an entry that is not an origin."""
        return cls.of((text or "").split(","))

    @classmethod
    def of(cls, origins: Iterable[str]) -> CorsPolicy:
        """A policy allowing `origins` (each normalized as browsers send it; empty entries ignored)."""
        return cls(frozenset(_origin(origin) for origin in origins if origin.strip()))

    @property
    def enabled(self) -> bool:
        """Whether any origin is allowed."""
        return bool(self.origins)

    def allows(self, origin: str | None) -> bool:
        """Whether a request carrying this `Origin` header may read the answer."""
        if origin is None or not self.origins:
            return False
        return ANY_ORIGIN in self.origins or _origin(origin) in self.origins

    @staticmethod
    def is_preflight(method: str, origin: str | None, request_method: str | None) -> bool:
        """Whether a request is a CORS preflight (Fetch standard: OPTIONS with `Origin` and
        `Access-Control-Request-Method`)."""
        return method == "OPTIONS" and origin is not None and request_method is not None

    def preflight(self, origin: str | None, request_headers: str | None = None) -> dict[str, str]:
        """The headers of a preflight's 204: for an allowed origin the Access-Control-Allow-* set
        (the headers the browser asks for, or `DEFAULT_HEADERS`), else none."""
        if not self.allows(origin):
            return {}
        asked = (request_headers or "").strip()
        allowed = asked if len(asked) <= _MAX_HEADER_LIST and _HEADER_LIST.fullmatch(asked) else DEFAULT_HEADERS
        return self.headers_for(origin) | {
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": allowed,
            "Access-Control-Max-Age": str(MAX_AGE_S),
        }

    def headers_for(self, origin: str | None) -> dict[str, str]:
        """The headers every answer to a request from `origin` carries: the origin and `Vary: Origin`
        when it is allowed, else none."""
        if origin is None or not self.allows(origin):
            return {}
        return {"Access-Control-Allow-Origin": origin.strip(), "Vary": "Origin"}
