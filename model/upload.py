"""Host values -> device tensors without synchronizing the stream.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and for that PyTorch
waits until the whole stream has drained (a memcpy followed by a stream synchronize). Every such
upload in a step's launch path therefore stalls the host until the GPU has finished all work
queued before it, so the host can never run ahead of the GPU, which async scheduling needs.
Staging through pinned memory and copying with ``non_blocking=True`` queues the copy instead;
PyTorch's pinned-memory cache keeps each staging buffer alive until its copy has run.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` that does not wait for the GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


_NP_TO_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool}
_ALIGN = 16  # bytes: every part starts where any dtype's view may begin


def upload_arrays(arrays: list[np.ndarray], device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Several host arrays on the device through ONE pinned staging buffer and ONE non-blocking
    copy: a step's inputs are a dozen small arrays, and each separate upload costs a pinned
    allocation and a copy launch on the host. On the CPU the arrays are wrapped, not copied
    (callers pass arrays they do not modify afterwards)."""
    device = torch.device(device)
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    staging = host.numpy()
    for a, off in zip(arrays, offsets):
        staging[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
    dev = host.to(device, non_blocking=True)
    return [dev[off:off + a.nbytes].view(_NP_TO_TORCH[a.dtype]).view(a.shape) for a, off in zip(arrays, offsets)]
