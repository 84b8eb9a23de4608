"""Full CUDA graphs for pure-decode steps (``cudagraph_mode FULL_DECODE_ONLY``).

A decode step at batch B is a fixed chain of kernels; launching them one by one costs more
than running them at small B. We capture the whole forward once per batch size of
:func:`decode_capture_sizes` over persistent input and attention-metadata buffers, and
replay the smallest graph that fits, padding the batch: pad rows carry slot -1 (their KV goes
to the scratch slot), a context of one token, and block table zeros. Prefill and mixed steps
run eagerly. Every op on the decode path must therefore be free of host syncs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from tqdm import tqdm

from model.forward_context import AttentionMetadata, forward_context

logger = logging.getLogger(__name__)


def capture_sizes(max_size: int) -> list[int]:
    """The default list: 1, 2, 4, 8, then steps of 8 up to 256 and of 16 beyond, and ``max_size``."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_size]
    step_sizes = list(range(16, min(max_size, 256) + 1, 8)) + list(range(272, max_size + 1, 16))
    sizes += step_sizes
    if max_size not in sizes:
        sizes.append(max_size)
    return sorted(set(sizes))


def decode_capture_sizes(config) -> list[int]:
    """The decode batch sizes to capture for an EngineConfig, ascending (empty: none).

    ``cudagraph_capture_sizes`` (``--cudagraph-capture-sizes`` / ``--cuda-graph-sizes`` /
    ``--compilation-config '{"cudagraph_capture_sizes": [...]}'``) is used as given, deduplicated
    and sorted, without the sizes above ``--max-num-seqs`` (a decode step never has more rows).
    Otherwise the default list up to ``min(--max-cudagraph-capture-size or 512, --max-num-seqs)``.
    """
    if config.cudagraph_capture_sizes:
        return sorted(s for s in set(config.cudagraph_capture_sizes) if s <= config.max_num_seqs)
    return capture_sizes(min(config.max_cudagraph_capture_size or 512, config.max_num_seqs))


class DecodeGraphs:
    def __init__(self, runner, sizes: list[int], max_blocks_per_seq: int) -> None:
        if not sizes:
            raise ValueError("no CUDA-graph capture sizes")
        self.runner = runner
        self.sizes = sorted(sizes)
        self.max_batch = self.sizes[-1]
        dev = runner.device
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def fits(self, batch: int) -> bool:
        return batch <= self.max_batch and bool(self.graphs)

    def _metadata(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            query_lens_cpu=[1] * b,
            seq_lens_cpu=[1] * b,
            num_decode_seqs=b,
        )

    def _forward(self, b: int) -> torch.Tensor:
        with forward_context(self.runner.forward_context(self._metadata(b))):
            return self.runner.model(self.input_ids[:b], self.positions[:b])

    @torch.inference_mode()
    def capture(self) -> None:
        self.graphs, self.pool = capture_graphs(self.sizes, self._forward, self.runner.device)
        logger.info("captured %d decode CUDA graphs (batch %d..%d)", len(self.graphs), self.sizes[0], self.max_batch)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        b = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(md.slot_mapping[:n])
        self.seq_lens[:n].copy_(md.seq_lens[:n])
        width = md.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise RuntimeError(f"block table width {width} exceeds the captured {self.block_tables.shape[1]}")
        self.block_tables[:n, :width].copy_(md.block_tables)
        if b > n:  # pad rows: no KV write, one-token context on block 0
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b].zero_()
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]


def capture_graphs(sizes: list[int], forward: Callable[[int], torch.Tensor], device: torch.device,
                   ) -> tuple[dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]], object]:
    """Capture ``forward(b)`` for every size b (after one eager warm-up each: kernel selection,
    autotuning, lazy allocations), largest first so the smaller graphs reuse its memory pool;
    ({b: (graph, its output)}, the pool)."""
    graphs, pool = {}, None
    for b in tqdm(sorted(sizes, reverse=True), desc="Capturing CUDA graphs", unit="graph"):
        forward(b)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward(b)
        if pool is None:
            pool = graph.pool()
        graphs[b] = (graph, out)
    torch.cuda.synchronize(device)
    return graphs, pool


def graph_capture_sizes(device: torch.device, config, par) -> list[int]:
    """The decode sizes to capture, or [] (with one log line saying why) when graphs are off:
    not on CUDA, ``--enforce-eager``, ``cudagraph_mode`` NONE, DP dispatch, or no size fits."""
    if device.type != "cuda" or config.enforce_eager or config.cudagraph_mode == "NONE":
        return []
    if par.dispatch_moe:
        # DP ranks exchange their (different) row counts every step on the host; graphs would
        # need every rank padded to one captured size first (not implemented yet).
        logger.info("decode CUDA graphs off under DP > 1 (per-step row counts differ across ranks)")
        return []
    sizes = decode_capture_sizes(config)
    if not sizes:
        logger.info("decode CUDA graphs off: no capture size in %s is at most --max-num-seqs %d",
                    list(config.cudagraph_capture_sizes), config.max_num_seqs)
    return sizes


def maybe_capture(runner, config, max_model_len: int) -> DecodeGraphs | None:
    """Capture decode graphs when on CUDA, not --enforce-eager, and cudagraph_mode allows."""
    if runner.device.type != "cuda" or config.enforce_eager or config.cudagraph_mode == "NONE":
        return None
    if not runner.model.par.dispatch_moe and not runner.decode_backend.support.cuda_graph_safe:
        logger.info("decode CUDA graphs off: attention backend %r is not graph-safe (running eagerly)",
                    runner.decode_backend.name)
        return None
    sizes = graph_capture_sizes(runner.device, config, runner.model.par)
    if not sizes:
        return None
    max_blocks = -(-max_model_len // config.block_size)
    graphs = DecodeGraphs(runner, sizes, max_blocks)
    graphs.capture()
    return graphs
