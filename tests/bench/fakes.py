"""Fake OpenAI-compatible servers for the benchmarks' tests: one in a thread of this process (aiohttp), one
as a script a subprocess runs (the standard library only)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

from aiohttp import web

START_TIMEOUT_S = 10.0


class FakeOpenAI:
    """`/health` 200 and a streaming `/v1/completions` (one chunk per token, `delay_s` apart) on loopback, in a
    thread; request number `fail_request` (from 1, the warm-up included) is answered 500, and request
    number `error_event` streams a token, then an error event, as a server whose pipeline failed mid-way."""

    def __init__(self, *, delay_s: float = 0.0, fail_request: int | None = None,
                 error_event: int | None = None) -> None:
        self.delay_s = delay_s
        self.fail_request = fail_request
        self.error_event = error_event
        self.bodies: list[dict[str, Any]] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """The base URL."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise AssertionError(f"the fake server did not start within {START_TIMEOUT_S} s")
        return self

    def __exit__(self, *_exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(START_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_TIMEOUT_S)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if len(self.bodies) == self.fail_request:
            return web.json_response({"error": {"message": "made to fail"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(body["max_tokens"]):
            await asyncio.sleep(self.delay_s)
            chunk = {"choices": [{"index": 0, "text": f" t{index}", "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if len(self.bodies) == self.error_event:
                failure = {"error": {"message": "F16 activation value is out of range", "type": "server_error"}}
                await response.write(f"data: {json.dumps(failure)}\n\n".encode())
                break
        await response.write(b"data: [DONE]\n\n")
        return response


FAKE_SERVER_SCRIPT = '''
"""A fake serving command: /health 200 after --delay seconds, /v1/completions answered at once."""
import argparse, json, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--delay", type=float, default=0.0)
args = parser.parse_args()
print("fake server starting", flush=True)
time.sleep(args.delay)
memory = b"x" * (8 << 20)  # written, so resident: the tree's RSS counts it


class Handler(BaseHTTPRequestHandler):
    def _answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer({"status": "ok"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer({"choices": [{"text": " x", "index": 0, "finish_reason": "length"}]})

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
'''


def fake_server_script(directory: Path) -> Path:
    """The fake serving command written to `directory`: `python3 PATH --port N [--delay S]`."""
    path = directory / "fake_server.py"
    path.write_text(FAKE_SERVER_SCRIPT)
    return path
