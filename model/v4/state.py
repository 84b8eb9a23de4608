"""Per-request decode state of a DeepSeek-V4 model.

A request's state is a :class:`V4RequestState`: ``num_tokens`` (positions consumed so far)
and a :class:`~model.v4.cache_pool.RowLease` on the model's row pools
(:meth:`DeepseekV4ForCausalLM.cache_pools`). Each forward call appends a chunk of the
request's tokens at positions ``num_tokens …``; one-shot prefill, chunked prefill with any
chunk boundaries, token-by-token decode and the batched decode of many requests leave the
same rows and give the same logits. The state only grows forward: it cannot be rewound, so
speculative decoding and prefix caching need :meth:`V4RequestState.clone` snapshots.

What the pools hold for a request, per layer:

- ``window`` (ring of ``sliding_window`` rows, every layer): the K = V rows (after kv_norm and
  RoPE); query t sees positions (t − sliding_window, t].
- per compressor group (the CSA layers, the HCA layers; pool names ``<kind><m>.…``):
  ``kv`` / ``gate`` rings of the raw ``kv_proj`` / ``gate_proj`` rows (gate without the
  position bias) of the last m positions, 2m for overlapping CSA windows — entry w pools
  window w − 1's first half (Ca) with window w's second half (Cb), so both must still be
  there when window w closes; ``entries`` (paged): the compressed entries (pooled,
  kv_norm'ed, RoPE'd at position w·m). CSA layers have the same three for the lightning
  indexer's own compressor at ``index_head_dim`` (``index_kv``, ``index_gate``,
  ``index_keys``).

Windows of m tokens are aligned to absolute positions: window w covers positions
w·m … w·m + m − 1. Emission rule: the step that consumes position t with (t + 1) % m == 0
closes window w = (t + 1)/m − 1 and appends entry w. Entry w is visible to query t iff
(w + 1)·m ≤ t + 1, so it is usable in the same step that emits it; after n tokens a layer
holds n // m entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.v4.cache_pool import RowLease


def split_complete_windows(pending_kv: torch.Tensor | None, pending_gate: torch.Tensor | None, kv: torch.Tensor,
                           gate: torch.Tensor, ratio: int) -> tuple[torch.Tensor, ...]:
    """Open-window rows + a chunk's rows -> ``(kv [n_w, ratio, c], gate [n_w, ratio, c], the
    rows left pending, their gates)``. Windows are aligned to absolute positions, so the
    pending rows always start a window. The leftovers are copies: they never pin the chunk."""
    if pending_kv is not None:
        kv = torch.cat([pending_kv, kv], dim=0)
        gate = torch.cat([pending_gate, gate], dim=0)
    usable = (kv.shape[0] // ratio) * ratio
    shape = (usable // ratio, ratio, kv.shape[-1])
    return kv[:usable].reshape(shape), gate[:usable].reshape(shape), kv[usable:].clone(), gate[usable:].clone()


@dataclass
class V4RequestState:
    """One request: its rows in the model's pools and ``num_tokens``, the next position."""

    lease: RowLease
    num_tokens: int = 0

    def clone(self) -> V4RequestState:
        """An independent copy (its own pool units holding the same rows)."""
        return V4RequestState(self.lease.copy(), self.num_tokens)

    def release(self) -> None:
        """Give the pool units back now (the state is dropped; it must not be used after)."""
        self.lease.release()
