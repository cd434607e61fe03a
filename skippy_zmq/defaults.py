"""Defaults shared by several commands and modules, each written once (no imports: the command
line reads them before numpy may load)."""

from __future__ import annotations

CTX_SIZE = 2048
"""KV positions per session when a topology or command gives none."""
READY_TIMEOUT_S = 300.0
"""How long a stage, or a whole pipeline, may take to get ready (first heartbeat, `ready`)."""
RECOVERY_TIMEOUT_S = 60.0
"""How long a driver's sessions wait for a failed stage to come back (0: no recovery)."""
MAX_CLIENT_REQUESTS = 64
"""Requests one client may have in flight: a quarter of the default queue (--max-queue 256), so no one
client can fill it alone, and four times the default lanes (--lanes 16), more than keeps every lane busy."""
