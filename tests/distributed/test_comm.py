"""Collectives in distributed/comm.py against single-process references (gloo, 3 ranks).

One spawned run executes every check on every rank (process start-up dominates the cost);
each test then asserts on its own check's outcome. The same checks run over NCCL when the
machine has two or more GPUs (tensors are then created on the rank's GPU).
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch

from distributed import comm
from distributed.comm import (all_gather, all_gather_object, all_reduce, broadcast, broadcast_object,
                              collective_counts, reduce_scatter, reset_collective_counts)
from distributed.parallel_state import (GroupCoordinator, destroy_distributed, get_world_group,
                                        init_distributed)

WORLD = 3
FP8 = torch.float8_e4m3fn


def _rows(rank: int, n: int, cols: int = 3, dtype=torch.float32) -> torch.Tensor:
    """Rank-specific, exactly representable rows."""
    return (torch.arange(n * cols, dtype=torch.float32).reshape(n, cols) + 100 * rank).to(dtype)


def _ints(rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    """Integer-valued floats: sums are exact in fp32 whatever the reduction order."""
    g = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(-50, 50, shape, generator=g, device="cpu").to(torch.get_default_device(), dtype)


def _randn(seed: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, device="cpu").to(torch.get_default_device())


def _counts(**nonzero) -> dict:
    expected = dict.fromkeys(collective_counts(), 0)
    expected.update(nonzero)
    return expected


def check_gather_equal(g, rank, world):
    out = all_gather(_rows(rank, 2), g)
    assert torch.equal(out, torch.cat([_rows(r, 2) for r in range(world)]))
    out2 = all_gather(_rows(rank, 2), g, sizes=[2] * world)  # explicit but uniform sizes
    assert torch.equal(out2, out)
    assert collective_counts() == _counts(all_gather_tensor=2)


def check_gather_dims(g, rank, world):
    x = _rows(rank, 4, cols=6).reshape(2, 2, 6)
    refs = [_rows(r, 4, cols=6).reshape(2, 2, 6) for r in range(world)]
    assert torch.equal(all_gather(x, g, dim=1), torch.cat(refs, dim=1))
    last = all_gather(x, g, dim=-1)
    assert last.is_contiguous() and torch.equal(last, torch.cat(refs, dim=-1))
    sizes = [1, 0, 2][:world]
    xs = _rows(rank, 2 * sizes[rank], cols=1).reshape(2, sizes[rank])
    ref = torch.cat([_rows(r, 2 * s, cols=1).reshape(2, s) for r, s in enumerate(sizes)], dim=1)
    assert torch.equal(all_gather(xs, g, dim=1, sizes=sizes), ref)
    assert collective_counts() == _counts(all_gather_tensor=2, all_gather_v=1)


def check_gather_unequal(g, rank, world):
    sizes = [2, 0, 3][:world]
    out = all_gather(_rows(rank, sizes[rank]), g, sizes=sizes)
    assert torch.equal(out, torch.cat([_rows(r, s) for r, s in enumerate(sizes)]))
    assert collective_counts() == _counts(all_gather_v=1)


def check_gather_zero(g, rank, world):
    out = all_gather(_rows(rank, 0), g, sizes=[0] * world)
    assert out.shape == (0, 3)
    out = all_gather(_rows(rank, 0), g)
    assert out.shape == (0, 3)
    assert collective_counts() == _counts(all_gather_tensor=2)


def check_gather_bf16(g, rank, world):
    sizes = [3, 1, 2][:world]
    x = _randn(rank, (sizes[rank], 8)).bfloat16()
    refs = [_randn(r, (s, 8)).bfloat16() for r, s in enumerate(sizes)]
    assert torch.equal(all_gather(x, g, sizes=sizes), torch.cat(refs))  # gathers copy bits


def check_gather_fp8(g, rank, world):
    patterns = torch.arange(256, dtype=torch.uint8).roll(rank).reshape(16, 16)
    out = all_gather(patterns.view(FP8), g)
    assert out.dtype == FP8
    ref = torch.cat([torch.arange(256, dtype=torch.uint8).roll(r).reshape(16, 16) for r in range(world)])
    assert torch.equal(out.view(torch.uint8), ref)  # bit-exact, NaN patterns included
    sizes = [5, 0, 11][:world]
    out = all_gather(patterns[: sizes[rank]].view(FP8), g, sizes=sizes)
    ref = torch.cat([torch.arange(256, dtype=torch.uint8).roll(r).reshape(16, 16)[:s]
                     for r, s in enumerate(sizes)])
    assert torch.equal(out.view(torch.uint8), ref)
    assert collective_counts() == _counts(all_gather_tensor=1, all_gather_v=1)


def check_reduce_scatter_equal(g, rank, world):
    x = _ints(rank, (2 * world, 5))
    total = sum(_ints(r, (2 * world, 5)) for r in range(world))
    out = reduce_scatter(x, g)
    assert torch.equal(out, total[2 * rank: 2 * rank + 2])
    assert torch.equal(x, _ints(rank, (2 * world, 5)))  # the input is left alone
    assert torch.equal(reduce_scatter(x, g, sizes=[2] * world), out)
    assert collective_counts() == _counts(reduce_scatter_tensor=2)


def check_reduce_scatter_unequal(g, rank, world):
    sizes = [1, 0, 4][:world]
    x = _ints(rank, (sum(sizes), 3))
    total = sum(_ints(r, (sum(sizes), 3)) for r in range(world))
    out = reduce_scatter(x, g, sizes=sizes)
    assert torch.equal(x, _ints(rank, (sum(sizes), 3)))  # the input is left alone
    start = sum(sizes[:rank])
    assert out.shape == (sizes[rank], 3)
    assert torch.equal(out, total[start: start + sizes[rank]])
    assert collective_counts() == _counts(reduce_scatter_v=1)


def check_reduce_scatter_zero(g, rank, world):
    assert reduce_scatter(torch.zeros(0, 4), g).shape == (0, 4)
    assert reduce_scatter(torch.zeros(0, 4), g, sizes=[0] * world).shape == (0, 4)
    assert collective_counts() == _counts(reduce_scatter_tensor=2)


def check_reduce_scatter_dims(g, rank, world):
    x = _ints(rank, (4, 2 * world))
    total = sum(_ints(r, (4, 2 * world)) for r in range(world))
    out = reduce_scatter(x, g, dim=1)
    assert out.is_contiguous() and torch.equal(out, total[:, 2 * rank: 2 * rank + 2])
    sizes = [2, 3, 0][:world]
    x = _ints(rank, (2, 3, sum(sizes)))
    total = sum(_ints(r, (2, 3, sum(sizes))) for r in range(world))
    start = sum(sizes[:rank])
    assert torch.equal(reduce_scatter(x, g, dim=-1, sizes=sizes), total[..., start: start + sizes[rank]])
    assert collective_counts() == _counts(reduce_scatter_tensor=1, reduce_scatter_v=1)


def check_reduce_scatter_bf16(g, rank, world):
    shape = (4 * world, 64)
    x = _randn(rank, shape).bfloat16()
    total = sum(_randn(r, shape).bfloat16().float() for r in range(world))
    out = reduce_scatter(x, g)
    assert out.dtype == torch.bfloat16
    # gloo rounds to bf16 after each partial sum, so only a tolerance holds
    ref = total[4 * rank: 4 * rank + 4]
    assert ((out.float() - ref).abs() <= 5e-2 + 2e-2 * ref.abs()).all()


def check_bad_inputs(g, rank, world):
    with pytest.raises(ValueError, match="not divisible"):
        reduce_scatter(torch.zeros(world + 1, 2), g)
    with pytest.raises(ValueError, match="sum to"):
        reduce_scatter(torch.zeros(4, 2), g, sizes=[1] * world)
    with pytest.raises(ValueError, match="sizes"):
        all_gather(torch.zeros(2, 2), g, sizes=[2] * (world + 1))
    with pytest.raises(ValueError, match="rows"):
        all_gather(torch.zeros(2, 2), g, sizes=[3] * world)
    with pytest.raises(TypeError, match="cannot reduce"):
        reduce_scatter(torch.zeros(world, 2).to(FP8), g)
    with pytest.raises(TypeError, match="cannot reduce"):
        all_reduce(torch.zeros(2).to(FP8), g)
    with pytest.raises(ValueError, match="op must be"):
        all_reduce(torch.zeros(2), g, op="mean")
    with pytest.raises(TypeError, match="msgpack"):
        all_gather_object({1, 2}, g)
    assert collective_counts() == _counts()  # every error is raised before any communication


def check_all_reduce(g, rank, world):
    x = torch.full((2, 3), float(rank + 1))
    assert torch.equal(all_reduce(x, g), torch.full((2, 3), float(sum(range(1, world + 1)))))
    assert torch.equal(all_reduce(torch.tensor([rank, -rank]), g, op="max"), torch.tensor([world - 1, 0]))
    nc = _ints(rank, (3, 4)).t()  # non-contiguous input
    assert torch.equal(all_reduce(nc, g), sum(_ints(r, (3, 4)) for r in range(world)).t())
    assert collective_counts() == _counts(all_reduce=3)


def check_broadcast(g, rank, world):
    src = world - 1
    x = torch.full((3,), float(rank))
    assert torch.equal(broadcast(x, g, src=src), torch.full((3,), float(src)))
    assert torch.equal(x, torch.full((3,), float(src)))  # in place
    f8 = torch.arange(256, dtype=torch.uint8).roll(rank).view(FP8)
    broadcast(f8, g, src=1)
    assert torch.equal(f8.view(torch.uint8), torch.arange(256, dtype=torch.uint8).roll(1))
    nc = torch.full((4, 2), float(rank)).t()
    broadcast(nc, g, src=src)
    assert torch.equal(nc, torch.full((2, 4), float(src)))
    assert collective_counts() == _counts(broadcast=3)


def check_objects(g, rank, world):
    msg = {"step": 3, "ids": [1, 2, 3], "blob": b"\x00\xff", "by_id": {7: "x"}, "none": None, "f": 0.5}
    got = broadcast_object(msg if rank == 1 else None, g, src=1)
    assert got == msg
    assert broadcast_object("" if rank == 0 else "ignored", g) == ""
    mine = {"rank": rank, "pad": "x" * (7 * rank)}
    assert all_gather_object(mine, g) == [{"rank": r, "pad": "x" * (7 * r)} for r in range(world)]
    assert collective_counts() == _counts(broadcast_object=2, all_gather_object=1)


CHECKS = {name[len("check_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("check_")}


def _comm_worker(rank, world_size, local_rank, cfg, out_dir, backend="gloo"):
    init_distributed(rank, world_size, local_rank, cfg, backend=backend, timeout_s=20,
                     collective_timeout_s=20)
    results = {}
    g = get_world_group()
    torch.set_default_device(g.device)
    for name, check in CHECKS.items():
        reset_collective_counts()
        try:
            check(g, rank, world_size)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    destroy_distributed()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def comm_results(run_spawned, tmp_path_factory):
    return run_spawned(_comm_worker, WORLD, tmp_path_factory.mktemp("comm"))


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_collective(comm_results, name):
    for rank, res in enumerate(comm_results):
        assert res[name] == "ok", f"rank {rank}:\n{res[name]}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_collectives_nccl(run_spawned, tmp_path):
    world = min(3, torch.cuda.device_count())
    for rank, res in enumerate(run_spawned(_comm_worker, world, tmp_path, "nccl")):
        failed = {k: v for k, v in res.items() if v != "ok"}
        assert not failed, f"rank {rank}: {failed}"


def test_size_one_group_is_identity_without_bookkeeping():
    g = GroupCoordinator("tp", [0], 0)
    reset_collective_counts()
    x = torch.randn(4, 3)
    assert all_gather(x, g) is x
    assert all_gather(x, g, sizes=[4]) is x
    assert reduce_scatter(x, g) is x
    assert all_reduce(x, g) is x
    assert broadcast(x, g) is x
    assert broadcast_object({"a": 1}, g) == {"a": 1}
    assert all_gather_object("m", g) == ["m"]
    comm.barrier(g)
    assert collective_counts() == _counts()
    with pytest.raises(ValueError, match="rows"):
        all_gather(x, g, sizes=[3])
    with pytest.raises(TypeError, match="cannot reduce"):  # same error at TP1 as at TP8
        reduce_scatter(x.to(FP8), g)
