"""Socket-free: the web page `GET /` serves (docs/PROTOCOL.md §9.9): its files, read once from the package's
`gateway/web/` folder (plain HTML, CSS and JavaScript modules: no build step, nothing fetched from elsewhere),
their content types and validators, and the headers every one of them carries.

The page is public (it holds no data; the API key, when the server has one, is typed into it and sent with
its own requests only), so what keeps it safe is in its headers: a Content-Security-Policy that allows
scripts, styles and connections from the page's own origin only, no inline script or style, no framing,
and `X-Content-Type-Options: nosniff`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from importlib import resources

import attrs

from skippy_zmq.errors import ConfigError

CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'none'; "
                           "frame-ancestors 'none'")
"""The page's policy: its own files and its own origin's API only; no inline script or style, no plug-ins,
no other page may frame it."""
PAGE_HEADERS: Mapping[str, str] = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",  # frame-ancestors' older twin
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated (ETag) at each load: a new version of serve shows at once
}
"""What every file of the page is answered with."""
CONTENT_TYPES: Mapping[str, str] = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
"""The files the page may hold, by suffix, and their types; any other file in the folder is not served."""
INDEX = "index.html"
"""The file `GET /` answers with."""
MAX_PAGE_BYTES = 150 * 1024
"""The page and its scripts together: a bound a test keeps (the page stays light)."""


@attrs.frozen
class Asset:
    """One file of the page: its bytes, its Content-Type and its entity tag (a digest of the bytes)."""

    name: str
    body: bytes
    content_type: str
    etag: str

    @classmethod
    def of(cls, name: str, body: bytes) -> Asset:
        """The asset `name` holding `body` (its type from its suffix); ConfigError for a suffix the page has none of."""
        suffix = name[name.rfind("."):] if "." in name else ""
        if suffix not in CONTENT_TYPES:
            raise ConfigError(f"web page file {name!r} has no known type; expected one of {', '.join(CONTENT_TYPES)}")
        return cls(name, body, CONTENT_TYPES[suffix], f'"{hashlib.sha256(body).hexdigest()[:32]}"')

    def answer(self, if_none_match: str | None) -> tuple[int, dict[str, str]]:
        """The status (304 when `if_none_match` names this version, else 200) and the headers of an answer."""
        headers = {**PAGE_HEADERS, "ETag": self.etag, "Content-Type": self.content_type}
        fresh = if_none_match is not None and self.etag in (tag.strip() for tag in if_none_match.split(","))
        return (304 if fresh else 200), headers


@attrs.frozen
class WebPage:
    """Every file of the page, by name."""

    assets: Mapping[str, Asset]

    @classmethod
    def from_package(cls) -> WebPage:
        """The files of skippy_zmq/gateway/web/; ConfigError when the folder or its index is missing (an install
        that left the package's data out)."""
        folder = resources.files("skippy_zmq.gateway").joinpath("web")
        try:
            files = {entry.name: entry.read_bytes() for entry in folder.iterdir()
                     if entry.is_file() and any(entry.name.endswith(suffix) for suffix in CONTENT_TYPES)}
        except OSError as exc:
            raise ConfigError(f"the web page's files (skippy_zmq/gateway/web) cannot be read: {exc}; reinstall the "
                              "package, or serve --no-web") from None
        if INDEX not in files:
            raise ConfigError(f"the web page's {INDEX} is not in skippy_zmq/gateway/web (an install without the "
                              "package's data?); reinstall the package, or serve --no-web")
        return cls({name: Asset.of(name, body) for name, body in sorted(files.items())})

    def get(self, name: str) -> Asset | None:
        """The file `name` (`INDEX` for ""), or None when the page has no such file."""
        return self.assets.get(name or INDEX)

    @property
    def size(self) -> int:
        """The bytes of every file together."""
        return sum(len(asset.body) for asset in self.assets.values())
