"""Standalone benchmarks and profiling scripts, run from the repository root as
``python3 -m benchmarks.<name>``; the library behind ``mlaserve bench`` is ``server.bench``."""
