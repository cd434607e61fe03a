"""TCP keepalive and a retransmission bound on every link socket (docs/PROTOCOL.md §1, socket
settings).

A pipeline's connections are long-lived and often idle (no request, no heartbeat lost). Between
hosts, something in the path may forget an idle connection: a swarm's virtual-IP load balancer
(IPVS) drops a TCP flow idle for 15 minutes, a NAT or firewall sooner, and a peer whose host
vanished never says goodbye. Keepalive probes after 60 idle seconds keep such a flow known to the
path and find a dead peer in about two minutes, after which ZeroMQ reconnects (re-resolving the
peer's name, so a replaced container is found at its new address). Keepalive probes only run on
an idle connection: one with data in flight to a vanished host retransmits for about 15 minutes
by the kernel's defaults, so a bound on unacknowledged data ends it after a minute instead (a
peer that is merely slow or stopped still acknowledges what fits its buffer, and is not cut).
"""

from __future__ import annotations

from typing import Any

import zmq

IDLE_S = 60
"""Seconds a connection is idle before the first probe: well under IPVS's 900 s."""
INTERVAL_S = 10
"""Seconds between unanswered probes."""
PROBES = 6
"""Unanswered probes before the kernel declares the peer gone."""
MAX_UNACKED_MS = 60_000
"""Longest that sent data may stay unacknowledged before the connection is closed (TCP_USER_TIMEOUT)."""


def keep_alive(socket: zmq.Socket[Any]) -> None:
    """Turn TCP keepalive and the retransmission bound on for the connections `socket` makes or accepts
    from now on."""
    socket.setsockopt(zmq.TCP_KEEPALIVE, 1)
    socket.setsockopt(zmq.TCP_KEEPALIVE_IDLE, IDLE_S)
    socket.setsockopt(zmq.TCP_KEEPALIVE_INTVL, INTERVAL_S)
    socket.setsockopt(zmq.TCP_KEEPALIVE_CNT, PROBES)
    socket.setsockopt(zmq.TCP_MAXRT, MAX_UNACKED_MS)
