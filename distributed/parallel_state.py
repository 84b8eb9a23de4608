"""Process groups for tensor parallelism (TP), data-parallel attention (DP) and expert
parallelism (EP).

Layout (PP = 1): world = DP × TP and global rank = dp_rank · TP + tp_rank, so TP groups are
contiguous blocks (the ranks that share one node's fast links when TP ≤ GPUs per node), DP
groups are strided by TP, and the EP group spans every rank when expert parallelism is on
(ep_rank = global rank). Each group is a :class:`GroupCoordinator` holding a device group
(NCCL on CUDA, gloo on CPU) for tensors and a gloo group for small CPU-side control
messages; collectives live in ``distributed/comm.py``.

Single process is the default: without :func:`init_distributed` (or with world size 1)
every accessor returns a size-1 group with no process group behind it, and every
collective in ``comm`` is an identity, so the single-GPU server and the CPU tests pay
nothing.

Rendezvous is torchrun-style (``MASTER_ADDR``/``MASTER_PORT``), identical on one node or
many. Its TCP store is bound to ``master_addr`` only (torch's own store listens on every
interface), because whoever can reach the store can join the job.
"""

from __future__ import annotations

import copy
import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29555
DEFAULT_INIT_TIMEOUT_S = 300.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0  # first collectives may wait for a slow weight load

# NVLink multicast (NVLS) can wedge shared multi-GPU hosts; it stays off everywhere NCCL is
# started or initialised (docs/architecture.md, "Tensor and expert parallelism").
NVLS_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

_INIT_BARRIER_KEY = "mlaserve/init_arrived"
_INIT_DONE_KEY = "mlaserve/init_done"


def _is_wildcard(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_unspecified
    except ValueError:
        return False


def _is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _loopback_interface() -> str:
    """Name of the loopback interface (IFF_LOOPBACK), 'lo' if it cannot be read."""
    try:
        for _, name in socket.if_nameindex():
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read().strip(), 16) & 0x8:
                    return name
    except OSError:
        pass
    return "lo"


class DistributedInitError(RuntimeError):
    """The process group could not be formed (missing peer, bad address, timeout)."""


@dataclass(frozen=True)
class ParallelConfig:
    """How ranks are laid out; the same object on every rank of every node."""

    tp_size: int = 1
    dp_size: int = 1
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tensor parallel size must be at least 1, got {self.tp_size}")
        if self.dp_size < 1:
            raise ValueError(f"data parallel size must be at least 1, got {self.dp_size}")
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(
                f"world size {self.world_size} (TP {self.tp_size} x DP {self.dp_size}) is not "
                f"divisible by nnodes {self.nnodes}")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")
        if not self.master_addr:
            raise ValueError("master_addr must not be empty")
        if _is_wildcard(self.master_addr):
            raise ValueError(
                f"master_addr {self.master_addr!r} is a wildcard address; give the address of "
                "node 0 (the rendezvous must not listen on every interface)")

    @classmethod
    def from_engine_config(cls, cfg) -> "ParallelConfig":
        """Build from ``server.config.EngineConfig`` (its vLLM-named flags)."""
        return cls(
            tp_size=cfg.tensor_parallel_size,
            dp_size=cfg.data_parallel_size,
            enable_expert_parallel=cfg.enable_expert_parallel,
            nnodes=cfg.nnodes,
            node_rank=cfg.node_rank,
            master_addr=cfg.master_addr,
            master_port=cfg.master_port,
        )

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size

    @property
    def local_world_size(self) -> int:
        """Ranks (processes, GPUs) on each node."""
        return self.world_size // self.nnodes

    def global_rank(self, local_rank: int) -> int:
        if not 0 <= local_rank < self.local_world_size:
            raise ValueError(f"local_rank must be in [0, {self.local_world_size}), got {local_rank}")
        return self.node_rank * self.local_world_size + local_rank

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp_size

    def tp_group_ranks(self) -> list[list[int]]:
        """Contiguous blocks of TP ranks, one list per DP rank."""
        return [[d * self.tp_size + t for t in range(self.tp_size)] for d in range(self.dp_size)]

    def dp_group_ranks(self) -> list[list[int]]:
        """Ranks holding the same TP shard across DP replicas (stride TP)."""
        return [[d * self.tp_size + t for d in range(self.dp_size)] for t in range(self.tp_size)]

    def ep_group_ranks(self) -> list[list[int]]:
        """All ranks form one EP group when expert parallelism is on; else each rank is alone."""
        if self.enable_expert_parallel:
            return [list(range(self.world_size))]
        return [[r] for r in range(self.world_size)]


