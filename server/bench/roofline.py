"""The decode step's HBM roofline for DeepSeek-V4-family models: the bytes one decode step over
``B`` requests must read from device memory, over the memory bandwidth.

A decode step reads, once each:

- the weights every token needs: attention (projections, compressor, indexer), norms, mHC,
  routers, shared experts, engram projections and the LM head (``dense_bytes``);
- per request, its token's embedding row and engram table rows (``per_request_bytes``);
- the routed experts the batch touches: with top-``k`` of ``E`` experts per token and tokens
  routed independently and uniformly, a layer touches ``E·(1 − (1 − k/E)^B)`` distinct experts
  in expectation, each ``expert_bytes`` in its stored dtype;
- the KV cache of the running requests: every row they hold, once (an upper bound on what
  sparse attention reads; the weights dominate at the shapes served).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from model.v4.moe import PackedExperts
from server.step_roofline import expected_distinct_experts

H200_HBM_BYTES_PER_S = 4.8e12


def decode_step_bytes(dense_bytes: float, per_request_bytes: float, expert_bytes: float, num_experts: int,
                      top_k: int, moe_layers: int, batch: float, kv_bytes_per_request: float) -> dict:
    """Bytes one decode step of ``batch`` requests reads, by part (see the module doc)."""
    experts = expected_distinct_experts(num_experts, top_k, batch)
    routed = moe_layers * experts * expert_bytes
    per_request = batch * per_request_bytes
    kv = batch * kv_bytes_per_request
    return {"dense_bytes": dense_bytes, "per_request_bytes": per_request, "routed_expert_bytes": routed,
            "kv_bytes": kv, "expected_experts_per_layer": experts,
            "total_bytes": dense_bytes + per_request + routed + kv}


@dataclass(frozen=True)
class DecodeWeights:
    """A model's weight bytes as a decode step reads them (stored dtypes)."""

    dense_bytes: int
    per_request_bytes: int
    expert_bytes: int  # one routed expert of one layer
    num_experts: int
    top_k: int
    moe_layers: int


_MXFP4_EXPERTS = ("w13_mxfp4", "w13_mxfp4_scale", "w2_mxfp4", "w2_mxfp4_scale")


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def decode_weights(model: nn.Module) -> DecodeWeights:
    """Split a V4 / V4.1 model's tensors (this rank's shard) into what every step reads, what
    each request's token reads (its embedding row, its engram rows) and the routed experts
    (``mlp.experts`` in V4, ``ffn.experts`` in V4.1, or V4.1's stacked MXFP4 experts when it runs
    from those: then the per-expert copies are not read)."""
    c = model.config
    layers = model.model.layers
    embed = model.model.embed_tokens if hasattr(model.model, "embed_tokens") else model.model.embed
    routed = 0
    per_request = embed.weight.shape[1] * embed.weight.element_size()
    skipped = _nbytes(embed) if embed.weight is not model.lm_head.weight else 0
    local = 0  # routed experts this rank holds, over all layers (all of them unless expert parallel)
    for layer in layers:
        moe = layer.mlp if hasattr(layer, "mlp") else layer.ffn
        stacked = [getattr(moe, n, None) for n in _MXFP4_EXPERTS]
        if all(t is not None for t in stacked):  # V4.1 running stacked MXFP4 experts: those are read
            routed += sum(t.numel() * t.element_size() for t in stacked)
            skipped += _nbytes(moe.experts)
            local += stacked[0].shape[0]
        else:
            routed += _nbytes(moe.experts)
            local += (moe.experts.num_experts if isinstance(moe.experts, PackedExperts)
                      else sum(1 for e in moe.experts if any(True for _ in e.parameters())))
        engram = getattr(layer, "engram", None)
        if engram is not None:
            table = engram.embed
            cols = c.engram_n_heads * (c.engram_max_ngram_size - 1)
            per_request += cols * sum(t[0].numel() * t.element_size() for t in (table.weight, table.scale))
            skipped += _nbytes(table)
    total = _nbytes(model)
    return DecodeWeights(dense_bytes=total - routed - skipped, per_request_bytes=per_request,
                         expert_bytes=routed // max(local, 1), num_experts=c.n_routed_experts,
                         top_k=c.num_experts_per_tok, moe_layers=len(layers))


def expert_format(model: nn.Module) -> str:
    """How the routed experts ran: ``mxfp4 (w4a8)`` etc. for V4.1's stacked MXFP4 experts (the
    path their last call took; ``mxfp4`` before any), else the experts' weight dtype."""
    for layer in model.model.layers:
        moe = layer.mlp if hasattr(layer, "mlp") else layer.ffn
        if getattr(moe, "w13_mxfp4", None) is not None:
            path = getattr(moe, "mxfp4_path", None)
            return f"mxfp4 ({path})" if path else "mxfp4"
        weights = [p for p in moe.experts.parameters()]
        if weights:
            return str(weights[0].dtype).replace("torch.", "")
    return "none"


def linear_format(model: nn.Module) -> str:
    """How the dense linears ran: ``mxfp8`` for V4.1's FP8 linears held as stored (model/v41/fp8_linear.py),
    else the model's weight dtype."""
    if getattr(model, "mxfp8_linears", False):
        return "mxfp8"
    return str(next(model.parameters()).dtype).replace("torch.", "")


def decode_roofline(model: nn.Module, step_profile: dict, kv_bytes_per_request: float,
                    bandwidth: float = H200_HBM_BYTES_PER_S) -> dict | None:
    """The roofline at the measured mean decode batch of ``step_profile`` (StepProfiler.summary())
    beside the measured mean decode step time; None when the profile has no decode steps."""
    decodes = [k for name, k in step_profile["kinds"].items() if name.startswith("decode")]
    steps = sum(k["steps"] for k in decodes)
    if not steps:
        return None
    batch = sum(k["mean_batch"] * k["steps"] for k in decodes) / steps
    measured_s = sum(k["total_s"] for k in decodes) / steps
    w = decode_weights(model)
    parts = decode_step_bytes(w.dense_bytes, w.per_request_bytes, w.expert_bytes, w.num_experts, w.top_k,
                              w.moe_layers, batch, kv_bytes_per_request)
    roofline_s = parts["total_bytes"] / bandwidth
    return {**parts, "weights": asdict(w), "mean_decode_batch": batch, "decode_steps": steps,
            "kv_bytes_per_request": kv_bytes_per_request, "hbm_bytes_per_s": bandwidth,
            "roofline_ms": 1e3 * roofline_s, "measured_mean_ms": 1e3 * measured_s,
            "fraction_of_roofline": roofline_s / measured_s if measured_s > 0 else 0.0,
            "weights_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "expert_format": expert_format(model), "linear_format": linear_format(model)}


def format_roofline(r: dict) -> str:
    return (f"Decode HBM roofline: {r['total_bytes'] / 1e9:.4g} GB per step at mean batch "
            f"{r['mean_decode_batch']:.1f} ({r['expected_experts_per_layer']:.1f} of {r['weights']['num_experts']} "
            f"experts per layer, routed experts {r.get('expert_format', '?')}, linears {r.get('linear_format', '?')}) "
            f"-> {r['roofline_ms']:.4g} ms "
            f"at {r['hbm_bytes_per_s'] / 1e12:.1f} TB/s; measured "
            f"{r['measured_mean_ms']:.4g} ms per decode step ({100 * r['fraction_of_roofline']:.3g}% of roofline)")
