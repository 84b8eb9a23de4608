"""Full CUDA graphs for the DeepSeek-V4 family's pure-decode steps (``cudagraph_mode``
FULL_DECODE_ONLY, as R1's server/cuda_graphs.py).

A step whose every chunk is one decode token runs ``model.decode`` as three parts: the host
side (``prepare_decode``: reserve the new entries' pages, build the batch index and V4.1's
engram hash ids), the device side (``decode_batch``: a fixed chain of kernels for a batch
size and the page-table widths) and the state update (``finish_decode``). The device side is
captured once per size of ``decode_capture_sizes`` over persistent inputs
(model/v4/decode_buffers.py: token ids, positions, ring bases, page tables ``max_tokens``
/ ratio entries wide, hash ids); a step copies its inputs in, pads to the smallest captured
size that fits (padding rows read and write only the pools' scratch unit) and replays. The
graphs write into the model's row pools, which are sized once at start-up (the block
manager's plan), so their addresses never move. The indexer top-k, the candidate-block
masks and the padded gathers are intermediates of the graph, at fixed addresses of its
memory pool.

``max_tokens`` is ``--max-model-len`` capped by ``MLASERVE_V4_GRAPH_MAX_LEN``: the torch
attention path gathers every request's entries to the page-table width, so a graph for a
million-token window would hold batch × a million rows of intermediates. Steps with prompt
chunks, decode batches above the largest captured size, and decode steps with a request past
``max_tokens`` run eagerly.
Under capture V4.1's stacked MXFP4 experts run their kernels as in eager mode (fixed-shape
token grouping, no host syncs; kernels/mxfp4_experts.py); bf16 experts (V4, V4.1 with
per-expert modules) take their sync-free path, every local expert on every row
(model/v4/moe.py, model/v41/moe.py), which reads every expert's weights.
"""

from __future__ import annotations

import logging

import torch

from server import envs
from server.cuda_graphs import capture_graphs, graph_capture_sizes

logger = logging.getLogger(__name__)


class V4DecodeGraphs:
    """The captured decode graphs of one V4-family model: :meth:`run` is ``model.decode``."""

    def __init__(self, model, sizes: list[int], max_tokens: int) -> None:
        if not sizes:
            raise ValueError("no CUDA-graph capture sizes")
        self.model = model
        self.sizes = sorted(sizes)
        self.max_batch = self.sizes[-1]
        self.max_tokens = max_tokens
        self.page_widths = model.cache_pools().page_widths(max_tokens)
        self.buffers = model.decode_buffers(self.max_batch, max_tokens)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.num_replays = 0

    def fits(self, batch: int, states=()) -> bool:
        """Whether a decode of ``batch`` requests (their ``states``, when known) can replay: the
        batch is at most the largest captured size and every request stays within ``max_tokens``."""
        return (batch <= self.max_batch and bool(self.graphs)
                and all(s.num_tokens < self.max_tokens for s in states))

    def batch_size(self, n: int) -> int:
        """The captured size an ``n``-row step pads to."""
        return next(s for s in self.sizes if s >= n)

    def _forward(self, b: int) -> torch.Tensor:
        ids, inputs = self.buffers.view(b)
        return self.model.decode_batch(ids, inputs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every buffer row is padding while capturing: the warm-ups write only scratch units."""
        self.buffers.pad(0, self.max_batch)
        self.graphs, self.pool = capture_graphs(self.sizes, self._forward, self.buffers.input_ids.device)
        logger.info("captured %d decode CUDA graphs for %s (batch %d..%d, contexts up to %d tokens; page "
                    "tables: %s)", len(self.graphs), self.model.config.model_type, self.sizes[0], self.max_batch,
                    self.max_tokens,
                    ", ".join(f"{name} {w}" for name, w in self.page_widths.items()))

    def run(self, input_ids: torch.Tensor, states: list) -> torch.Tensor:
        """``model.decode(input_ids, states)`` through the graph of the next captured size."""
        b = self.batch_size(len(states))
        inputs = self.model.prepare_decode(input_ids, states, self.page_widths, check_ids=False)
        self.buffers.fill(input_ids, inputs, b)
        out = self.launch(b)
        self.model.finish_decode(states, inputs)
        return out[: len(states)]

    def launch(self, b: int) -> torch.Tensor:
        """Replay the graph of size ``b`` over the buffers; its output rows."""
        graph, out = self.graphs[b]
        graph.replay()
        self.num_replays += 1
        return out


def maybe_capture_v4(model, config, max_model_len: int) -> V4DecodeGraphs | None:
    """Capture the decode graphs of a V4-family model whose pools are sized (on CUDA, unless
    ``--enforce-eager`` / ``cudagraph_mode`` NONE / DP dispatch / no size fits)."""
    device = model.lm_head.weight.device
    sizes = graph_capture_sizes(device, config, model.par)
    if not sizes:
        return None
    cap = envs.MLASERVE_V4_GRAPH_MAX_LEN
    graphs = V4DecodeGraphs(model, sizes, min(max_model_len, cap) if cap else max_model_len)
    graphs.capture()
    return graphs
