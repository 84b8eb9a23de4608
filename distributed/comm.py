"""Every collective mlaserve runs, in one place.

Callers pass a :class:`~distributed.parallel_state.GroupCoordinator`. The choice of
primitive follows vLLM PR #29795: when every rank contributes the same number of rows the
single-call ``all_gather_single``/``reduce_scatter_single`` (one ncclAllGather /
ncclReduceScatter) runs; only truly unequal sizes take a v-variant:

- all-gather-v: NCCL gets torch's uneven-list ``all_gather`` (grouped broadcasts, Σ rows on
  the wire); gloo rejects uneven lists, so it gathers rows padded to the max and trims.
- reduce-scatter-v: torch's uneven-list ``reduce_scatter`` (NCCL: grouped reduces; gloo:
  all-reduce emulation).

A rank with zero rows still calls the collective, so ranks stay in step. FP8 tensors travel
as uint8 views (no backend has fp8 collectives); reducing fp8 is an error, not a silent
upcast. Size-1 groups return the input untouched without any bookkeeping.

``collective_counts()`` records which path ran (for tests and /metrics). Control messages
go over the gloo CPU group as msgpack bytes — never pickle, which would execute whatever a
peer on the network sends.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack
import torch
import torch.distributed as dist

from distributed.parallel_state import GroupCoordinator

# torch 2.13 renamed the *_tensor collectives (the old names warn); use whichever exists.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_FP8_DTYPES = frozenset(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n))
# Gathered/broadcast bit-for-bit through a uint8 view; never reduced.
_BYTE_VIEW_DTYPES = _FP8_DTYPES | {torch.bool}

_COUNTER_NAMES = ("all_gather_tensor", "all_gather_v", "reduce_scatter_tensor", "reduce_scatter_v",
                  "all_reduce", "broadcast", "broadcast_object", "all_gather_object", "barrier")
_counts: dict[str, int] = dict.fromkeys(_COUNTER_NAMES, 0)

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}


def collective_counts() -> dict[str, int]:
    """How many times each collective path ran in this process since the last reset."""
    return dict(_counts)


def reset_collective_counts() -> None:
    for k in _counts:
        _counts[k] = 0


def all_gather(x: torch.Tensor, group: GroupCoordinator, dim: int = 0,
               sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order.

    ``sizes[r]`` is rank r's extent along ``dim`` (identical list on every rank); None
    means all ranks have ``x.shape[dim]`` rows. Other dims must match across ranks.
    """
    if group.world_size == 1:
        if sizes is not None:
            _check_sizes(sizes, x, dim, group, "all_gather")
        return x
    dim = _norm_dim(dim, x)
    if sizes is not None:
        _check_sizes(sizes, x, dim, group, "all_gather")
        if all(s == sizes[0] for s in sizes):
            sizes = None
    byte_view = x.dtype in _BYTE_VIEW_DTYPES
    xs = x.view(torch.uint8) if byte_view else x
    xs = xs.movedim(dim, 0).contiguous() if dim else xs.contiguous()
    world = group.world_size
    if sizes is None:
        _counts["all_gather_tensor"] += 1
        out = xs.new_empty((world * xs.shape[0],) + tuple(xs.shape[1:]))
        _all_gather_single(out, xs, group=group.device_group)
    else:
        _counts["all_gather_v"] += 1
        out = _all_gather_v(xs, group, list(sizes))
    if dim:
        out = out.movedim(0, dim).contiguous()
    return out.view(x.dtype) if byte_view else out


def _all_gather_v(xs: torch.Tensor, group: GroupCoordinator, sizes: list[int]) -> torch.Tensor:
    rest = tuple(xs.shape[1:])
    if group.backend == "nccl":
        out = xs.new_empty((sum(sizes),) + rest)
        dist.all_gather(list(out.split(sizes)), xs, group=group.device_group)
        return out
    # gloo: uneven all_gather lists are rejected, so pad every rank to the max and trim.
    width = max(sizes)
    if xs.shape[0] < width:
        padded = xs.new_empty((width,) + rest)
        padded[: xs.shape[0]] = xs
        xs = padded
    buf = xs.new_empty((group.world_size * width,) + rest)
    _all_gather_single(buf, xs, group=group.device_group)
    return torch.cat([buf[r * width: r * width + s] for r, s in enumerate(sizes)])


