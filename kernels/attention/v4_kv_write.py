"""Which implementation writes a DeepSeek-V4 / V4.1 decode step's KV rows: the fused Triton
kernels (kernels/v4_kv_write_triton.py) or the torch references (kernels/v4_kv_write.py);
``impl`` ``torch`` / ``triton`` forces one.

``auto`` takes the fused kernels on CUDA (row writes and compressor steps, every record
format; byte-identical to the reference there) and the torch references elsewhere."""

from __future__ import annotations

import torch

from kernels import v4_kv_write_triton as fused
from kernels.v4_kv_write import RowNorm, RowStore, RowTarget, compress_step_reference, write_rows_reference

IMPLS = ("auto", "torch", "triton")


def _use_triton(impl: str, x: torch.Tensor, store: RowStore) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"V4 KV write: unknown implementation {impl!r} (expected one of {IMPLS})")
    if impl == "torch" or (impl == "auto" and not x.is_cuda):
        return False
    ok = fused.supports(x, store)
    if impl == "triton" and not ok:
        raise ValueError(f"V4 KV write: the Triton kernel does not take {x.dtype} rows on {x.device} into "
                         f"{store.fmt!r} records")
    return ok


def write_rows(x: torch.Tensor, norm: RowNorm, cos: torch.Tensor, sin: torch.Tensor, store: RowStore,
               target: RowTarget, impl: str = "auto", want_latent: bool = False) -> torch.Tensor | None:
    """:func:`kernels.v4_kv_write.write_rows_reference`, fused on CUDA (``impl`` ``auto``; ``torch`` / ``triton``
    force one). Returns the latents ``norm(x)`` when ``want_latent`` (the reference always has them)."""
    if _use_triton(impl, x, store):
        return fused.write_rows_triton(x, norm, cos, sin, store, target, want_latent)
    return write_rows_reference(x, norm, cos, sin, store, target)


def compress_step(kv: torch.Tensor, gate: torch.Tensor, kv_ring: torch.Tensor, gate_ring: torch.Tensor,
                  ring: RowTarget, gate_base: torch.Tensor, ratio: int, overlap: bool,
                  position_bias: torch.Tensor | None, norm: RowNorm, cos: torch.Tensor, sin: torch.Tensor,
                  store: RowStore, target: RowTarget, impl: str = "auto",
                  want_latent: bool = False) -> torch.Tensor | None:
    """:func:`kernels.v4_kv_write.compress_step_reference`, fused on CUDA (``impl`` as :func:`write_rows`)."""
    args = (kv, gate, kv_ring, gate_ring, ring, gate_base, ratio, overlap, position_bias, norm, cos, sin, store, target)
    if _use_triton(impl, kv, store):
        return fused.compress_step_triton(*args, want_latent)
    return compress_step_reference(*args)
