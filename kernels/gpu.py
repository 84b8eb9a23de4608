"""What the kernels' launch planning asks about the GPU: its SM count.

Off CUDA (CPU runs of the planners, the Triton interpreter) the answer is 132, an H100/H200's,
so a CPU test plans the same launches the served GPU does.
"""

from __future__ import annotations

import torch

HOPPER_SMS = 132


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (its current CUDA device when it has no index)."""
    if device.type != "cuda":
        return HOPPER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
