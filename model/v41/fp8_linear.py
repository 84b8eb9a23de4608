"""DeepSeek-V4.1's FP8 linears, held as stored and run as MXFP8 on the GPU, or dequantized.

The released checkpoint stores every attention projection (``wq_a``, ``wq_b``, ``wkv``,
``wo_a``, ``wo_b``), the indexer's ``wq_b``, the shared expert (``w1``, ``w2``, ``w3``) and
the engram ``wkv`` as e4m3 values with one UE8M0 scale per 32×32 block (``.weight`` +
``.scale``); the compressors, ``weights_proj``, ``wk``, the router, embeddings and head are
BF16. With ``mxfp8_linears`` the model keeps those FP8 tensors as they are stored
(:class:`MXFP8Linear`, under the checkpoint's names) and runs them through
``kernels.mxfp8_gemm.mxfp8_linear``: the activation quantized to MXFP8 (e4m3 + UE8M0 per 1×32
along K) by one fused launch, then the MXFP8 GEMM (the CUDA C++ kernel on SM90, Triton on
other GPUs). The attention output takes ``kernels.mxfp8_o_proj.mxfp8_o_proj``: inverse RoPE
fused into o's quantization, the grouped ``wo_a`` writing z as MXFP8, then ``wo_b``; on the
CPU both run their torch references (the same numerics). Without it (the CPU default, and
what ``dequantized`` asks for) the loader multiplies the blocks out to the model dtype (exact)
and the linears are ``nn.Linear``. :func:`choose_mxfp8_linears` is the switch
(``--linear-backend``), decided once at load.

Numerics against HF's V4.1, which dequantizes the weights and quantizes no activation: the
weights are the same values either way. Added are

* each FP8 linear's input rounded to MXFP8 (1×32, UE8M0 scale ``2^ceil(log2(amax/448))``),
  as DeepSeek's reference inference does before every FP8 GEMM, z before ``wo_b`` included
  (``wo_a``'s output is rounded to bf16 first, in a float32 model too);
* the inverse-rotated attention output o' rounded to MXFP8 before ``wo_a``: ours (neither HF
  nor DeepSeek's reference quantizes it; vLLM's fused SM100 path does);
* fp32 accumulation promoted per 32 of K, the sum rounded once to the output dtype.

e4m3 keeps 3 mantissa bits, so a rounding moves a value by at most 2^-4 of itself (more for
values below about 2^-14 of their block's largest: e4m3's subnormals);
tests/model/test_v41_mxfp8_linears.py bounds what that does to a random model's logits.

Under tensor parallelism (model/v4_sharding.py) ``wq_b`` rows (heads), ``wo_a`` rows (output
groups) and the shared expert's ``w1``/``w3`` rows are cut by rank, ``wo_b`` and ``w2``
columns; the partial sums after ``wo_b`` and ``w2`` are reduced by the caller as before. A cut
must fall on the 32×32 scale blocks: :func:`mxfp8_shape_problem` names the tensor that a TP size
would cut inside a block.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from kernels.mxfp8_gemm import LINEAR_BACKENDS, MX_BLOCK, choose_linear_backend, mxfp8_linear
from kernels.weight_formats import E8M0_DTYPE, FP8_DTYPE, dequantize_fp8_blocks
from model.loader import CheckpointError
from model.parallel import ParallelContext
from model.v41.config import V41Config
from model.v4_sharding import ShardingError, local_shape

logger = logging.getLogger(__name__)

MXFP8_WEIGHT_BLOCK = (MX_BLOCK, MX_BLOCK)
# Released names of the FP8 linears' weights (each has a ``.scale`` beside it).
FP8_LINEAR_WEIGHTS = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
                                r"|engram\.wkv)\.weight$")


class MXFP8Linear(nn.Module):
    """y = x·Wᵀ from W as stored: ``weight`` e4m3 [N, K] and ``scale`` UE8M0 [ceil(N/32), K/32]
    (buffers, under the checkpoint's names). ``groups`` > 1: block-diagonal, x [..., groups·K]
    and group g's rows g·N/groups … (V4.1's ``wo_a``)."""

    def __init__(self, in_features: int, out_features: int, groups: int = 1) -> None:
        super().__init__()
        if in_features % MX_BLOCK or (groups > 1 and (out_features // groups) % MX_BLOCK):
            raise ValueError(f"an MXFP8 linear needs K ({in_features}) and a group's rows "
                             f"({out_features // groups}) in multiples of {MX_BLOCK}")
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE))
        self.register_buffer("scale", torch.empty(-(-out_features // MX_BLOCK), in_features // MX_BLOCK,
                                                  dtype=E8M0_DTYPE))

    @property
    def operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 weight, UE8M0 scales): what ``kernels.mxfp8_o_proj`` takes."""
        return self.weight, self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mxfp8_linear(x, self.weight, self.scale, groups=self.groups)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight's values [N, K] (exact in bf16 and float32)."""
        return dequantize_fp8_blocks(self.weight, self.scale, MXFP8_WEIGHT_BLOCK, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, groups={self.groups}, mxfp8"


def fp8_linear(in_features: int, out_features: int, dtype: torch.dtype, mxfp8: bool) -> nn.Module:
    """A linear the checkpoint stores as FP8: :class:`MXFP8Linear`, or a bias-free ``nn.Linear``."""
    if mxfp8:
        return MXFP8Linear(in_features, out_features)
    return nn.Linear(in_features, out_features, bias=False, dtype=dtype)


def fp8_linear_shapes(config: V41Config) -> list[tuple[str, tuple[int, int]]]:
    """(HF name of the first layer's tensor, full [N, K]) of each kind of FP8 linear."""
    c = config
    heads, hd, groups, rank = c.num_attention_heads, c.head_dim, c.o_groups, c.o_lora_rank
    shared = c.moe_intermediate_size * c.n_shared_experts
    a, f = "model.layers.0.attn.", "model.layers.0.ffn.shared_experts."
    out = [(a + "wq_a.weight", (c.q_lora_rank, c.hidden_size)), (a + "wq_b.weight", (heads * hd, c.q_lora_rank)),
           (a + "wkv.weight", (hd, c.hidden_size)), (a + "wo_a.weight", (groups * rank, heads * hd // groups)),
           (a + "wo_b.weight", (c.hidden_size, groups * rank)),
           (f + "w1.weight", (shared, c.hidden_size)), (f + "w3.weight", (shared, c.hidden_size)),
           (f + "w2.weight", (c.hidden_size, shared))]
    if c.index_source_layer_ids:
        out.append((f"model.layers.{c.index_source_layer_ids[0]}.attn.indexer.wq_b.weight",
                    (c.index_n_heads * c.index_head_dim, c.q_lora_rank)))
    if c.engram_layer_ids:
        cols = (c.engram_max_ngram_size - 1) * c.engram_n_heads * c.engram_head_dim
        out.append((f"model.layers.{c.engram_layer_ids[0]}.engram.wkv.weight",
                    ((c.hc_mult + 1) * c.hidden_size, cols)))
    return out


def mxfp8_shape_problem(config: V41Config, tp_size: int = 1) -> str | None:
    """Why this config's FP8 linears cannot run as MXFP8 on a rank of a ``tp_size`` TP group
    (one line naming the tensor), or None: every rank's K and its cut rows / columns must be
    whole 32-blocks, and ``wo_a``'s output groups whole blocks of rows."""
    for name, (n, k) in fp8_linear_shapes(config):
        try:
            rows, cols = local_shape(name, (n, k), tp_size)
        except ShardingError as exc:
            return str(exc)
        for what, full, part in (("row", n, rows), ("column", k, cols)):
            if part != full and part % MX_BLOCK:
                return (f"--tensor-parallel-size {tp_size} cuts {name} [{n}, {k}] into {part}-{what} shards, "
                        f"which split its {MX_BLOCK}×{MX_BLOCK} FP8 scale blocks")
        if cols % MX_BLOCK:
            return f"{name} has {cols} input columns, not a multiple of the MXFP8 block {MX_BLOCK}"
        if name.endswith("wo_a.weight") and config.o_lora_rank % MX_BLOCK:
            return (f"{name}: o_lora_rank {config.o_lora_rank} (rows per output group) is not a multiple of "
                    f"{MX_BLOCK}, which the grouped MXFP8 GEMM needs")
    return None


def choose_mxfp8_linears(config: V41Config, backend: str, device: torch.device | str, dtype: torch.dtype,
                         par: ParallelContext | None = None, stored_fp8: bool = True) -> bool:
    """Whether the FP8 linears run as MXFP8 (``backend``: ``--linear-backend``, see
    ``kernels.mxfp8_gemm.choose_linear_backend``); logs the choice in one line. ``stored_fp8``:
    the checkpoint (or the random preset) holds them as e4m3 with 32×32 UE8M0 blocks. ``auto``
    falls back to the dequantized linears where MXFP8 cannot run; an explicit ``mxfp8`` that
    cannot is one :class:`CheckpointError` line naming the flag (and the tensor)."""
    try:
        path, why = choose_linear_backend(backend, torch.device(device), dtype)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    problem = None
    if path == "mxfp8":
        if not stored_fp8:
            problem = "the checkpoint does not store its FP8 linears as e4m3 with 32×32 UE8M0 block scales"
        else:
            problem = mxfp8_shape_problem(config, (par or ParallelContext()).tp_size)
    if problem and backend == "mxfp8":
        raise CheckpointError(f"--linear-backend mxfp8: {problem}")
    if problem:
        path, why = "dequantized", f"auto: {problem}"
    if not stored_fp8 and path == "dequantized":
        return False  # nothing to say: the linears are plain
    if path == "mxfp8":
        logger.info("DeepSeek-V4.1: FP8 linears run as MXFP8 (e4m3 weights with 32x32 UE8M0 scales, activations "
                    "quantized per 1x32; --linear-backend %s)", why)
    else:
        logger.info("DeepSeek-V4.1: FP8 linears dequantized to %s (--linear-backend %s)",
                    str(dtype).replace("torch.", ""), why)
    return path == "mxfp8"


def check_dequantized_linears(backend: str, model_name: str) -> None:
    """Models without MXFP8 linears (V4's 128×128 FP8 blocks, R1/V3/V2) take ``--linear-backend``
    auto or dequantized; anything else is one :class:`CheckpointError` line."""
    if backend not in LINEAR_BACKENDS:
        raise CheckpointError(f"--linear-backend: unknown backend {backend!r}; one of {', '.join(LINEAR_BACKENDS)}")
    if backend == "mxfp8":
        raise CheckpointError(f"--linear-backend mxfp8: {model_name} has no MXFP8 linears (only DeepSeek-V4.1's "
                              f"FP8 linears, e4m3 with 32×32 UE8M0 blocks, run as MXFP8); use auto or dequantized")


__all__ = ["FP8_LINEAR_WEIGHTS", "MXFP8Linear", "MXFP8_WEIGHT_BLOCK", "check_dequantized_linears",
           "choose_mxfp8_linears", "fp8_linear", "fp8_linear_shapes", "mxfp8_shape_problem"]
