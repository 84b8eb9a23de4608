"""Benchmarks behind ``mlaserve bench`` (datasets, offline throughput, serving client, plots)
and standalone micro-benchmarks (``python benchmarks/bench_scheduler.py``)."""
