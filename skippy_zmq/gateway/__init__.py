"""The serving gateway: OpenAI-compatible HTTP (aiohttp) and the ZeroMQ request API in front of one
`Engine`, plus the `serve` command that starts, watches and drains them.

Modules: `backend` (what a request is served with, and the startup status), `http` (the aiohttp
app and its route table), `metrics` (the Prometheus metrics of /metrics), `zmq_api` (the ROUTER
request API), `server` (startup, signals, drain), `cli` (the `serve` click command).
"""
