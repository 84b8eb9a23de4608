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

from kernels.attention import (REFERENCE_DECODE, ContextWindow, DecodeBackend, DecodeMetadata, PrefillBackend,
                               PrefillMetadata, VarlenSegments, default_prefill_backend)
from model.upload import to_device, upload_arrays


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
    """One step's attention inputs. The decode and prefill metadata are built here, once per
    step for every layer, and handed to the step's backends (FlashInfer plans then); without
    backends the torch reference decodes and prefill takes the device's default (tests, tools)."""

    attn: AttentionMetadata | None = None
    kv_caches: list[torch.Tensor] | None = None  # per layer [num_blocks, block_size, 576]
    kv_scales: list[float] | None = None  # per layer k_scale (FP8 cache only)
    decode_backend: DecodeBackend | None = None  # the runner's, chosen at start-up
    prefill_backend: PrefillBackend | None = None
    # Cached-prefix rows a step up-projects at once; a step whose chunks have more runs them
    # in windows of this many (None: no bound; the runner passes MLASERVE_CONTEXT_WORKSPACE_TOKENS).
    context_workspace_tokens: int | None = None
    decode_metadata: DecodeMetadata | None = field(default=None, init=False)
    prefill_metadata: PrefillMetadata | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.decode_backend is None:
            self.decode_backend = REFERENCE_DECODE
        md = self.attn
        if md is not None and md.num_decode_seqs:
            b = md.num_decode_seqs
            self.decode_metadata = self.decode_backend.build_metadata(md.block_tables[:b], md.seq_lens[:b],
                                                                      md.decode_query_len)
        if md is not None and md.num_seqs > md.num_decode_seqs:
            pm = build_prefill_metadata(md, self.kv_caches[0].shape[1] if self.kv_caches else 1,
                                        self.context_workspace_tokens)
            if pm is not None:
                if self.prefill_backend is None:
                    self.prefill_backend = default_prefill_backend(md.slot_mapping.device.type)
                # A windowed step's chunks run through attend_with_lse, not a planned ragged call.
                self.prefill_metadata = self.prefill_backend.plan(pm) if pm.context_windows is None else pm


