"""A step's host inputs: the vectorized attention arrays against a per-token Python reference,
and the single staged upload (dtypes, shapes, empty parts, values)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from model.forward_context import attention_arrays, build_attention_metadata, padded_block_tables
from model.upload import upload_arrays


def reference_slots(tables, ctx, q, block_size, pads):
    slots, positions = [], []
    for table, c, n in zip(tables, ctx, q):
        for pos in range(c, c + n):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
    return slots + [-1] * pads, positions + [0] * pads


@pytest.mark.parametrize("decode_only", [False, True])
def test_attention_arrays_match_reference(decode_only):
    rng = random.Random(7 + decode_only)
    bs, n = 4, 9
    q = [1] * n if decode_only else [rng.choice([1, 1, 3, 9, 17]) for _ in range(n)]
    ctx = [rng.randrange(0, 30) for _ in range(n)]
    tables = [rng.sample(range(100), -(-(c + k) // bs)) for c, k in zip(ctx, q)]
    for pads in (0, 3):
        a = attention_arrays(tables, ctx, q, bs, num_pad_tokens=pads)
        slots, positions = reference_slots(tables, ctx, q, bs, pads)
        assert a.slot_mapping.tolist() == slots and a.slot_mapping.dtype == np.int64
        assert a.positions.tolist() == positions
        assert a.query_start_loc.tolist() == [0, *np.cumsum(q).tolist()] and a.query_start_loc.dtype == np.int32
        assert a.seq_lens.tolist() == [c + k for c, k in zip(ctx, q)]
        width = max(map(len, tables))
        assert a.block_tables.shape == (n, width)
        for row, table in zip(a.block_tables.tolist(), tables):
            assert row == table + [0] * (width - len(table))
        # A padded array gives the same as lists.
        b = attention_arrays(padded_block_tables(tables), ctx, q, bs, num_pad_tokens=pads)
        assert np.array_equal(a.slot_mapping, b.slot_mapping)


def test_metadata_of_an_empty_step_has_only_pad_rows():
    md = build_attention_metadata([], [], [], 16, num_pad_tokens=1)
    assert md.slot_mapping.tolist() == [-1] and md.block_tables.shape == (0, 1)
    assert md.query_start_loc.tolist() == [0] and md.num_seqs == 0


def test_upload_arrays_on_cpu_keeps_dtypes_and_shapes():
    parts = [np.arange(5, dtype=np.int64), np.zeros((0, 3), dtype=np.int32),
             np.arange(6, dtype=np.int32).reshape(2, 3), np.array([0.5, -1.0], dtype=np.float32)]
    out = upload_arrays(parts, "cpu")
    assert [t.dtype for t in out] == [torch.int64, torch.int32, torch.int32, torch.float32]
    for t, a in zip(out, parts):
        assert t.shape == a.shape and np.array_equal(t.numpy(), a)


@pytest.mark.gpu
def test_upload_arrays_on_cuda_is_one_copy_and_exact():
    rng = np.random.default_rng(3)
    parts = [rng.integers(-5, 1 << 40, 7), rng.integers(0, 1 << 30, (3, 5)).astype(np.int32),
             np.zeros(0, dtype=np.int64), rng.standard_normal(9).astype(np.float32), np.array([True, False])]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = upload_arrays(parts, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for t, a in zip(out, parts):
        assert t.is_cuda and t.shape == a.shape
        assert np.array_equal(t.cpu().numpy(), a)
    # Every part is a view of one device buffer.
    assert len({t.untyped_storage().data_ptr() for t in out if t.numel()}) == 1
