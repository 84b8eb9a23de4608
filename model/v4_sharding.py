"""Tensor-parallel sharding of DeepSeek-V4 / V4.1 weights, as one table.

Each rule names how a tensor (HF name, V4 or V4.1 spelling) is cut across ``world`` ranks:

| rule          | tensors                                              | cut                                   |
|---------------|------------------------------------------------------|---------------------------------------|
| HEAD_ROWS     | attention q_b_proj / wq_b, sinks / attn_sink         | rows, by head                         |
| GROUP_ROWS    | o_a_proj / wo_a                                      | rows, by output group                 |
| INPUT_COLS    | o_b_proj / wo_b                                      | input columns                         |
| EXPERT_STACK  | V4 mlp.experts.gate_up_proj / down_proj [E, ., .]    | EP: experts; TP: intermediate dim     |
| EXPERT_ROWS   | expert / shared-expert w1, w3 (gate_proj, up_proj)   | TP: intermediate rows                 |
| EXPERT_COLS   | expert / shared-expert w2 (down_proj)                | TP: intermediate columns              |
| VOCAB_ROWS    | embed, lm_head, engram tables (+ their row scales)   | rows, padded to ceil(rows/world)      |
| (none)        | everything else (norms, mHC, router, compressors,    | replicated                            |
|               | indexer, engram wkv/q/k)                             |                                       |

A weight's scale tensor (``.scale`` / ``.weight_scale_inv``), when a model keeps it as a tensor
of its own, follows its weight's rule. The rule says how a tensor *may* be cut; whether it is, is
read from the shape the model asks for (the full shape means replicated), so a model that
replicates e.g. shared experts loads from the same table. Under EP a V4.1 model lists only its
own experts' (per-expert) tensors.
"""

from __future__ import annotations

import re

import torch

from kernels.weight_formats import MXFP4, QuantizedWeight

HEAD_ROWS = "head_rows"
GROUP_ROWS = "group_rows"
INPUT_COLS = "input_cols"
EXPERT_STACK = "expert_stack"
EXPERT_ROWS = "expert_rows"
EXPERT_COLS = "expert_cols"
VOCAB_ROWS = "vocab_rows"

SHARDING_RULES: tuple[tuple[str, str], ...] = (
    (r"\.(self_attn\.q_b_proj|attn\.wq_b)\.(weight|weight_scale_inv|scale)$", HEAD_ROWS),
    (r"\.(self_attn\.sinks|attn\.attn_sink)$", HEAD_ROWS),
    (r"\.(self_attn\.o_a_proj|attn\.wo_a)\.(weight|weight_scale_inv|scale)$", GROUP_ROWS),
    (r"\.(self_attn\.o_b_proj|attn\.wo_b)\.(weight|weight_scale_inv|scale)$", INPUT_COLS),
    (r"\.mlp\.experts\.(gate_up_proj|down_proj)$", EXPERT_STACK),
    (r"\.(ffn\.experts\.\d+\.w[13]|ffn\.shared_experts\.w[13]|mlp\.shared_experts\.(gate|up)_proj)"
     r"\.(weight|weight_scale_inv|scale)$", EXPERT_ROWS),
    (r"\.(ffn\.experts\.\d+\.w2|ffn\.shared_experts\.w2|mlp\.shared_experts\.down_proj)"
     r"\.(weight|weight_scale_inv|scale)$", EXPERT_COLS),
    (r"^(model\.embed_tokens\.weight|model\.embed\.weight|lm_head\.weight)$", VOCAB_ROWS),
    (r"\.engram\.embed\.(weight|scale)$", VOCAB_ROWS),
)
_COMPILED = tuple((re.compile(p), rule) for p, rule in SHARDING_RULES)


class ShardingError(ValueError):
    """A tensor cannot be cut to the shape the model asks for; the message names it."""


def sharding_rule(hf_name: str) -> str | None:
    """The rule for ``hf_name``, or None (replicated)."""
    for pattern, rule in _COMPILED:
        if pattern.search(hf_name):
            return rule
    return None


def _chunk(size: int, world: int, name: str, dim: int) -> int:
    if size % world:
        raise ShardingError(f"cannot shard {name!r}: dim {dim} ({size}) is not divisible by {world} ranks")
    return size // world


