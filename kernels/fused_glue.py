"""One switch for the fused Triton kernels that replace torch's elementwise glue around the
GEMMs and attention: RMSNorm (with the residual add), the query RoPE in place, MLA's K/V
assembly, SiLU·mul and the MoE slot alignment (``kernels/rmsnorm.py``, ``kernels/rope.py``,
``kernels/mla_prefill.py``, ``kernels/activation.py``, ``kernels/moe_align.py``).

Each of those dispatch functions takes its Triton kernel when ``glue_kernels_apply`` says so
(Triton importable, a CUDA tensor, the switch on) and its own shape/dtype conditions hold;
otherwise the torch reference runs, which is what CPU (CI) always runs. ``unfused_glue()``
turns the kernels off for a block, so a benchmark or a test can run the torch composition on
the same GPU and compare (the step profile's before/after split does exactly that).
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
_enabled = True


def glue_kernels_apply(x: torch.Tensor) -> bool:
    """Whether the fused glue kernels may run on ``x`` (each op adds its own conditions)."""
    return _enabled and HAS_TRITON and x.is_cuda


@contextlib.contextmanager
def unfused_glue():
    """Run the torch references of the glue ops inside the block, on any device."""
    global _enabled
    prev, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = prev


__all__ = ["HAS_TRITON", "glue_kernels_apply", "unfused_glue"]
