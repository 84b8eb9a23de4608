"""Writing a checkpoint directory's files: safetensors shards with their index, and
``generation_config.json``. Shared by the R1-format and the V4-format make-checkpoint."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


class ShardWriter:
    """Safetensors shards of at most ``shard_bytes`` (a tensor group never split) plus
    ``model.safetensors.index.json``. Each full shard goes to disk at once under a temporary
    name and is renamed ``model-0000i-of-0000n`` by :meth:`close`, so memory holds one shard."""

    def __init__(self, out_dir: str, shard_bytes: int) -> None:
        self.out_dir, self.shard_bytes = out_dir, shard_bytes
        self._shard: dict[str, torch.Tensor] = {}
        self._size = 0
        self._written: list[tuple[str, list[str]]] = []  # (temporary file, its tensor names)
        self._total = 0  # tensor bytes, as HF's index counts them

    def add(self, pieces: dict[str, torch.Tensor]) -> None:
        """Add tensors that belong together (a weight and its scale) to the current shard."""
        nbytes = sum(p.numel() * p.element_size() for p in pieces.values())
        if self._shard and self._size + nbytes > self.shard_bytes:
            self._flush()
        self._shard.update({k: v.contiguous() for k, v in pieces.items()})
        self._size += nbytes
        self._total += nbytes

    def _flush(self) -> None:
        name = f".shard-{len(self._written):05d}.safetensors"
        save_file(self._shard, os.path.join(self.out_dir, name), metadata={"format": "pt"})
        self._written.append((name, list(self._shard)))
        self._shard, self._size = {}, 0

    def close(self) -> None:
        if self._shard or not self._written:
            self._flush()
        weight_map, n = {}, len(self._written)
        for i, (tmp, names) in enumerate(self._written):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, tmp), os.path.join(self.out_dir, final))
            weight_map.update({name: final for name in names})
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": self._total}, "weight_map": weight_map}, f, indent=2)


def write_generation_config(out_dir: str, bos_token_id: int, eos_token_id: int) -> None:
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "do_sample": False}, f, indent=2)