def _ragged_rows(lens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``total = sum(lens)`` rows laid out segment after segment: (segment of each row,
    row within its segment), on the device without a host sync."""
    seg = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=total)
    starts = torch.cumsum(lens, 0) - lens
    return seg, torch.arange(total, device=lens.device) - starts[seg]


def plan_context_windows(context_lens: list[int], query_lens: list[int], workspace: int) -> list[tuple]:
    """Cut the chunks' cached prefixes, laid out chunk after chunk, into windows of at most
    ``workspace`` rows: (prefix start, prefix end, covered chunks, each one's key rows in the
    window). A window covers consecutive chunks with a prefix, the first and last possibly in
    part; chunks without a prefix are in none."""
    windows, members, start, used, pos = [], [], 0, 0, 0
    for i, c in enumerate(context_lens):
        left = c
        while left:
            take = min(left, workspace - used)
            members.append((i, take))
            used, left, pos = used + take, left - take, pos + take
            if used == workspace:
                windows.append((start, pos, [m for m, _ in members], [r for _, r in members]))
                start, members, used = pos, [], 0
    if members:
        windows.append((start, pos, [m for m, _ in members], [r for _, r in members]))
    return windows


def _context_windows(windows, query_lens: list[int], device) -> list[ContextWindow]:
    """The planned windows with their device offsets (and, for a window whose chunks' query
    rows are not one run, their row indices), all uploaded in one copy."""
    q_starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    flat, shapes = [], []
    for _, _, chunks, k_lens in windows:
        q_lens = [query_lens[i] for i in chunks]
        rows = [] if chunks == list(range(chunks[0], chunks[-1] + 1)) else np.concatenate(
            [np.arange(q_starts[i], q_starts[i + 1]) for i in chunks]).tolist()
        flat += np.concatenate([[0], np.cumsum(q_lens), [0], np.cumsum(k_lens), rows]).astype(np.int64).tolist()
        shapes.append((q_lens, len(rows)))
    offsets, out, at = to_device(flat, torch.int32, device), [], 0
    for (p0, p1, chunks, k_lens), (q_lens, num_rows) in zip(windows, shapes):
        n = len(q_lens) + 1
        segments = VarlenSegments(q_lens, k_lens, offsets[at : at + n], offsets[at + n : at + 2 * n])
        rows = offsets[at + 2 * n : at + 2 * n + num_rows].long() if num_rows else None
        out.append(ContextWindow(p0, p1, int(q_starts[chunks[0]]), int(q_starts[chunks[-1] + 1]), segments, rows))
        at += 2 * n + num_rows
    return out


def build_prefill_metadata(md: AttentionMetadata, page_size: int,
                           context_workspace: int | None = None) -> PrefillMetadata | None:
    """The step's prefill chunks (sequences after the decodes with at least one new token) as
    ``PrefillMetadata``: indptrs from the host lengths, the prefix gather and key layout
    indices computed on the device from the block tables (no per-sequence work, no sync).
    When the chunks' cached prefixes exceed ``context_workspace`` rows, they are planned as
    context windows instead of one key layout. None when the step has no prefill rows."""
    nd = md.num_decode_seqs
    row_start = sum(md.query_lens_cpu[:nd])
    seqs = [i for i in range(nd, md.num_seqs) if md.query_lens_cpu[i]]
    if not seqs:
        return None
    q_lens = [md.query_lens_cpu[i] for i in seqs]
    c_lens = [md.seq_lens_cpu[i] - md.query_lens_cpu[i] for i in seqs]
    kv_lens = [c + q for c, q in zip(c_lens, q_lens)]
    device = md.slot_mapping.device
    n = len(seqs)
    # One upload: sequence index, q len, cached len, q start, prefix start (5 x n int64).
    q_start, p_start = [0] * n, [0] * n
    for i in range(1, n):
        q_start[i], p_start[i] = q_start[i - 1] + q_lens[i - 1], p_start[i - 1] + c_lens[i - 1]
    packed = to_device([seqs, q_lens, c_lens, q_start, p_start], torch.long, device)
    seq_t, q_t, c_t, qs_t, ps_t = packed.unbind(0)
    indptrs = to_device([[0, *np.cumsum(q_lens).tolist()], [0, *np.cumsum(kv_lens).tolist()]], torch.int32, device)
    prefix_slots = kv_order = windows = None
    total_prefix = sum(c_lens)
    if total_prefix:
        chunk, pos = _ragged_rows(c_t, total_prefix)
        pages = md.block_tables[seq_t[chunk], pos // page_size].long()
        prefix_slots = pages * page_size + pos % page_size
        if context_workspace is not None and total_prefix > context_workspace:
            windows = _context_windows(plan_context_windows(c_lens, q_lens, context_workspace), q_lens, device)
        else:
            chunk, j = _ragged_rows(q_t + c_t, sum(kv_lens))
            c = c_t[chunk]
            # Key row j of a chunk: its j-th cached row while j < cached len, else its (j - cached)-th new row.
            kv_order = torch.where(j < c, ps_t[chunk] + j, total_prefix + qs_t[chunk] + j - c)
    return PrefillMetadata(row_start=row_start, query_lens=q_lens, context_lens=c_lens, qo_indptr=indptrs[0],
                           kv_indptr=indptrs[1], prefix_slots=prefix_slots, kv_order=kv_order,
                           context_windows=windows)


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


@dataclass
class AttentionArrays:
    """The host side of a step's :class:`AttentionMetadata` (numpy, built without per-token
    Python loops), plus each token's position; :func:`upload_arrays` them with the step's other
    inputs, then :meth:`metadata` wraps the device tensors."""

    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, width] int32
    positions: np.ndarray  # [T] int64 (pad rows: 0)

    def device_arrays(self) -> list[np.ndarray]:
        return [self.slot_mapping, self.query_start_loc, self.seq_lens, self.block_tables]

    def metadata(self, tensors: list[torch.Tensor], num_decode_seqs: int = 0,
                 decode_query_len: int = 1) -> AttentionMetadata:
        """``tensors``: the uploads of :meth:`device_arrays`, in that order."""
        slots, starts, seq_lens, tables = tensors
        return AttentionMetadata(slot_mapping=slots, query_start_loc=starts, seq_lens=seq_lens, block_tables=tables,
                                 query_lens_cpu=np.diff(self.query_start_loc).tolist(),
                                 seq_lens_cpu=self.seq_lens.tolist(), num_decode_seqs=num_decode_seqs,
                                 decode_query_len=decode_query_len)


def padded_block_tables(block_tables: list[list[int]]) -> np.ndarray:
    """[B, width] int32, zero-padded (width at least 1)."""
    width = max((len(t) for t in block_tables), default=0) or 1
    padded = np.zeros((len(block_tables), width), dtype=np.int32)
    for i, table in enumerate(block_tables):
        padded[i, : len(table)] = table
    return padded


def attention_arrays(block_tables: list[list[int]] | np.ndarray, context_lens, query_lens, block_size: int,
                     num_pad_tokens: int = 0) -> AttentionArrays:
    """A step's metadata arrays from per-sequence lengths (decode sequences first).

    ``block_tables``: lists of page ids, or already a zero-padded [B, width] int32 array.
    ``context_lens[i]`` tokens of sequence i are already cached; this step adds
    ``query_lens[i]`` tokens after them. ``num_pad_tokens`` trailing pad rows get slot -1."""
    ctx = np.asarray(context_lens, dtype=np.int64).reshape(-1)
    q = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    tables = block_tables if isinstance(block_tables, np.ndarray) else padded_block_tables(block_tables)
    if tables.shape[1] == 0:
        tables = np.zeros((tables.shape[0], 1), dtype=np.int32)
    starts = np.zeros(len(q) + 1, dtype=np.int32)
    np.cumsum(q, out=starts[1:])
    num_tokens = int(starts[-1])
    if num_tokens == len(q):  # one token per sequence (decode)
        row, pos = np.arange(len(q)), ctx
    else:
        row = np.repeat(np.arange(len(q)), q)
        pos = ctx[row] + np.arange(num_tokens) - starts[:-1][row]
    slots = tables[row, pos // block_size].astype(np.int64) * block_size + pos % block_size
    if num_pad_tokens:
        slots = np.concatenate([slots, np.full(num_pad_tokens, -1, dtype=np.int64)])
        pos = np.concatenate([pos, np.zeros(num_pad_tokens, dtype=np.int64)])
    return AttentionArrays(slot_mapping=slots, query_start_loc=starts, seq_lens=(ctx + q).astype(np.int32),
                           block_tables=tables, positions=pos)


def build_attention_metadata(
    block_tables: list[list[int]] | np.ndarray,
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    num_decode_seqs: int = 0,
    decode_query_len: int = 1,
    num_pad_tokens: int = 0,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build a step's metadata from per-sequence lengths (decode sequences first): the arrays
    of :func:`attention_arrays`, uploaded in one copy."""
    arrays = attention_arrays(block_tables, context_lens, query_lens, block_size, num_pad_tokens)
    return arrays.metadata(upload_arrays(arrays.device_arrays(), device), num_decode_seqs, decode_query_len)
