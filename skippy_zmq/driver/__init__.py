"""The driver side: one generation's state machine (`generation`), the socket-free scheduler and
its recovery bookkeeping, the transport that carries out its actions, the serving engine thread,
and `generate`. Never imports the stage side.
"""
