"""A few launches of the CUDA C++ MLA decode at one shape, for Nsight Compute:

    ncu --clock-control none -k regex:mla_decode_fp8 -c 1 --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats python3 -m benchmarks.profile_mla_cuda
"""

from __future__ import annotations

import argparse

import torch


from benchmarks.bench_mla_decode import K_SCALE, Q_SCALE, SM_SCALE, Case, build_inputs
from kernels.mla_decode_cuda import mla_decode_cuda, set_cache_dir
from server import envs


def main() -> None:
    set_cache_dir(envs.MLASERVE_KERNEL_CACHE)
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--sq", type=int, default=1)
    ap.add_argument("--splits", type=int, default=None)
    args = ap.parse_args()
    x = build_inputs(Case(args.batch, args.seq, args.heads, args.sq))
    for _ in range(3):
        mla_decode_cuda(x["q8"], x["kv8"], x["tables"], x["lens"], SM_SCALE, q_scale=Q_SCALE, k_scale=K_SCALE,
                        num_splits=args.splits)
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
