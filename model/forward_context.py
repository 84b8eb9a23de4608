"""The forward context: attention metadata and KV caches for the current step.

The runner sets it around each forward (nano-vllm's habit), so layers keep plain
``forward(x)`` signatures. With no context set, attention runs as a cache-less causal
prefill over the whole input (what HF comparisons and training-style calls need).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Describes one step's flattened tokens.

    Sequences are laid out decode-first: the first ``num_decode_seqs`` sequences each
    contribute ``decode_query_len`` tokens (the absorbed decode path), the rest are prefill
    chunks of any length (the prefill path). ``seq_lens`` counts each sequence's context
    after this step (cached tokens + new tokens).
    """

    slot_mapping: torch.Tensor  # [T] int64, -1: pad row, writes nothing
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decode_seqs: int = 0
    decode_query_len: int = 1

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs * self.decode_query_len

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class ForwardContext:
    attn: AttentionMetadata | None = None
    kv_caches: list[torch.Tensor] | None = None  # per layer [num_blocks, block_size, 576]
    kv_scales: list[float] | None = None  # per layer k_scale (FP8 cache only)
    # Filled by the model when asked: per-layer debug/telemetry (unused by the hot path).
    extras: dict = field(default_factory=dict)


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext | None:
    return _CONTEXT


@contextlib.contextmanager
def forward_context(ctx: ForwardContext | None):
    """Set the context for the duration of a forward; restores the previous one after."""
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev
