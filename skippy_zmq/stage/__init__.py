"""The stage side: the socket-free stage core (admission, sessions, compute, sampling), forwarding
(the downstream message and its codec), and the worker shell that owns the sockets. Never imports
the driver side.
"""