@dataclass(eq=False)
class GroupCoordinator:
    """One process group as seen from this rank.

    ``device_group`` carries tensors (NCCL or gloo); ``cpu_group`` is always gloo and
    carries control messages. Both are None for a size-1 group, where every collective is
    an identity.
    """

    name: str
    ranks: list[int]
    global_rank: int
    backend: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    device_group: object | None = None
    cpu_group: object | None = None

    def __post_init__(self) -> None:
        if self.global_rank not in self.ranks:
            raise ValueError(f"{self.name} group {self.ranks} does not contain rank {self.global_rank}")
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(self.global_rank)
        if self.world_size > 1 and (self.device_group is None or self.cpu_group is None):
            raise ValueError(f"{self.name} group of size {self.world_size} needs process groups")

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def cpu_view(self) -> "GroupCoordinator":
        """The same ranks, seen through the gloo CPU group (for small control tensors)."""
        view = copy.copy(self)
        view.device_group = self.cpu_group
        view.backend = "gloo"
        return view

    def __repr__(self) -> str:
        return (f"GroupCoordinator({self.name}, rank {self.rank_in_group}/{self.world_size}, "
                f"ranks={self.ranks}, backend={self.backend})")


@dataclass
class _State:
    config: ParallelConfig
    world: GroupCoordinator
    tp: GroupCoordinator
    dp: GroupCoordinator
    ep: GroupCoordinator
    store: object | None = None


def _trivial(name: str, device: torch.device | None = None) -> GroupCoordinator:
    return GroupCoordinator(name, [0], 0, device=device or torch.device("cpu"))


_DEFAULT = _State(ParallelConfig(), _trivial("world"), _trivial("tp"), _trivial("dp"), _trivial("ep"))
_state: _State = _DEFAULT


def get_world_group() -> GroupCoordinator:
    return _state.world


def get_tp_group() -> GroupCoordinator:
    return _state.tp


def get_dp_group() -> GroupCoordinator:
    return _state.dp


def get_ep_group() -> GroupCoordinator:
    return _state.ep


def get_parallel_config() -> ParallelConfig:
    return _state.config


def is_initialized() -> bool:
    """True after :func:`init_distributed` (of any world size) and before destroy."""
    return _state is not _DEFAULT


def init_distributed(
    rank: int,
    world_size: int,
    local_rank: int,
    parallel_config: ParallelConfig,
    backend: str | None = None,
    timeout_s: float = DEFAULT_INIT_TIMEOUT_S,
    collective_timeout_s: float | None = None,
) -> None:
    """Join the job as ``rank`` and build the TP/DP/EP groups.

    ``timeout_s`` bounds the rendezvous: a peer that never arrives raises
    :class:`DistributedInitError` naming how many ranks did. ``collective_timeout_s``
    (default 30 min, or ``timeout_s`` when that is longer) bounds each collective after that.
    ``backend``: None picks NCCL when CUDA is available, else gloo.
    """
    global _state
    cfg = parallel_config
    if is_initialized():
        raise RuntimeError("distributed state is already initialised; call destroy_distributed() first")
    if world_size != cfg.world_size:
        raise ValueError(f"world_size {world_size} != TP {cfg.tp_size} x DP {cfg.dp_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if cfg.global_rank(local_rank) != rank:
        raise ValueError(
            f"rank {rank} with local_rank {local_rank} does not match node {cfg.node_rank} of "
            f"{cfg.nnodes} ({cfg.local_world_size} ranks per node: rank = node_rank * "
            f"{cfg.local_world_size} + local_rank)")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    if world_size == 1:
        _state = _State(cfg, *(_trivial(n, device) for n in ("world", "tp", "dp", "ep")))
        return

    os.environ.update(NVLS_OFF_ENV)
    os.environ["MASTER_ADDR"] = cfg.master_addr
    os.environ["MASTER_PORT"] = str(cfg.master_port)
    if _is_loopback(cfg.master_addr):
        # One host: keep gloo/NCCL bootstrap sockets on loopback too, unless told otherwise.
        lo = _loopback_interface()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)

    store = _rendezvous(rank, world_size, cfg, timeout_s)
    coll_timeout = datetime.timedelta(
        seconds=collective_timeout_s if collective_timeout_s is not None
        else max(timeout_s, DEFAULT_COLLECTIVE_TIMEOUT_S))
    kwargs = {"device_id": device} if backend == "nccl" else {}
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=coll_timeout, **kwargs)
    except Exception as e:
        raise DistributedInitError(
            f"rank {rank}: init_process_group({backend}) failed after the rendezvous at "
            f"{cfg.master_addr}:{cfg.master_port}: {e}") from e
    try:
        _state = _build_groups(cfg, rank, backend, device, coll_timeout, store)
    except BaseException:
        dist.destroy_process_group()
        raise


