"""Shared fixtures: tiny HF-format checkpoints built in temp dirs (nothing is downloaded)."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def release_gpu_memory(request):
    """After a GPU test, free what its engines held: they preallocate their KV pools (most of the
    device at the default --gpu-memory-utilization) and sit in reference cycles, so without a
    collection the next test's engine would size its cache from a nearly full device."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
