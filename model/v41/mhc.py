"""V4.1's single-pass mHC schedule on top of V4's site math (``model.v4.mhc``).

Each site (attention, FFN) computes ``(pre, post, comb)`` from the streams it reads exactly
as V4 does (:func:`model.v4.mhc.mhc_site_weights`), but V4.1 consumes a site's ``pre`` at the
*next* site: layer 0's attention collapses with a one-hot ``pre`` (stream 0), every FFN with
its own layer's attention-site ``pre``, the next attention with the previous FFN-site ``pre``,
and the final norm with the last FFN-site ``pre`` (there is no HyperHead). The expansion
``X'_k = post_k · F + Σ_j comb[j, k] · X_j`` runs in fp32 and is cast to the streams' dtype
once (V4 computes it in the streams' dtype).
"""

from __future__ import annotations

import torch

from model.v4.mhc import collapse_streams, expand_streams, mhc_site_weights

__all__ = ["collapse_streams", "expand_streams_fp32", "mhc_site_weights", "one_hot_pre"]


def expand_streams_fp32(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                        comb: torch.Tensor) -> torch.Tensor:
    """V4.1's expansion: :func:`model.v4.mhc.expand_streams` computed in float32."""
    return expand_streams(streams, out, post, comb, compute_dtype=torch.float32)


def one_hot_pre(num_tokens: int, hc: int, device) -> torch.Tensor:
    """The ``pre`` layer 0's attention site collapses with: stream 0 only."""
    pre = torch.zeros(num_tokens, hc, dtype=torch.float32, device=device)
    pre[:, 0] = 1.0
    return pre
