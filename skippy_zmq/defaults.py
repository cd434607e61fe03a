"""Defaults shared by several commands and modules, each written once (no imports: the command
line reads them before numpy may load)."""

from __future__ import annotations

CTX_SIZE = 2048
"""KV positions per session when a topology or command gives none."""
CACHE_TYPE_NAMES = ("f32", "f16")
"""The KV cache types a stage may keep keys and values in, as llama.cpp's --cache-type-k names them
(the rows of compute/kv_cache.py's CACHE_TYPES, which checks this list at import)."""
CACHE_TYPE = "f16"
"""The KV cache type of keys and of values when a topology or command gives none: llama.cpp's default."""
WARM_CACHE_IDLE_S = 30.0
"""After this long without a session used, a stage gives back the pages its freed session caches kept for
the next sessions (compute/kv_cache.py `SlotPool`)."""
READY_TIMEOUT_S = 300.0
"""How long a stage, or a whole pipeline, may take to get ready (first heartbeat, `ready`)."""
RECOVERY_TIMEOUT_S = 60.0
"""How long a driver's sessions wait for a failed stage to come back (0: no recovery)."""
PREFILL_CHUNK = 256
"""Prompt tokens per prefill message (`serve` and `generate --prefill-chunk`)."""
MAX_QUEUE = 256
"""Requests a serving engine lets wait for a lane; beyond that, 429 (`serve --max-queue`)."""
REQUEST_TIMEOUT_S = 600.0
"""The deadline of each request a serving engine takes (`serve --request-timeout`)."""
REPLY_TIMEOUT_S = 120.0
"""How long a driver waits for the reply to one message (`generate --timeout`)."""
GATHER_MAX_S = 0.05
"""The longest a serving engine's idle pipeline holds a new request for others arriving with it
(a quarter of a decode step when that is shorter, and no longer than requests keep joining; driver/scheduler.py
`BurstGate`)."""
REST_OF_PASS_S = 0.05
"""The longest a stage or a driver waits for the rest of a pass whose sender marked a message or
reply PASS_CONTINUES: the sender writes a pass's messages back to back, so they come within
moments unless it died (docs/PROTOCOL.md §5, Batching)."""
MAX_CLIENT_REQUESTS = 64
"""Requests one client may have in flight: a quarter of the default queue (--max-queue 256), so no one
client can fill it alone, and four times the default lanes (--lanes 16), more than keeps every lane busy."""

# llama.cpp's default sampling (common_params_sampling), which `generate` and llama-server's native
# /completion apply to what they are not given; tokens/sampling.py `SamplingParams` itself defaults to greedy.
TEMPERATURE = 0.8
"""The default sampling temperature (0: greedy)."""
TOP_K = 40
"""The default top-k (0: off)."""
TOP_P = 0.95
"""The default top-p (1: off)."""
MIN_P = 0.05
"""The default min-p (0: off)."""
REPEAT_PENALTY = 1.0
"""The default repeat penalty (1: off)."""
REPEAT_LAST_N = 64
"""The tokens the repeat penalty looks back over by default (`penalty_last_n`)."""
BATCH_INVARIANT_ENV = "SKIPPY_ZMQ_BATCH_INVARIANT"
"""1: a stage's ggml kernel computes every row in one order whatever else is in its pass (docs/ARCHITECTURE.md,
"Batch-invariant mode"); `--batch-invariant` on worker, up and serve sets it for their stage processes."""

MAX_DRAFT_TOKENS = 32
"""Most draft tokens a `VerifyEmbd` carries after the session's last token (docs/PROTOCOL.md §2.1); here, not in
`wire.messages`, so that the command line can bound `--draft-max` before numpy is imported."""
DRAFT_MAX = 16
"""`--draft-max` of `serve` and `generate` started with `--batch-invariant`, where drafts cannot change the text
(docs/PROTOCOL.md §6, Speculative decoding); without that mode it is 0: a row of a wider pass may then differ from
llama.cpp's one-token-a-step bits."""
