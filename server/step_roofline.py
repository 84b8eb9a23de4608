"""What a step of an MLA model (DeepSeek V2/V3/R1) must cost at least: its useful FLOPs and the
HBM bytes it cannot avoid reading, so the step profile can print each step kind next to its
compute and byte rooflines (issue targets are stated as "% of the roofline").

Counted per GPU (heads and experts divided over ``tp_size``), for the step's sequences as the
runner plans them (decode rows first, one token each; then prefill chunks of ``query_len`` new
tokens after ``context_len`` cached ones):

* FLOPs: 2 x parameters x rows for every linear (q, kv_a, o_proj, dense MLP, shared and top-k
  routed experts, router, lm_head on the rows that get logits); the decode rows' absorbed
  W_UK / W_UV products; ``kv_b_proj`` over each chunk's prefix and new rows (the non-absorbed
  prefill up-projects its cached prefix too); attention over the keys each query may see
  (causal inside a chunk: no masked-tile waste). An FP8 checkpoint's linears and decode attention
  over an FP8 cache count at the FP8 GEMM rate, the rest at the bf16 rate.
* Bytes: every weight the step touches, once (routed experts: the expected number of distinct
  experts hit by ``rows x top_k`` uniform picks); the latent cache rows read (decode: the whole
  context; prefill: the prefix) and written. Activations are left out (a lower bound).

The rates to divide by come from :func:`measure_ceilings` (bf16 and FP8 dense GEMM, HBM copy)
measured on the GPU that runs the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from model.config import ModelConfig


def expected_distinct_experts(num_experts: int, top_k: int, batch: float) -> float:
    """Expected distinct experts ``batch`` tokens touch, each choosing ``top_k`` of ``num_experts``
    independently and uniformly: ``E·(1 − (1 − k/E)^B)``."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


@dataclass(frozen=True)
class StepCost:
    fp8_flops: float  # at the FP8 rate: an FP8 checkpoint's linears, decode attention over an FP8 cache
    bf16_flops: float  # at the bf16 rate: everything else
    weight_bytes: float
    kv_bytes: float

    def __add__(self, other: "StepCost") -> "StepCost":
        return StepCost(self.fp8_flops + other.fp8_flops, self.bf16_flops + other.bf16_flops,
                        self.weight_bytes + other.weight_bytes, self.kv_bytes + other.kv_bytes)

    @property
    def flops(self) -> float:
        return self.fp8_flops + self.bf16_flops

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class Ceilings:
    """Measured rates of the GPU: dense GEMM (FLOP/s) in bf16 and FP8, HBM copy (bytes/s)."""

    bf16_flops: float
    fp8_flops: float
    hbm_bytes: float


