"""`skippy-zmq bench`: the benchmarks users run, each with progress, a table and JSON lines out."""
