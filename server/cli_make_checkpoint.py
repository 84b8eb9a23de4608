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
                        "(tiny-v3, tiny-v2, deepseek-r1, deepseek-v2-lite)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--fp8", action="store_true", help="quantize linear weights to FP8 128x128 blocks (R1 format)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=None, help="truncate the preset to this many layers")
    p.add_argument("--no-mtp", action="store_true", help="omit the MTP layer(s)")
    p.add_argument("--shard-size-mb", type=int, default=1024, help="maximum safetensors shard size")


def run(ns: argparse.Namespace) -> int:
    from model.checkpoint import write_random_checkpoint
    from model.config import ConfigError

    try:
        out = write_random_checkpoint(
            ns.config, ns.out, fp8=ns.fp8, seed=ns.seed, num_layers=ns.num_layers, with_mtp=not ns.no_mtp,
            shard_bytes=ns.shard_size_mb * 1024 * 1024, progress=sys.stderr.isatty(),
        )
    except (FileNotFoundError, ConfigError) as exc:
        print(f"error: --config: {exc}", file=sys.stderr)
        return 1
    logger.info("wrote %s", out)
    return 0


SUBCOMMAND = Subcommand("make-checkpoint", "write a random-weight HF-format DeepSeek checkpoint", add_arguments, run)
