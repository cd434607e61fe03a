"""CurveZMQ: key files (`keys`), socket-free ZAP decisions (`admission`), and CURVE on sockets with
the ZAP handler thread (`curve`).
"""
