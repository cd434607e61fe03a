"""The shared format, no sockets: stage messages and replies, activation frames and codecs, trace
records, and the request API's frames.
"""
