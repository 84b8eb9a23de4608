"""Per-request decode state of DeepSeek-V4.1.

A request owns one :class:`RequestState`; every forward of the model consumes the next
tokens of that request (a one-shot prefill, a prefill chunk with any boundary, one decode
token, or its row of a batched decode) and advances the state in place, so all of them give
the same logits.

* ``num_tokens`` — positions consumed so far (the next token's absolute position).
* ``lease`` — the request's units in the model's row pools (model/v4/cache_pool.py,
  built by ``DeepseekV41ForCausalLM.cache_pools``):

  - ``window`` (ring of ``sliding_window`` rows, every layer): the window K=V rows
    (post-RoPE, FP8-rounded);
  - per KV-source layer s (``src<s>.…``): ``kv`` / ``gate`` rings of the open compressor
    group's fp32 rows (ratio > 1; groups are aligned to absolute positions, so the open
    group is positions (n // ratio)·ratio … n − 1), ``entries`` (paged): the shared
    compressed entries every layer up to the next source attends (RoPE'd at their group's
    first position, FP4-rounded; n // ratio of them after n tokens) and, when the source is
    also an index source, ``keys`` (paged): the indexer keys derived from the same latents.

* ``engram_history`` — the compressed ids of the last ``engram_max_ngram_size - 1`` tokens
  (``DEAD`` blocks n-gram look-back).

Nothing else survives a forward: the indexer top-k and the candidate-block mask are
recomputed for every query. The state cannot be rewound; :meth:`RequestState.clone` gives
an independent snapshot (speculative decoding, prefix caching).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.v4.cache_pool import RowLease

DEAD = -1  # an engram history slot that n-grams may not span (padding, image tokens)


@dataclass
class RequestState:
    lease: RowLease
    num_tokens: int = 0
    engram_history: list[int] = field(default_factory=list)

    def clone(self) -> RequestState:
        return RequestState(self.lease.copy(), self.num_tokens, list(self.engram_history))

    def release(self) -> None:
        """Give the pool units back now (the state is dropped; it must not be used after)."""
        self.lease.release()
