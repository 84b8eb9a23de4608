"""Per-request decode state of DeepSeek-V4.1, as plain first-class objects.

A request owns one :class:`RequestState`; every forward of the model consumes the next
tokens of that request (a one-shot prefill, a prefill chunk with any boundary, or one
decode token) and advances the state in place, so all three give the same logits.

* ``num_tokens`` — positions consumed so far (the next token's absolute position).
* ``windows[layer]`` — the last ``sliding_window - 1`` window K=V rows of every layer
  (post-RoPE, FP8-fake-quantized), ``[n, head_dim]``; the current token is the window's last.
* ``sources[kv_source_layer]`` — one :class:`SourceState` per KV-source layer: its open
  compressor group (``pending_kv``/``pending_gate``, fp32 rows not yet pooled; empty at
  ratio 1), the shared compressed entries every layer up to the next source attends
  (``entries`` ``[n, head_dim]``, RoPE'd at their group's first position, FP4-fake-quantized)
  and the indexer keys derived from the same latents (``index_keys`` ``[n, index_head_dim]``).
* ``engram_history`` — the compressed ids of the last ``engram_max_ngram_size - 1`` tokens
  (``DEAD`` blocks n-gram look-back).

Nothing else survives a forward: the indexer top-k and the candidate-block mask are
recomputed for every query. The state cannot be rewound; :meth:`RequestState.clone`
gives a snapshot (for speculative decoding). Tensors are never modified in place, so a
clone shares them safely.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DEAD = -1  # an engram history slot that n-grams may not span (padding, image tokens)


@dataclass
class SourceState:
    ratio: int
    pending_kv: torch.Tensor | None = None
    pending_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None

    @property
    def num_entries(self) -> int:
        return 0 if self.entries is None else self.entries.shape[0]

    @property
    def num_pending(self) -> int:
        return 0 if self.pending_kv is None else self.pending_kv.shape[0]

    def append_entries(self, rows: torch.Tensor) -> None:
        self.entries = rows if self.entries is None else torch.cat([self.entries, rows], dim=0)

    def append_index_keys(self, rows: torch.Tensor) -> None:
        self.index_keys = rows if self.index_keys is None else torch.cat([self.index_keys, rows], dim=0)

    def clone(self) -> SourceState:
        return SourceState(self.ratio, self.pending_kv, self.pending_gate, self.entries, self.index_keys)


@dataclass
class RequestState:
    num_tokens: int = 0
    windows: list[torch.Tensor | None] = field(default_factory=list)
    sources: dict[int, SourceState] = field(default_factory=dict)
    engram_history: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, num_layers: int, kv_source_ratios: dict[int, int]) -> RequestState:
        return cls(
            num_tokens=0,
            windows=[None] * num_layers,
            sources={layer: SourceState(ratio) for layer, ratio in kv_source_ratios.items()},
            engram_history=[],
        )

    def clone(self) -> RequestState:
        return RequestState(
            self.num_tokens,
            list(self.windows),
            {k: v.clone() for k, v in self.sources.items()},
            list(self.engram_history),
        )

    def num_cached_bytes(self) -> int:
        """Bytes held by this request's tensors (as stored, not as a packed cache would)."""
        tensors = [w for w in self.windows if w is not None]
        for s in self.sources.values():
            tensors += [t for t in (s.pending_kv, s.pending_gate, s.entries, s.index_keys) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)