class MLAStepCostModel:
    """Lower bounds on one step's work for ``config`` (an MLA model) on one of ``tp_size`` GPUs.
    ``fp8_weights``: the linears are held in FP8 (one byte per parameter, FP8 GEMM rate); the
    router, the LM head and the derived W_UK / W_UV stay in the ``weight_bytes`` compute dtype.
    ``kv_bytes_per_value`` 1 (an FP8 cache): decode attention counts at the FP8 rate (our decode
    kernels multiply FP8 operands); prefill attention runs on up-projected bf16 keys."""

    def __init__(self, config: ModelConfig, *, fp8_weights: bool, weight_bytes: int = 2,
                 kv_bytes_per_value: float = 2.0, tp_size: int = 1) -> None:
        c = config
        self.fp8_weights = fp8_weights
        self.quantized_elt = 1.0 if fp8_weights else float(weight_bytes)
        self.bf16_elt = float(weight_bytes)
        self.kv_elt = float(kv_bytes_per_value)
        self.latent = c.kv_lora_rank + c.qk_rope_head_dim
        heads = c.num_attention_heads / tp_size
        self.heads, self.kv_lora = heads, c.kv_lora_rank
        self.qk, self.v = c.qk_head_dim, c.v_head_dim
        d = c.hidden_size
        q = (d * c.q_lora_rank + c.q_lora_rank * heads * self.qk) if c.q_lora_rank else d * heads * self.qk
        # Per token, every layer: q, kv_a, o_proj (replicated parts counted whole).
        self.attn_params = q + d * self.latent + heads * c.v_head_dim * d
        self.kv_b_params = c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
        self.absorbed_params = heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank  # W_UK + W_UV
        self.num_layers = c.num_hidden_layers
        self.num_moe = sum(1 for i in range(c.num_hidden_layers) if c.is_moe_layer(i))
        self.num_dense = c.num_hidden_layers - self.num_moe
        self.dense_mlp_params = 3 * d * c.intermediate_size / tp_size
        self.expert_params = 3 * d * c.moe_intermediate_size
        self.experts = c.n_routed_experts or 0
        self.top_k = c.num_experts_per_tok or 0
        self.shared_params = (c.n_shared_experts or 0) * self.expert_params / tp_size
        self.router_params = d * self.experts
        self.tp_size = tp_size
        self.lm_head_params = d * c.vocab_size / tp_size

    def cost(self, context_lens: Sequence[int], query_lens: Sequence[int], num_decodes: int,
             num_logit_rows: int) -> StepCost:
        """The step's work: sequences in plan order (the first ``num_decodes`` are decode rows)."""
        rows = int(sum(query_lens))
        layers = self.num_layers
        decode_keys = sum(c + 1 for c in context_lens[:num_decodes])
        chunks = list(zip(context_lens[num_decodes:], query_lens[num_decodes:]))
        prefix_rows = sum(c for c, _ in chunks)
        causal_keys = sum(n * c + n * (n + 1) / 2 for c, n in chunks)

        # kv_b_proj up-projects each chunk's prefix and new rows (decode rows use W_UK / W_UV).
        kv_b_rows = prefix_rows + rows - num_decodes
        routed = self.top_k * self.expert_params / self.tp_size
        quantized = layers * (rows * self.attn_params + kv_b_rows * self.kv_b_params)
        quantized += rows * (self.num_dense * self.dense_mlp_params + self.num_moe * (routed + self.shared_params))
        decode_attention = layers * self.heads * decode_keys * (self.latent + self.kv_lora)
        bf16 = layers * (num_decodes * self.absorbed_params + self.heads * causal_keys * (self.qk + self.v))
        bf16 += self.num_moe * rows * self.router_params + num_logit_rows * self.lm_head_params
        fp8, bf16 = (quantized, bf16) if self.fp8_weights else (0.0, bf16 + quantized)
        if self.kv_elt == 1.0:
            fp8 += decode_attention
        else:
            bf16 += decode_attention

        hit = expected_distinct_experts(self.experts, self.top_k, rows) if self.experts else 0.0
        quantized_params = layers * self.attn_params + self.num_dense * self.dense_mlp_params
        quantized_params += self.num_moe * (hit / self.tp_size * self.expert_params + self.shared_params)
        quantized_params += layers * self.kv_b_params if chunks else 0.0
        bf16_params = self.num_moe * self.router_params + self.lm_head_params
        bf16_params += layers * self.absorbed_params if num_decodes else 0.0
        kv_rows = decode_keys + prefix_rows + rows  # read the context; write this step's rows
        return StepCost(fp8_flops=2.0 * fp8, bf16_flops=2.0 * bf16,
                        weight_bytes=quantized_params * self.quantized_elt + bf16_params * self.bf16_elt,
                        kv_bytes=layers * kv_rows * self.latent * self.kv_elt)

    def roofline_s(self, cost: StepCost, ceilings: Ceilings) -> tuple[float, float]:
        """(compute-bound seconds, byte-bound seconds) of ``cost`` at ``ceilings``."""
        compute = cost.fp8_flops / ceilings.fp8_flops + cost.bf16_flops / ceilings.bf16_flops
        return compute, cost.bytes / ceilings.hbm_bytes


def mla_step_costs(model, config) -> MLAStepCostModel | None:
    """The cost model of a served ``DeepseekForCausalLM`` under the engine ``config`` (None for
    other models)."""
    c = getattr(model, "config", None)
    if not isinstance(c, ModelConfig):
        return None
    return MLAStepCostModel(c, fp8_weights=getattr(model, "fp8_block", None) is not None,
                            weight_bytes=torch.finfo(model.dtype).bits // 8,
                            kv_bytes_per_value=1.0 if config.use_fp8_kv_cache else torch.finfo(model.dtype).bits / 8,
                            tp_size=config.tensor_parallel_size)


def measure_ceilings(device: torch.device, size: int = 4096, copy_bytes: int = 256 << 20) -> Ceilings:
    """Dense bf16 and FP8 (``torch._scaled_mm``) GEMM rates at ``size``^3 and the HBM copy rate
    (read + write bytes) of ``copy_bytes`` (5x an H200's L2), each the median of timed repeats after
    a warm-up. Small enough to fit beside a full KV cache at the end of a run."""

    def median_s(fn, reps: int = 20) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return sorted(times)[len(times) // 2]

    def gemm_rates() -> tuple[float, float]:
        a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        fp8 = median_s(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        return 2.0 * size**3 / median_s(lambda: a @ b), 2.0 * size**3 / fp8

    def copy_rate() -> float:
        src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return 2.0 * copy_bytes / median_s(lambda: dst.copy_(src))

    with torch.cuda.device(device):
        bf16, fp8 = gemm_rates()
        hbm = copy_rate()
        torch.cuda.empty_cache()
    return Ceilings(bf16_flops=bf16, fp8_flops=fp8, hbm_bytes=hbm)
