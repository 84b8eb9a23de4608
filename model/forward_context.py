"""The forward context: attention metadata and KV caches for the current step.

The runner sets it around each forward (nano-vllm's habit), so layers keep plain
``forward(x)`` signatures. With no context set, attention runs as a cache-less causal
prefill over the whole input (what HF comparisons and training-style calls need).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.attention import REFERENCE_DECODE, DecodeBackend, DecodeMetadata, PrefillBackend
from model.upload import numpy_to_device, to_device


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
    """One step's attention inputs. The decode metadata is built here, once per step for every
    layer, by the step's decode backend (FlashInfer plans then); without a backend the torch
    reference decodes and prefill takes the device's default (tests, tools)."""

    attn: AttentionMetadata | None = None
    kv_caches: list[torch.Tensor] | None = None  # per layer [num_blocks, block_size, 576]
    kv_scales: list[float] | None = None  # per layer k_scale (FP8 cache only)
    decode_backend: DecodeBackend | None = None  # the runner's, chosen at start-up
    prefill_backend: PrefillBackend | None = None
    decode_metadata: DecodeMetadata | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.decode_backend is None:
            self.decode_backend = REFERENCE_DECODE
        md = self.attn
        if md is not None and md.num_decode_seqs:
            b = md.num_decode_seqs
            self.decode_metadata = self.decode_backend.build_metadata(md.block_tables[:b], md.seq_lens[:b],
                                                                      md.decode_query_len)


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


def build_attention_metadata(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    num_decode_seqs: int = 0,
    decode_query_len: int = 1,
    num_pad_tokens: int = 0,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build a step's metadata from per-sequence python lists (decode sequences first).

    ``context_lens[i]`` tokens of sequence i are already cached; this step adds
    ``query_lens[i]`` tokens after them. ``num_pad_tokens`` trailing pad rows get slot -1.
    """
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    slots: list[int] = []
    for table, ctx, q in zip(block_tables, context_lens, query_lens):
        for pos in range(ctx, ctx + q):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    slots.extend([-1] * num_pad_tokens)
    width = max((len(t) for t in block_tables), default=0) or 1
    # One numpy fill, then one upload: torch.tensor(list of lists) costs ~3x as much (0.75 vs
    # 0.24 ms for 96 sequences of 145 blocks, measured on CPU), paid on every step.
    padded = np.zeros((len(block_tables), width), dtype=np.int32)
    for i, table in enumerate(block_tables):
        padded[i, : len(table)] = table
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        slot_mapping=to_device(slots, torch.long, device),
        query_start_loc=to_device(starts, torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        block_tables=numpy_to_device(padded, device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
        num_decode_seqs=num_decode_seqs,
        decode_query_len=decode_query_len,
    )