def reduce_scatter(x: torch.Tensor, group: GroupCoordinator, dim: int = 0,
                   sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's slice along ``dim``.

    ``sizes[r]`` is the extent rank r keeps (they sum to ``x.shape[dim]``); None splits
    ``x.shape[dim]`` evenly, which must then be divisible by the group size (pad tokens
    to a multiple of TP to get the single ReduceScatter).
    """
    _check_reducible(x, "reduce_scatter")
    world = group.world_size
    if world == 1:
        if sizes is not None:
            _check_split(sizes, x, dim, group)
        return x
    dim = _norm_dim(dim, x)
    if sizes is not None:
        _check_split(sizes, x, dim, group)
        if all(s == sizes[0] for s in sizes):
            sizes = None
    elif x.shape[dim] % world:
        raise ValueError(
            f"reduce_scatter: dim {dim} has {x.shape[dim]} rows, not divisible by the "
            f"{group.name} group size {world}; pad it or pass sizes")
    xs = x.movedim(dim, 0).contiguous() if dim else x.contiguous()
    rest = tuple(xs.shape[1:])
    if sizes is None:
        _counts["reduce_scatter_tensor"] += 1
        out = xs.new_empty((xs.shape[0] // world,) + rest)
        _reduce_scatter_single(out, xs, group=group.device_group)
    else:
        _counts["reduce_scatter_v"] += 1
        out = xs.new_empty((sizes[group.rank_in_group],) + rest)
        dist.reduce_scatter(out, list(xs.split(list(sizes))), group=group.device_group)
    return out.movedim(0, dim).contiguous() if dim else out


def all_reduce(x: torch.Tensor, group: GroupCoordinator, op: str = "sum") -> torch.Tensor:
    """Reduce ``x`` over the group (op: sum, max, min, product).

    Reduces in place when ``x`` is contiguous; always use the returned tensor.
    """
    _check_reducible(x, "all_reduce")
    if group.world_size == 1:
        return x
    try:
        red = _OPS[op]
    except KeyError:
        raise ValueError(f"all_reduce: op must be one of {', '.join(_OPS)}, got {op!r}") from None
    _counts["all_reduce"] += 1
    xs = x if x.is_contiguous() else x.contiguous()
    dist.all_reduce(xs, op=red, group=group.device_group)
    return xs


def broadcast(x: torch.Tensor, group: GroupCoordinator, src: int = 0) -> torch.Tensor:
    """Copy group rank ``src``'s ``x`` into every rank's ``x`` (same shape and dtype)."""
    if group.world_size == 1:
        return x
    _check_src(src, group)
    _counts["broadcast"] += 1
    xs = x.view(torch.uint8) if x.dtype in _BYTE_VIEW_DTYPES else x
    buf = xs if xs.is_contiguous() else xs.contiguous()
    dist.broadcast(buf, src=group.ranks[src], group=group.device_group)
    if buf is not xs:
        xs.copy_(buf)
    return x


def barrier(group: GroupCoordinator) -> None:
    """Wait on the CPU group until every rank of ``group`` arrives."""
    if group.world_size == 1:
        return
    _counts["barrier"] += 1
    dist.barrier(group=group.cpu_group)


def broadcast_object(obj, group: GroupCoordinator, src: int = 0):
    """Send a small msgpack-able object (dict/list/str/int/float/bool/bytes/None) from
    group rank ``src`` to all ranks over the CPU group; other ranks' ``obj`` is ignored.

    Tuples arrive as lists. Two gloo broadcasts: length, then bytes.
    """
    if group.world_size == 1:
        return obj
    _check_src(src, group)
    root = group.ranks[src]
    if group.rank_in_group == src:
        payload = _pack(obj)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    _counts["broadcast_object"] += 1
    dist.broadcast(length, src=root, group=group.cpu_group)
    if group.rank_in_group != src:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=root, group=group.cpu_group)
    return obj if group.rank_in_group == src else _unpack(payload)


def all_gather_object(obj, group: GroupCoordinator) -> list:
    """Every rank's msgpack-able ``obj``, in group rank order, over the CPU group."""
    if group.world_size == 1:
        return [obj]
    payload = _pack(obj)
    _counts["all_gather_object"] += 1
    lengths = torch.empty(group.world_size, dtype=torch.int64)
    _all_gather_single(lengths, torch.tensor([payload.numel()], dtype=torch.int64),
                       group=group.cpu_group)
    sizes = lengths.tolist()
    width = max(sizes)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    buf = torch.empty(group.world_size * width, dtype=torch.uint8)
    _all_gather_single(buf, padded, group=group.cpu_group)
    return [obj if r == group.rank_in_group else _unpack(buf[r * width: r * width + s])
            for r, s in enumerate(sizes)]


def _pack(obj) -> torch.Tensor:
    try:
        data = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"control message is not msgpack-serialisable ({e}); send plain "
                        "dicts/lists/str/int/float/bool/bytes/None, or tensors via broadcast") from e
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _unpack(t: torch.Tensor):
    return msgpack.unpackb(t.numpy().tobytes(), raw=False, strict_map_key=False)


def _norm_dim(dim: int, x: torch.Tensor) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a {x.dim()}-d tensor")
    return dim % x.dim()


def _check_sizes(sizes: Sequence[int], x: torch.Tensor, dim: int, group: GroupCoordinator,
                 what: str) -> None:
    if len(sizes) != group.world_size:
        raise ValueError(f"{what}: {len(sizes)} sizes for a {group.name} group of {group.world_size}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"{what}: negative size in {list(sizes)}")
    mine = sizes[group.rank_in_group]
    if x.shape[dim] != mine:
        raise ValueError(f"{what}: this rank's tensor has {x.shape[dim]} rows along dim {dim} "
                         f"but sizes[{group.rank_in_group}] = {mine}")


def _check_split(sizes: Sequence[int], x: torch.Tensor, dim: int, group: GroupCoordinator) -> None:
    if len(sizes) != group.world_size:
        raise ValueError(f"reduce_scatter: {len(sizes)} sizes for a {group.name} group of "
                         f"{group.world_size}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"reduce_scatter: negative size in {list(sizes)}")
    if sum(sizes) != x.shape[dim]:
        raise ValueError(f"reduce_scatter: sizes {list(sizes)} sum to {sum(sizes)} but dim {dim} "
                         f"has {x.shape[dim]} rows")


def _check_reducible(x: torch.Tensor, what: str) -> None:
    if x.dtype in _BYTE_VIEW_DTYPES:
        raise TypeError(f"{what}: cannot reduce {x.dtype} tensors (NCCL and gloo have no "
                        "fp8/bool reductions); upcast to bf16/fp32 before reducing")


def _check_src(src: int, group: GroupCoordinator) -> None:
    if not 0 <= src < group.world_size:
        raise ValueError(f"src must be a rank in the {group.name} group [0, {group.world_size}), got {src}")
