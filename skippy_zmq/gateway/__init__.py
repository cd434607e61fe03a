"""The serving gateway: OpenAI-compatible HTTP (aiohttp) and the ZeroMQ request API in front of one
`Engine`, plus the `serve` command that starts, watches and drains them.

Modules, top down: `command` (the `serve` click command), `server` (startup, signals, drain),
`http` (the aiohttp app and its route table), `zmq_api` (the ROUTER shell of the request API),
`zmq_requests` (its socket-free commands and client table), `state` (the startup status and the
attached engine), `metrics` (/metrics), `openai_api` (request validation and response shapes),
`chat` (chat templates).
"""
