"""How far the CUDA C++ decode's LSE is from float64 on the same FP8 inputs, where the error
comes from, and what a fix costs: per kernel variant, the max and mean LSE error, the output's
relative error and the time (CUDA-graph replay), with the Triton kernel's LSE error on the same
inputs beside them. On the device:

    source .device-wheels/install.sh && python3 -m benchmarks.lse_mla_cuda                 # 64-row kernel
    source .device-wheels/install.sh && python3 -m benchmarks.lse_mla_cuda --kernel narrow --heads 16

Variants (text edits of a copy of the kernel's .cu, as in benchmarks/ablate_mla_wgmma.py):
``base`` is the kernel as it is; ``qkN`` computes Q.K^T as N tensor-core accumulator chains
over consecutive runs of the 18 k-steps, added in fp32 once they land. Hopper's FP8 wgmma
truncates its accumulator to about 13 mantissa bits at every step, so the error a chain adds
grows with the magnitude it has reached; shorter chains keep it smaller (benchmarks/
KERNEL_NOTES.md, "LSE accuracy"). Each extra chain costs one more score array in registers.
``--build-only`` checks that every variant builds (no GPU).
"""
import argparse
import ctypes
from pathlib import Path

import torch

from benchmarks.ablate_mla_wgmma import build_edited
from kernels import mla_decode_cuda as mdc

K_STEPS = 18  # Q.K^T k-steps of 32 dims


def _chains(n: int, issue: str, array: str, length: str, fence: str) -> list[tuple[str, str]]:
    """Edits that split the k-step loop's ``issue`` line (``wgmma(s, ..., ks);``) into n chains
    whose arrays s, s_1, ... are declared after ``array`` and summed into s after ``fence`` (the
    line, with its newlines, where the scores are first read after their wait)."""
    bounds = [K_STEPS * i // n for i in range(n + 1)]
    extra = [f"s_{i}" for i in range(1, n)]
    declare = array + "\n" + "".join(f"  float {name}[{length}];\n" for name in extra)
    branches = []
    for i in range(n):
        target = "s" if i == 0 else extra[i - 1]
        call = issue.replace("(s,", f"({target},").replace(", ks);", f", ks - {bounds[i]});")
        cond = f"if (ks < {bounds[i + 1]}) " if i < n - 1 else ""
        branches.append(("      else " if i else "      ") + cond + call.strip())
    add = "".join(f"fence_regs({name}); _Pragma(\"unroll\") for (int i_ = 0; i_ < {length}; ++i_) s[i_] += {name}[i_]; "
                  for name in extra)
    return [(array, declare), (issue, "\n".join(branches)), (fence, fence[:-1] + " " + add + "\n")]


_WGMMA_QK = "      wgmma_m64n64k32(s, make_desc(q_lo + ks * kStepQ, kQGroupStride), desc_k, ks);"
_WGMMA_S = "  float s[32];  // S[rows 16 warp + g + 8i][tokens 8j + 2q4 + e] at s[4j + 2i + e]"
_NARROW_QK = "      wgmma_k32(s, desc_k, make_desc(q_lo + ks * kStep, kQGroupStride), ks);"
_NARROW_S = "  float s[N / 2];  // s[4j + 2i + e] = S[query row 8j + 2q4 + e][token 16warp + g + 8i]"
# Where the scores are read after their wait: the 64-row kernel's peeled first tile and main
# loop (4 spaces; not its rare early wait before a rescale, 6 spaces, which the main loop's
# wait follows), the narrow kernel's loop.
_WGMMA_FENCE = "\n    fence_regs(s);\n"
_NARROW_FENCE = "\n    fence_regs(s);\n"
VARIANTS = {
    "wgmma": {"base": [], "qk2": _chains(2, _WGMMA_QK, _WGMMA_S, "32", _WGMMA_FENCE)},
    "narrow": {"base": [], **{f"qk{n}": _chains(n, _NARROW_QK, _NARROW_S, "N / 2", _NARROW_FENCE) for n in (2, 3)}},
}


def lse_errors(lse: torch.Tensor, ref_lse: torch.Tensor) -> str:
    d = lse[: ref_lse.shape[0]].double() - ref_lse
    return f"lse max {d.abs().max().item():.2e} mean {d.mean().item():+.2e}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=tuple(VARIANTS), default="wgmma")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--s-q", type=int, default=1)
    ap.add_argument("--ref-requests", type=int, default=16, help="requests checked against float64")
    ap.add_argument("--out", type=Path, default=Path("/tmp/mlaserve-lse"))
    ap.add_argument("--build-only", action="store_true")
    args = ap.parse_args()
    libs = {name: build_edited(args.kernel, name, edits, args.out) for name, edits in VARIANTS[args.kernel].items()}
    if args.build_only:
        print("built", ", ".join(libs))
        return
    from benchmarks.bench_mla_decode import (K_SCALE, Q_SCALE, SM_SCALE, Case, build_inputs, reference64, rel_err,
                                             time_call)
    from kernels.mla_decode_triton import mla_decode_triton

    x = build_inputs(Case(args.batch, args.seq, args.heads, args.s_q))
    args8 = (x["q8"], x["kv8"], x["tables"], x["lens"], SM_SCALE)
    n_ref = min(args.ref_requests, args.batch)
    ref, ref_lse = reference64(x["q8"], x["kv8"], x["tables"], x["lens"], Q_SCALE, K_SCALE, args.s_q, n_req=n_ref)
    out, lse = mla_decode_triton(*args8, q_scale=Q_SCALE, k_scale=K_SCALE)
    print(f"B={args.batch} H={args.heads} S={args.seq} s_q={args.s_q}, float64 on {n_ref} requests", flush=True)
    print(f"{'triton':8s} {'':22s} {lse_errors(lse, ref_lse)}, out {rel_err(out, ref):.2e}", flush=True)
    for name, path in libs.items():
        lib = mdc.declare_entry_points(ctypes.CDLL(str(path)))  # holds only this kernel
        mdc._library = lambda lib=lib: lib  # every call below goes to this variant

        def run():
            return mdc.mla_decode_cuda(*args8, q_scale=Q_SCALE, k_scale=K_SCALE, kernel=args.kernel)

        out, lse = run()
        torch.cuda.synchronize()
        t, mode = time_call(run, (25, 100), use_graph=True)
        print(f"{name:8s} {t * 1e6:8.1f} us ({mode:5s}) {lse_errors(lse, ref_lse)}, out {rel_err(out, ref):.2e}",
              flush=True)


if __name__ == "__main__":
    main()
