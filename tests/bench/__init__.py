"""Tests of skippy_zmq/bench/, one file per module."""
