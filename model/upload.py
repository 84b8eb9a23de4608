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


def numpy_to_device(array: np.ndarray, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.from_numpy(array).to(device)`` that does not wait for the GPU."""
    device = torch.device(device)
    host = torch.from_numpy(array)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
