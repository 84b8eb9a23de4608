"""Where a wgmma MLA decode kernel's time goes: time it with one part cut at a time (Q.K^T
wgmma, P.V wgmma, the V^T fragment loads), on the same inputs in one
process, as CUDA-graph replays. The variants compute garbage; only their times mean something.
On the device:

    source .device-wheels/install.sh && python3 -m benchmarks.ablate_mla_wgmma             # 64-row kernel
    source .device-wheels/install.sh && python3 -m benchmarks.ablate_mla_wgmma --kernel narrow --heads 16

Each variant is a text edit of a copy of the kernel's .cu file (the asserts say when an edited
line no longer exists; a CPU test checks that too), built with the library's nvcc flags under
--out (default /tmp/mlaserve-ablate).
"""
import argparse
import ctypes
import subprocess
from pathlib import Path

import torch

from kernels import mla_decode_cuda as mdc

# Edits per variant, per kernel: a kernel line (verbatim) and what replaces it ("" deletes it).
# Only cuts that leave every register defined: a kernel whose scores are never written faulted
# on the device (the compiler treats the undefined registers as undefined behaviour), so the
# 64-row kernel's "noqk" zeroes the scores instead and its "nofrag" uses constant fragments.
# No cut of the tile loads: a wait for a load never issued would hang.
_QK = "      wgmma_m64n64k32(s, make_desc(q_lo + ks * kStepQ, kQGroupStride), desc_k, ks);"
_PV = "      for (int mb = 0; mb < 4; ++mb) wgmma_m64n64k32_rs(o[mb], va[kk][mb], make_desc(p_lo + kk * kStepQ, 512), 1);"  # noqa: E501 (verbatim kernel line)
_FRAG = "  auto load_va = [&](int t) { load_v_fragments(tile_smem(t), d0, q4, seq_len - (tile_begin + t) * kTile, va); };"  # noqa: E501 (verbatim kernel line)
CUTS = {
    "base": [],
    "noqk": [(_QK, "      s[(2 * ks) % 32] = 0.f, s[(2 * ks + 1) % 32] = 0.f;")],
    "nopv": [(_PV, "")],
    "nofrag": [(_FRAG, "  auto load_va = [&](int t) { for (auto& k : va) for (auto& m : k) for (auto& r : m) r = 0x38383838u ^ t; };")],  # noqa: E501 (verbatim kernel line)
}
CUTS["nomma"] = CUTS["noqk"] + CUTS["nopv"]
# The narrow kernel (its Q.K^T cannot be deleted either, for the same reason).
NARROW_CUTS = {
    "base": [],
    "nopv": [("        for (int mb = 0; mb < 4; ++mb) wgmma_k32_rs(o[h][mb], va[h][kk][mb], make_desc(p_lo + kk * kStep, 512), 1);", "")],  # noqa: E501 (verbatim kernel line)
}
KERNEL_CUTS = {"wgmma": (mdc.SOURCES[0], CUTS), "narrow": (mdc.SOURCES[1], NARROW_CUTS)}


def build_variant(kernel: str, name: str, out: Path) -> Path:
    return build_edited(kernel, name, KERNEL_CUTS[kernel][1][name], out)


def build_edited(kernel: str, name: str, edits: list[tuple[str, str]], out: Path) -> Path:
    """A library of ``kernel``'s .cu file with each (text, replacement) of ``edits`` applied to
    every occurrence, under out/kernel/name."""
    source = KERNEL_CUTS[kernel][0]
    src = source.read_text()
    for line, replacement in edits:
        assert line in src, f"{name}: the kernel no longer has {line.strip()!r}"
        src = src.replace(line, replacement)
    d = out / kernel / name
    d.mkdir(parents=True, exist_ok=True)
    (d / source.name).write_text(src)
    for header in mdc.HEADERS:
        (d / header.name).write_text(header.read_text())
    lib = d / "variant.so"
    subprocess.run([mdc.find_nvcc() or "nvcc", *mdc.NVCC_FLAGS, "-o", str(lib), str(d / source.name),
                    str(mdc.COMBINE_SOURCE)],  # the split-KV merge, for split launches
                   check=True, capture_output=True, text=True)
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=tuple(KERNEL_CUTS), default="wgmma")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=Path("/tmp/mlaserve-ablate"))
    ap.add_argument("--build-only", action="store_true", help="check that every variant still builds (no GPU)")
    args = ap.parse_args()
    libs = {name: build_variant(args.kernel, name, args.out) for name in KERNEL_CUTS[args.kernel][1]}
    if args.build_only:
        print("built", ", ".join(libs))
        return
    from benchmarks.bench_mla_decode import K_SCALE, Q_SCALE, SM_SCALE, Case, build_inputs, time_call

    x = build_inputs(Case(args.batch, args.seq, args.heads, 1))
    for name, path in libs.items():
        lib = mdc.declare_entry_points(ctypes.CDLL(str(path)))  # holds only this kernel
        mdc._library = lambda lib=lib: lib  # every call below goes to this variant

        def run():
            return mdc.mla_decode_cuda(x["q8"], x["kv8"], x["tables"], x["lens"], SM_SCALE, q_scale=Q_SCALE,
                                       k_scale=K_SCALE, kernel=args.kernel)

        run()
        torch.cuda.synchronize()
        t, mode = time_call(run, (25, 100), use_graph=True)
        print(f"{name:8s} {t * 1e6:8.1f} us ({mode})", flush=True)


if __name__ == "__main__":
    main()
