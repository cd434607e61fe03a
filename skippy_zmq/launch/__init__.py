"""Local processes: start stage workers and wait for them, supervise and restart them, write
topologies for ad-hoc pipelines, and plan where to cut a model.
"""
