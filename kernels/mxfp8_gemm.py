"""MXFP8 GEMMs for DeepSeek-V4.1's linears on Hopper (Triton), with torch references; the
entry point :func:`mxfp8_gemm` also dispatches to the CUDA C++ kernel of
kernels/mxfp8_gemm_cuda.py (the default where it runs: the Triton kernel cannot overlap the
per-32 promotion with the next MMA).

Operands: activations e4m3 [M, K] with one UE8M0 byte per 32 along K ([M, K/32]); weights
e4m3 [N, K] with one UE8M0 byte per 32×32 block ([ceil(N/32), K/32]), V4.1's checkpoint
format (``kernels.weight_formats.quantize_fp8_blocks(w, (32, 32))`` makes one). A byte b
means the scale 2^(b−127); scales may be uint8 or float8_e8m0fnu.

Hopper has no block-scaled MMA, but both scales are powers of two, so the MXFP8 numerics are
kept by an FP8 MMA per 32-wide K slice: ``acc += dot(a8, b8) · 2^(ea−127) · 2^(eb−127)``, one
multiply and one FMA per accumulator element per 32 of K. The scaling itself is exact; what
rounds is the sum: inside the MMA (Hopper's FP8 MMA accumulates with fewer than fp32's bits,
so promoting into the fp32 accumulator after every 32 keeps that error to one slice's sum)
and in the fp32 accumulator, as in the reference's matmul.

``groups > 1`` is the grouped low-rank projection wo_a: x [M, groups·Kg] and weight
[groups·R, Kg], output group g = x[:, g·Kg:(g+1)·Kg] · W[g·R:(g+1)·R]ᵀ (a block-diagonal
GEMM, R a multiple of the N tile). ``quantize_out`` gives the GEMM an MXFP8 epilogue: it
rounds the fp32 tile to bf16, takes the amax of each 32 output columns and writes e4m3 +
UE8M0 bytes ([M, N/32]) with the same helpers as ``quantize_mxfp8_triton``, so the next
MXFP8 GEMM reads bytes identical to quantizing the bf16 output separately. With split-K the
reducing launch quantizes instead (:func:`split_sum`), by the same rules.

:func:`choose_linear_backend` is the model's switch (``--linear-backend``): whether linears
stored as e4m3 + 32×32 UE8M0 blocks run here as MXFP8 (:func:`mxfp8_linear`) or dequantized.
"""

from __future__ import annotations

import importlib.util

import torch

from kernels.mxfp8_gemm_triton import default_config, mxfp8_gemm_triton, split_sum
from kernels.mxfp8_operands import MX_BLOCK, check_operands, mxfp8_gemm_reference, split_k_for


