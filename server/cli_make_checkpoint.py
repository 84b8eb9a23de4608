"""``mlaserve make-checkpoint``: write a random-weight HF-format DeepSeek checkpoint.

Tests and benchmarks get their checkpoints this way; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import logging
import sys

from server.cli import Subcommand

logger = logging.getLogger("mlaserve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True,
                   help="a config.json path, a checkpoint dir, or a preset from configs/ "
                        "(tiny-v3, tiny-v2, deepseek-r1, deepseek-v2-lite, tiny-v4, tiny-v41, "
                        "deepseek-v4-flash, deepseek-v41-flash)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--fp8", action="store_true",
                   help="quantize as released: FP8 128x128 blocks (R1, V4; V4.1 32x32, ue8m0), "
                        "MXFP4 routed experts (V4, V4.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=None, help="truncate the preset to this many layers")
    p.add_argument("--no-mtp", action="store_true", help="omit the MTP layer(s)")
    p.add_argument("--num-experts", type=int, default=None, help="V4/V4.1: keep this many routed experts")
    p.add_argument("--engram-rows", type=int, default=None,
                   help="V4.1: cap each engram table at this many rows (the config's engram vocab shrinks to match)")
    p.add_argument("--shard-size-mb", type=int, default=1024, help="maximum safetensors shard size")


def run(ns: argparse.Namespace) -> int:
    from model.checkpoint import write_random_checkpoint
    from model.config import ConfigError

    try:
        out = write_random_checkpoint(
            ns.config, ns.out, fp8=ns.fp8, seed=ns.seed, num_layers=ns.num_layers, with_mtp=not ns.no_mtp,
            shard_bytes=ns.shard_size_mb * 1024 * 1024, progress=sys.stderr.isatty(),
            num_experts=ns.num_experts, engram_rows=ns.engram_rows,
        )
    except (FileNotFoundError, ConfigError) as exc:
        print(f"error: --config: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a cut the config cannot take (--num-layers, --num-experts, --engram-rows)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    logger.info("wrote %s", out)
    return 0


SUBCOMMAND = Subcommand("make-checkpoint", "write a random-weight HF-format DeepSeek checkpoint", add_arguments, run)
