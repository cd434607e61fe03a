"""Campaigns, oracles against llama.cpp and writers that drive skippy-zmq from outside.

Run one from the repository's root as a module, `python3 -m tools.chaos --help`, so the package
imported is this checkout's. They import the package and `tools._common`; the package never
imports them. Benchmarks users run are `skippy-zmq bench` commands, not tools.
"""
