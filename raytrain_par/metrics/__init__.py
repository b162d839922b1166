"""Measurements: memory per worker, statistical efficiency, throughput."""