def destroy_distributed() -> None:
    """Tear down every process group and return to the single-process default."""
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = _DEFAULT


def _build_groups(cfg: ParallelConfig, rank: int, backend: str, device: torch.device,
                  timeout: datetime.timedelta, store) -> _State:
    """Create every group on every rank in one fixed order (new_group is collective)."""
    all_ranks = list(range(cfg.world_size))
    world_cpu = dist.group.WORLD if backend == "gloo" else dist.new_group(
        all_ranks, backend="gloo", timeout=timeout)
    world = GroupCoordinator("world", all_ranks, rank, backend, device, dist.group.WORLD, world_cpu)

    def make(name: str, rank_lists: list[list[int]]) -> GroupCoordinator:
        mine = None
        for ranks in rank_lists:
            if len(ranks) == 1:
                groups = (None, None)
            elif ranks == all_ranks:  # reuse the world communicators (saves NCCL memory)
                groups = (world.device_group, world.cpu_group)
            else:
                dev = dist.new_group(ranks, backend=backend, timeout=timeout)
                cpu = dev if backend == "gloo" else dist.new_group(ranks, backend="gloo", timeout=timeout)
                groups = (dev, cpu)
            if rank in ranks:
                mine = GroupCoordinator(name, list(ranks), rank,
                                        backend if len(ranks) > 1 else None, device, *groups)
        assert mine is not None, f"rank {rank} is in no {name} group"
        return mine

    tp = make("tp", cfg.tp_group_ranks())
    dp = make("dp", cfg.dp_group_ranks())
    ep = make("ep", cfg.ep_group_ranks())
    return _State(cfg, world, tp, dp, ep, store)


def _rendezvous(rank: int, world_size: int, cfg: ParallelConfig, timeout_s: float):
    """Open the TCP store (rank 0 hosts it, bound to master_addr) and wait for all ranks."""
    where = f"{cfg.master_addr}:{cfg.master_port}"
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        listener = _bind_listener(cfg.master_addr, cfg.master_port)
        try:
            store = dist.TCPStore(cfg.master_addr, cfg.master_port, None, True, timeout=timeout,
                                  wait_for_workers=False, master_listen_fd=listener.fileno())
        except Exception as e:
            listener.close()
            raise DistributedInitError(f"rank 0: could not start the rendezvous store at {where}: {e}") from e
        listener.detach()  # the store owns the socket now
    else:
        try:
            store = dist.TCPStore(cfg.master_addr, cfg.master_port, None, False, timeout=timeout)
        except Exception as e:
            raise DistributedInitError(
                f"rank {rank}: could not reach the rendezvous at {where} within {timeout_s:g} s "
                f"(is rank 0 / node 0 started, and is {cfg.master_addr} its address?): {e}") from e

    arrived = store.add(_INIT_BARRIER_KEY, 1)
    if arrived == world_size:
        store.set(_INIT_DONE_KEY, b"1")
    try:
        store.wait([_INIT_DONE_KEY], timeout)
    except Exception as e:
        try:
            arrived = store.add(_INIT_BARRIER_KEY, 0)
        except Exception:
            arrived = "?"
        raise DistributedInitError(
            f"rank {rank}: only {arrived} of {world_size} ranks joined the rendezvous at {where} "
            f"within {timeout_s:g} s; a peer (worker or node) is missing or failed to start") from e
    return store


def _bind_listener(addr: str, port: int) -> socket.socket:
    """A listening socket on exactly ``addr`` (not the wildcard torch's store would use)."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise DistributedInitError(f"cannot resolve master_addr {addr!r}: {e}") from e
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(512)
    except OSError as e:
        sock.close()
        raise DistributedInitError(
            f"rank 0 cannot listen on {addr}:{port}: {e} (the port may be taken, or {addr} is "
            "not an address of node 0)") from e
    return sock
