"""Tensor-parallel-aware linear layers with optional FP8 block-quantized weights.

Each parameter carries a ``weight_loader(param, full_tensor)`` that takes the checkpoint's
full tensor and copies in this rank's shard, so sharding lives beside the layer that owns
the weight (nano-vllm's habit). The collectives themselves are not here: a row-parallel
layer returns its partial sum and the caller reduces it (reduce-scatter or all-reduce).

FP8 weights (DeepSeek R1/V3 format): ``weight`` e4m3 [N, K] + ``weight_scale_inv`` fp32
[ceil(N/128), ceil(K/128)]; the forward calls the block-FP8 GEMM dispatch.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.fp8 import FP8_DTYPE


class ShardingError(ValueError):
    """A dimension cannot be split evenly across tensor-parallel ranks."""


def divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ShardingError(f"{what}={n} is not divisible by tensor-parallel size {parts}")
    return n // parts


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch for {name}: expected {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.data.copy_(loaded.to(param.dtype))


class LinearBase(nn.Module):
    """y = x Wᵀ with W stored [out_local, in_local]; FP8 blocks when ``fp8_block`` is set."""

    # Which dim of the full weight is sharded: 0 (output, column-parallel), 1 (input, row-parallel)
    shard_dim: int | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        fp8_block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.fp8_block = fp8_block
        out_local, in_local = out_features, in_features
        if self.shard_dim == 0:
            out_local = divide(out_features, tp_size, "output features")
        elif self.shard_dim == 1:
            in_local = divide(in_features, tp_size, "input features")
        self.out_local, self.in_local = out_local, in_local
        wdtype = FP8_DTYPE if fp8_block else dtype
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=wdtype), requires_grad=False)
        self.weight.weight_loader = self._load_weight
        if fp8_block:
            bn, bk = fp8_block
            if tp_size > 1 and ((self.shard_dim == 0 and out_local % bn) or (self.shard_dim == 1 and in_local % bk)):
                raise ShardingError(
                    f"FP8 block size {fp8_block} does not divide the per-rank shard ({out_local}x{in_local})"
                )
            self.weight_scale_inv = nn.Parameter(
                torch.empty(-(-out_local // bn), -(-in_local // bk), dtype=torch.float32), requires_grad=False
            )
            self.weight_scale_inv.weight_loader = self._load_scale
        else:
            self.weight_scale_inv = None

    # ---- loading ----------------------------------------------------------------------------
    def shard(self, full: torch.Tensor, dim: int | None, size: int) -> torch.Tensor:
        if dim is None or self.tp_size == 1:
            return full
        return full.narrow(dim, self.tp_rank * size, size)

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "weight") -> None:
        size = self.out_local if self.shard_dim == 0 else self.in_local
        _copy_checked(param, self.shard(loaded, self.shard_dim, size), name)

    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "weight_scale_inv") -> None:
        size = param.shape[self.shard_dim] if self.shard_dim is not None else 0
        _copy_checked(param, self.shard(loaded, self.shard_dim, size), name)

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is not None:
            from kernels.fp8_gemm import fp8_block_linear

            return fp8_block_linear(x, self.weight, self.weight_scale_inv, self.fp8_block, out_dtype=x.dtype)
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        q = f", fp8_block={self.fp8_block}" if self.fp8_block else ""
        return f"in={self.in_local}, out={self.out_local}, tp={self.tp_rank}/{self.tp_size}{q}"


class ReplicatedLinear(LinearBase):
    """Every rank holds the full weight (MLA's q_a / kv_a projections, the router)."""

    shard_dim = None


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks (q_b_proj, kv_b_proj: heads; gate/up: intermediate)."""

    shard_dim = 0


class RowParallelLinear(LinearBase):
    """Input features split across ranks (o_proj, down_proj); returns this rank's partial sum."""

    shard_dim = 1


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one weight (gate ‖ up), each sharded alike.

    The checkpoint holds the parts separately; ``load_part(i, tensor)`` places part ``i``.
    """

    def __init__(self, in_features: int, part_sizes: list[int], **kwargs) -> None:
        self.part_sizes = list(part_sizes)
        super().__init__(in_features, sum(part_sizes), **kwargs)
        self.local_part_sizes = [divide(p, self.tp_size, "merged output part") for p in part_sizes]
        if self.fp8_block and len(part_sizes) > 1 and any(p % self.fp8_block[0] for p in self.local_part_sizes):
            raise ShardingError(
                f"merged FP8 weight parts {self.local_part_sizes} must be multiples of the block {self.fp8_block[0]}"
            )

    def load_part(self, index: int, loaded: torch.Tensor, is_scale: bool = False, name: str = "") -> None:
        param = self.weight_scale_inv if is_scale else self.weight
        if is_scale:
            bn = self.fp8_block[0]
            sizes = [-(-p // bn) for p in self.local_part_sizes]
        else:
            sizes = self.local_part_sizes
        start = sum(sizes[:index])
        target = param.data.narrow(0, start, sizes[index])
        piece = self.shard(loaded, 0, sizes[index])
        if tuple(target.shape) != tuple(piece.shape):
            raise ValueError(f"shape mismatch for {name}: expected {tuple(target.shape)}, got {tuple(piece.shape)}")
        target.copy_(piece.to(param.dtype))