def _narrow(t, dim: int, start: int, length: int, name: str):
    """Narrow a plain tensor, or a QuantizedWeight along a *logical* dim (data and scale)."""
    if not isinstance(t, QuantizedWeight):
        return t.narrow(dim, start, length)
    nd = t.data.dim()
    dim = dim % nd
    if dim < nd - 2:  # a stacking dim: scales stack the same way
        return QuantizedWeight(t.data.narrow(dim, start, length), t.scale.narrow(dim, start, length), t.format, t.block)
    block = t.block[0] if dim == nd - 2 else t.block[1]
    if start % block or length % block:
        raise ShardingError(f"cannot shard {name!r}: slice [{start}, {start + length}) of dim {dim} "
                            f"does not fall on its {block}-wide scale blocks")
    pack = 2 if (t.format == MXFP4 and dim == nd - 1) else 1
    data = t.data.narrow(dim, start // pack, length // pack)
    scale = t.scale.narrow(dim, start // block, length // block)
    return QuantizedWeight(data, scale, t.format, t.block)


def _cat(parts, dim: int):
    if not isinstance(parts[0], QuantizedWeight):
        return torch.cat(parts, dim)
    q = parts[0]
    return QuantizedWeight(torch.cat([p.data for p in parts], dim), torch.cat([p.scale for p in parts], dim),
                           q.format, q.block)


def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape)


def vocab_rows_range(rows: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, stop, padded chunk) of a vocab-parallel tensor's rows on ``rank``."""
    chunk = -(-rows // world)
    start = min(rows, rank * chunk)
    return start, min(rows, start + chunk), chunk


def local_shape(hf_name: str, full: tuple[int, ...], world: int, expert_parallel: bool = False) -> tuple[int, ...]:
    """This rank's shape of a tensor under the table (what a sharded model should ask for).
    ``expert_parallel``: stacked V4 experts are split by expert instead of intermediate dim."""
    rule, shape = sharding_rule(hf_name), list(full)
    if world == 1 or rule is None:
        return tuple(shape)
    if rule in (HEAD_ROWS, GROUP_ROWS, EXPERT_ROWS):
        shape[0] = _chunk(shape[0], world, hf_name, 0)
    elif rule in (INPUT_COLS, EXPERT_COLS):
        shape[-1] = _chunk(shape[-1], world, hf_name, len(shape) - 1)
    elif rule == EXPERT_STACK:
        dim = 0 if expert_parallel else 1 if hf_name.endswith("gate_up_proj") else 2
        if dim == 1:
            shape[1] = 2 * _chunk(shape[1] // 2, world, hf_name, 1)
        else:
            shape[dim] = _chunk(shape[dim], world, hf_name, dim)
    elif rule == VOCAB_ROWS:
        shape[0] = -(-shape[0] // world)
    return tuple(shape)


def shard(t, hf_name: str, expected: tuple[int, ...], rank: int, world: int):
    """Cut the full tensor ``t`` (plain or QuantizedWeight) to this rank's ``expected`` shape."""
    full = _shape(t)
    if full == tuple(expected):
        return t
    rule = sharding_rule(hf_name)
    out = None
    if world > 1 and rule in (HEAD_ROWS, GROUP_ROWS, EXPERT_ROWS):
        n = _chunk(full[0], world, hf_name, 0)
        out = _narrow(t, 0, rank * n, n, hf_name)
    elif world > 1 and rule in (INPUT_COLS, EXPERT_COLS):
        n = _chunk(full[-1], world, hf_name, len(full) - 1)
        out = _narrow(t, len(full) - 1, rank * n, n, hf_name)
    elif world > 1 and rule == EXPERT_STACK and len(expected) == 3:
        if expected[0] != full[0]:  # expert parallel: whole experts
            n = _chunk(full[0], world, hf_name, 0)
            out = _narrow(t, 0, rank * n, n, hf_name)
        elif hf_name.endswith("gate_up_proj"):  # TP: this rank's rows of w1 and of w3
            half = full[1] // 2
            n = _chunk(half, world, hf_name, 1)
            out = _cat([_narrow(t, 1, rank * n, n, hf_name), _narrow(t, 1, half + rank * n, n, hf_name)], 1)
        else:
            n = _chunk(full[2], world, hf_name, 2)
            out = _narrow(t, 2, rank * n, n, hf_name)
    elif world > 1 and rule == VOCAB_ROWS:
        start, stop, chunk = vocab_rows_range(full[0], rank, world)
        out = _narrow(t, 0, start, stop - start, hf_name)
        if stop - start < chunk:
            out = pad_rows(out, chunk)
    if out is None or _shape(out) != tuple(expected):
        found = list(full) if out is None else f"{list(full)}, cut to {list(_shape(out))} on rank {rank}/{world}"
        raise ShardingError(f"tensor {hf_name!r}: expected shape {list(expected)}, found {found}")
    return out


def pad_rows(t, rows: int):
    """Zero rows appended up to ``rows`` (vocab-parallel ranks past the end of the table)."""
    def pad(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= rows:
            return x
        raw = x.view(torch.uint8) if x.element_size() == 1 and x.is_floating_point() else x
        out = torch.cat([raw, raw.new_zeros(rows - raw.shape[0], *raw.shape[1:])])
        return out.view(x.dtype)

    if isinstance(t, QuantizedWeight):
        return QuantizedWeight(pad(t.data), pad(t.scale), t.format, t.block)
    return pad(t)
