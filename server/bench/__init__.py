"""The library behind ``mlaserve bench``: request datasets, the offline throughput run, the
serving client with its metrics, and latency plots (``server/cli_bench.py`` reads the flags)."""