LINEAR_BACKENDS = ("auto", "mxfp8", "dequantized")
MXFP8_DTYPES = (torch.bfloat16, torch.float32)  # activations the fused quantization and o-projection take
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def mxfp8_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why MXFP8 linears cannot run on ``device`` with ``dtype`` activations (None: they can):
    bf16 or float32 activations, and on a GPU Triton and FP8 tensor cores (compute capability
    8.9 or later: the CUDA C++ GEMM on SM90, the Triton kernel elsewhere). The CPU runs the
    torch reference (:func:`mxfp8_linear`)."""
    if dtype not in MXFP8_DTYPES:
        return f"the MXFP8 kernels take bfloat16 or float32 activations, not {str(dtype).replace('torch.', '')}"
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"the MXFP8 kernels run on CUDA GPUs (and as the torch reference on the CPU), not on {device.type}"
    if not _HAS_TRITON:
        return "the MXFP8 kernels need the triton package, which is not installed"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"the MXFP8 GEMM needs FP8 tensor cores (compute capability 8.9+), this GPU is {major}.{minor}"
    return None


def choose_linear_backend(backend: str, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(``mxfp8`` or ``dequantized``, why) for linears stored as FP8 with 32×32 UE8M0 blocks.

    ``auto``: ``mxfp8`` on a CUDA GPU where :func:`mxfp8_unsupported` finds nothing, else
    ``dequantized`` (weights multiplied out to ``dtype`` at load; what the CPU runs unless
    ``mxfp8`` is asked for: then the torch reference of the MXFP8 numerics). An explicit
    ``mxfp8`` that cannot run here raises one line naming ``--linear-backend``."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"--linear-backend: unknown backend {backend!r}; one of {', '.join(LINEAR_BACKENDS)}")
    if backend == "dequantized":
        return backend, "requested"
    reason = mxfp8_unsupported(device, dtype)
    if backend == "mxfp8":
        if reason:
            raise ValueError(f"--linear-backend mxfp8: {reason}")
        return backend, "requested"
    if reason:
        return "dequantized", f"auto: {reason}"
    if device.type != "cuda":
        return "dequantized", "auto: the CPU runs the dequantized reference"
    return "mxfp8", "auto: FP8 tensor cores on this GPU"


def mxfp8_gemm(
    x8: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, groups: int = 1,
    out_dtype: torch.dtype = torch.bfloat16, quantize_out: bool = False, config: dict | None = None,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x8 e4m3 [M, groups·K] + xs uint8 [M, groups·K/32] times w8 e4m3 [N, K] + ws [ceil(N/32), K/32].

    Returns [M, N] in ``out_dtype``, or with ``quantize_out`` (N a multiple of 32) the output
    as MXFP8: (e4m3 [M, N], uint8 [M, N/32]) of its bf16 rounding.

    ``backend``: ``"cuda"`` (kernels/mxfp8_gemm_cuda.py, Hopper), ``"triton"`` (this module),
    or None: CUDA where it runs and takes the operands, else Triton. ``config`` is the chosen
    backend's (see :func:`default_config` and ``default_cuda_config``).
    """
    if backend not in (None, "cuda", "triton"):
        raise ValueError(f"unknown MXFP8 GEMM backend {backend!r}; 'cuda', 'triton' or None")
    if backend != "triton":
        from kernels.mxfp8_gemm_cuda import cuda_gemm_available, mxfp8_gemm_cuda, unsupported_reason

        use_cuda = backend == "cuda"
        if backend is None and x8.is_cuda and cuda_gemm_available(x8.device.index or 0):
            m, n, kg = check_operands(x8, xs, w8, ws, groups)
            use_cuda = (unsupported_reason(x8, xs, w8, ws, m, n, kg, groups) is None
                        and (quantize_out or out_dtype in (torch.bfloat16, torch.float32)))
        if use_cuda:
            return mxfp8_gemm_cuda(x8, xs, w8, ws, groups, out_dtype, quantize_out, config)
    return mxfp8_gemm_triton(x8, xs, w8, ws, groups, out_dtype, quantize_out, config)


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    if not _HAS_TRITON:
        return False
    import triton

    return bool(triton.knobs.runtime.interpret)


def quantize_activation(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → MXFP8 (e4m3 [M, K], UE8M0 bytes [M, K/32]): the fused Triton launch, or on CPU
    tensors (Triton's interpreter off) the torch reference ``kernels.microscaling.quantize_mxfp8``."""
    if not x2.is_cuda and not triton_interpreting():
        from kernels.microscaling import quantize_mxfp8

        return quantize_mxfp8(x2)
    from kernels.mxfp8_quant_triton import quantize_mxfp8_triton

    return quantize_mxfp8_triton(x2)


def mxfp8_linears(x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]],
                  out_dtype: torch.dtype | None = None, groups: int = 1) -> list[torch.Tensor]:
    """x [..., groups·K] times each (w8, ws) of ``weights`` → [..., N_i]: x quantized to MXFP8
    once (:func:`quantize_activation`), then one MXFP8 GEMM per weight (block-diagonal over
    ``groups``); CPU tensors take the torch references (the same numerics)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x8, xs = quantize_activation(x.reshape(-1, k))
    out_dtype = out_dtype or x.dtype
    gemm = mxfp8_gemm if x.is_cuda or triton_interpreting() else mxfp8_gemm_reference
    return [gemm(x8, xs, w8, ws, groups, out_dtype=out_dtype).reshape(*lead, w8.shape[0]) for w8, ws in weights]


def mxfp8_linear(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype | None = None,
                 groups: int = 1) -> torch.Tensor:
    """x [..., groups·K] → [..., N]: the fused MXFP8 activation quantization, then the MXFP8
    GEMM (:func:`mxfp8_linears` with one weight)."""
    return mxfp8_linears(x, [(w8, ws)], out_dtype, groups)[0]


__all__ = [
    "LINEAR_BACKENDS",
    "MXFP8_DTYPES",
    "MX_BLOCK",
    "check_operands",
    "choose_linear_backend",
    "default_config",
    "mxfp8_gemm",
    "mxfp8_gemm_reference",
    "mxfp8_linear",
    "mxfp8_linears",
    "mxfp8_unsupported",
    "quantize_activation",
    "split_k_for",
    "split_sum",
    "triton_interpreting",
]
