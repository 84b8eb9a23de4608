"""Random weights for a DeepSeek-V4 / V4.1 model already built on its device (``--load-format dummy``).

Every tensor is filled in place, on the device, from one generator seeded with ``--seed``:
no tensor passes through host memory, so a slice that nearly fills the GPU still loads. The
values keep activations finite through many layers (the models' own constructors leave many
tensors zero or uninitialized, ``torch.empty``):

- projection matrices, expert weights, embeddings, engram tables and the mHC mixing
  weights ``fn``: normal(0, ``std``), ``std`` = the config's ``initializer_range`` (0.02).
  With unit-RMS streams of width hc·D the mHC logits have std ``std·√(hc·D)`` (≈ 2.9 at the
  flash width): the sigmoids and the softmax ahead of Sinkhorn stay well inside float range;
- norm weights, mHC scales, engram gate weights (``q_weight``, ``k_weight``) and engram
  dequantization scales: ones;
- attention sinks, mHC biases, compressor position biases and router selection biases: zeros
  (the models' own initial values);
- V4.1's stacked MXFP4 routed experts (``*_mxfp4`` int8, ``*_mxfp4_scale`` E8M0): uniform
  random bytes (every e2m1 code equally likely, RMS ≈ 2.93) and per-group scales of
  ``2^(b-1)`` or ``2^b`` at random, ``b`` picked so the weights' RMS is about ``std``;
- V4.1's MXFP8 linears (``.weight`` e4m3, ``.scale`` E8M0 per 32×32 block): normal(0, 16)
  rounded to e4m3, and block scales picked the same way;
- V4's hash-routing table ``tid2eid``: ``num_experts_per_tok`` distinct random experts per
  token, so hash layers spread tokens over the experts as learned routing does.

A tensor no rule names is an error naming it, so a new parameter cannot silently stay empty.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels.weight_formats import E8M0_DTYPE, FP8_DTYPE, FP8_MAX

_ONES = ("norm.weight", "layernorm.weight", "hc.scale", "hc_scale", "_scale", "q_weight", "k_weight",
         "embed.scale")
_ZEROS = ("sinks", "attn_sink", "hc.base", "hc_base", "_base", "position_bias", "e_score_correction_bias",
          "gate.bias", "gate.bias_vl")
_E2M1_RMS = 2.926  # RMS of the 16 e2m1 codes, each equally likely
_E4M3_RMS = 16.0  # random FP8 linears' e4m3 values: normal(0, 16), far inside ±448
_FILL_ELEMENTS = 1 << 22  # float32 scratch of one chunk of random e4m3 values
_INDEX_ROWS = 1 << 14  # tid2eid rows drawn at once (a [rows, experts] float scratch)


def initializer_std(config) -> float:
    """The config's ``initializer_range`` (V4.1 keeps it in ``text_config``), else 0.02."""
    raw = config.raw or {}
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    return float(text.get("initializer_range", raw.get("initializer_range", 0.02)))


def _random_scales(name: str, t: torch.Tensor, std: float, value_rms: float, gen: torch.Generator) -> None:
    """E8M0 scales in place for values of RMS ``value_rms``, so the weights' RMS is about ``std``."""
    # scales 2^(b-1) / 2^b at random: mean square 0.625·4^b, so b = log2(std / (RMS·√0.625))
    top = 127 + round(math.log2(std / (value_rms * math.sqrt(0.625))))
    if not 1 <= top <= 254:
        raise ValueError(f"--load-format dummy: initializer std {std} is out of the E8M0 range of {name!r}")
    t.view(torch.uint8).random_(top - 1, top + 1, generator=gen)


def _random_mxfp4(name: str, t: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Fill stacked MXFP4 codes (int8) or their E8M0 scales in place (see the module doc)."""
    if t.dtype == torch.int8:
        t.random_(-128, 128, generator=gen)  # in place: no second copy of the largest tensors
        return
    _random_scales(name, t, std, _E2M1_RMS, gen)


def _random_e4m3(t: torch.Tensor, gen: torch.Generator) -> None:
    """Fill e4m3 values [N, K] in place with normal(0, ``_E4M3_RMS``), rounded (in row chunks)."""
    rows = max(1, _FILL_ELEMENTS // max(t.shape[-1], 1))
    for start in range(0, t.shape[0], rows):
        part = t[start:start + rows]
        values = torch.empty(part.shape, dtype=torch.float32, device=t.device).normal_(0.0, _E4M3_RMS, generator=gen)
        part.copy_(values.clamp_(-FP8_MAX, FP8_MAX))


def _random_experts(table: torch.Tensor, num_experts: int, gen: torch.Generator) -> None:
    """Fill ``table`` [vocab, k] with k distinct experts per row."""
    k = table.shape[1]
    for start in range(0, table.shape[0], _INDEX_ROWS):
        rows = table[start:start + _INDEX_ROWS]
        scores = torch.rand(rows.shape[0], num_experts, generator=gen, device=table.device)
        rows.copy_(scores.topk(k, dim=-1).indices)


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int, std: float, num_experts: int) -> nn.Module:
    """Fill every parameter and floating buffer of ``model`` (see the module doc); returns it."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, t in tensors:
        if name.endswith("tid2eid"):
            _random_experts(t, num_experts, gen)
        elif name.endswith(("_mxfp4", "_mxfp4_scale")):
            _random_mxfp4(name, t, std, gen)
        elif t.dtype == FP8_DTYPE and name.endswith(".weight"):
            _random_e4m3(t, gen)
        elif t.dtype == E8M0_DTYPE and name.endswith(".scale"):
            _random_scales(name, t, std, _E4M3_RMS, gen)
        elif not t.is_floating_point():
            if isinstance(t, nn.Parameter):
                raise ValueError(f"--load-format dummy: no random values for the {t.dtype} parameter {name!r}")
        elif name.endswith(_ONES):
            t.fill_(1.0)
        elif name.endswith(_ZEROS):
            t.zero_()
        elif t.dim() >= 2 and isinstance(t, nn.Parameter):
            t.normal_(0.0, std, generator=gen)
        elif isinstance(t, nn.Parameter):
            raise ValueError(f"--load-format dummy: no rule gives the parameter {name!r} {tuple(t.shape)} a value")
    return model
