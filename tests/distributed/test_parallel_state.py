"""Group layout, the single-process default, and rendezvous failures of parallel_state."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed.comm import all_gather, all_gather_object, broadcast, collective_counts, reset_collective_counts
from distributed.launcher import find_free_port
from distributed.parallel_state import (DistributedInitError, ParallelConfig, destroy_distributed,
                                        get_dp_group, get_ep_group, get_parallel_config, get_tp_group,
                                        get_world_group, init_distributed, is_initialized)
from server.config import EngineConfig


def test_layout_tp2_dp2():
    cfg = ParallelConfig(tp_size=2, dp_size=2, enable_expert_parallel=True)
    assert cfg.world_size == 4
    assert cfg.tp_group_ranks() == [[0, 1], [2, 3]]
    assert cfg.dp_group_ranks() == [[0, 2], [1, 3]]
    assert cfg.ep_group_ranks() == [[0, 1, 2, 3]]
    assert [(cfg.dp_rank(r), cfg.tp_rank(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    no_ep = ParallelConfig(tp_size=2, dp_size=2)
    assert no_ep.ep_group_ranks() == [[0], [1], [2], [3]]


def test_layout_multi_node():
    cfg = ParallelConfig(tp_size=8, dp_size=2, nnodes=2, node_rank=1)
    assert cfg.local_world_size == 8
    assert [cfg.global_rank(i) for i in (0, 7)] == [8, 15]
    with pytest.raises(ValueError, match="local_rank"):
        cfg.global_rank(8)


@pytest.mark.parametrize("kwargs, match", [
    ({"tp_size": 0}, "tensor parallel"),
    ({"dp_size": 0}, "data parallel"),
    ({"tp_size": 3, "nnodes": 2}, "divisible by nnodes"),
    ({"nnodes": 2, "node_rank": 2}, "node_rank"),
    ({"master_port": 0}, "master_port"),
    ({"master_addr": "0.0.0.0"}, "wildcard"),
    ({"master_addr": "::"}, "wildcard"),
])
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_from_engine_config():
    ec = EngineConfig(tensor_parallel_size=4, data_parallel_size=2, enable_expert_parallel=True,
                      master_addr="10.0.0.5", master_port=4000, nnodes=2, node_rank=1)
    assert ParallelConfig.from_engine_config(ec) == ParallelConfig(4, 2, True, 2, 1, "10.0.0.5", 4000)


def test_default_is_single_process():
    assert not is_initialized()
    for get, name in ((get_world_group, "world"), (get_tp_group, "tp"), (get_dp_group, "dp"),
                      (get_ep_group, "ep")):
        g = get()
        assert (g.name, g.world_size, g.rank_in_group, g.ranks, g.device_group) == (name, 1, 0, [0], None)
    assert get_parallel_config().world_size == 1


def test_world_size_one_needs_no_process_group():
    init_distributed(0, 1, 0, ParallelConfig(), backend="gloo")
    try:
        assert is_initialized() and not dist.is_initialized()
        reset_collective_counts()
        x = torch.arange(6.0)
        assert all_gather(x, get_tp_group()) is x
        assert broadcast(x, get_dp_group()) is x
        assert sum(collective_counts().values()) == 0
        with pytest.raises(RuntimeError, match="already"):
            init_distributed(0, 1, 0, ParallelConfig(), backend="gloo")
    finally:
        destroy_distributed()
    assert not is_initialized()


def test_init_argument_checks():
    cfg = ParallelConfig(tp_size=2)
    with pytest.raises(ValueError, match="world_size"):
        init_distributed(0, 4, 0, cfg, backend="gloo")
    with pytest.raises(ValueError, match="rank"):
        init_distributed(2, 2, 0, cfg, backend="gloo")
    with pytest.raises(ValueError, match="backend"):
        init_distributed(0, 2, 0, cfg, backend="mpi")
    with pytest.raises(ValueError, match="does not match node"):
        init_distributed(1, 2, 0, cfg, backend="gloo")
    with pytest.raises(ValueError, match="local_rank"):
        init_distributed(1, 2, 1, ParallelConfig(tp_size=2, nnodes=2, node_rank=1), backend="gloo")
    assert not is_initialized()


def test_missing_peer_fails_within_timeout():
    cfg = ParallelConfig(tp_size=2, master_port=find_free_port())
    start = time.monotonic()
    with pytest.raises(DistributedInitError, match=r"only 1 of 2 ranks joined"):
        init_distributed(0, 2, 0, cfg, backend="gloo", timeout_s=1.0)
    assert time.monotonic() - start < 5
    assert not is_initialized() and not dist.is_initialized()


def test_unreachable_master_fails_within_timeout():
    cfg = ParallelConfig(tp_size=2, master_port=find_free_port())
    start = time.monotonic()
    with pytest.raises(DistributedInitError, match="could not reach the rendezvous"):
        init_distributed(1, 2, 1, cfg, backend="gloo", timeout_s=1.0)
    assert time.monotonic() - start < 5
    assert not is_initialized()


def _my_listening_addrs() -> list[str]:
    """Addresses (hex, as /proc/net prints them) this process listens on (store, gloo)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(path).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN, owned by us
                found.add(cols[1].split(":")[0])
    return sorted(found)


def _layout_worker(rank, world_size, local_rank, cfg, out_dir):
    init_distributed(rank, world_size, local_rank, cfg, backend="gloo", timeout_s=20,
                     collective_timeout_s=20)
    res = {"listen": _my_listening_addrs()}
    for name, g in (("world", get_world_group()), ("tp", get_tp_group()), ("dp", get_dp_group()),
                    ("ep", get_ep_group())):
        res[name] = {"ranks": g.ranks, "rank_in_group": g.rank_in_group, "size": g.world_size,
                     "gathered": all_gather(torch.tensor([rank]), g).tolist()}
    # broadcast from group rank 1 must come from that group's second member
    res["dp_bcast"] = broadcast(torch.tensor([rank]), get_dp_group(), src=1).tolist()
    res["objects"] = all_gather_object({"r": rank}, get_tp_group())
    destroy_distributed()
    res["after_destroy"] = [dist.is_initialized(), get_tp_group().world_size]
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(res))


def test_groups_tp2_dp2_ep(run_spawned, tmp_path):
    results = run_spawned(_layout_worker, 4, tmp_path, tp_size=2, dp_size=2, enable_expert_parallel=True)
    tp_groups, dp_groups = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    for rank, res in enumerate(results):
        tp = tp_groups[rank // 2]
        dp = dp_groups[rank % 2]
        assert res["world"] == {"ranks": [0, 1, 2, 3], "rank_in_group": rank, "size": 4,
                                "gathered": [0, 1, 2, 3]}
        assert res["tp"] == {"ranks": tp, "rank_in_group": rank % 2, "size": 2, "gathered": tp}
        assert res["dp"] == {"ranks": dp, "rank_in_group": rank // 2, "size": 2, "gathered": dp}
        assert res["ep"] == {"ranks": [0, 1, 2, 3], "rank_in_group": rank, "size": 4,
                             "gathered": [0, 1, 2, 3]}
        assert res["dp_bcast"] == [dp[1]]
        assert res["objects"] == [{"r": r} for r in tp]
        assert res["after_destroy"] == [False, 1]
    # rank 0's rendezvous store and every rank's gloo sockets listen on 127.0.0.1 only,
    # never on a wildcard address
    for res in results:
        assert res["listen"] == ["0100007F"]
