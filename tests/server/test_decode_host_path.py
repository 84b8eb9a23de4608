"""The decode step's host path: persistent block-table rows, and an overlapped (async) launch
that never reads the device (no ``.item()``/``.tolist()``/``bool(tensor)``/sync on the way)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from model.forward_context import padded_block_tables
from server.step_inputs import BlockTableRows


class _Seq:
    def __init__(self, seq_id: int, table: list[int]) -> None:
        self.seq_id, self.block_table = seq_id, table


def test_block_table_rows_follow_growth_replacement_and_release():
    rows = BlockTableRows(rows=2, width=2)
    a, b = _Seq(0, [5]), _Seq(1, [7, 8, 9])
    assert rows.gather([a, b]).tolist() == [[5, 0, 0], [7, 8, 9]]
    a.block_table.append(6)  # a decode step added a page
    assert rows.gather([b, a]).tolist() == [[7, 8, 9], [5, 6, 0]]
    b.block_table = [3]  # preempted and re-admitted: a new, shorter list
    assert rows.gather([a, b]).tolist() == [[5, 6], [3, 0]]
    rows.release([0])
    c = _Seq(2, [1])  # reuses a's row: nothing of a's left
    assert rows.gather([c, b]).tolist() == [[1], [3]]
    assert len(rows) == 2


@pytest.mark.parametrize("append_only", [True, False])
def test_block_table_rows_random_steps_match_lists(append_only):
    rng = random.Random(append_only)
    rows = BlockTableRows(append_only=append_only, rows=1, width=1)
    live: dict[int, _Seq] = {}
    next_id = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.2 or not live:
            live[next_id] = _Seq(next_id, [rng.randrange(50) for _ in range(rng.randrange(1, 6))])
            next_id += 1
        elif op < 0.3:
            sid = rng.choice(list(live))
            rows.release([sid])
            del live[sid]
        elif op < 0.35:
            seq = rng.choice(list(live.values()))
            seq.block_table = [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
        elif op < 0.4 and not append_only:
            seq = rng.choice(list(live.values()))
            seq.block_table[0] = -1  # a dead page released in place
        for seq in live.values():
            if rng.random() < 0.3:
                seq.block_table.append(rng.randrange(50))
        batch = rng.sample(list(live.values()), rng.randrange(1, len(live) + 1))
        got = rows.gather(batch)
        assert np.array_equal(got, padded_block_tables([s.block_table for s in batch]))


# -- an overlapped launch reads nothing back ---------------------------------------------------

_READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__",
          "__array__")


def _mixed_params():
    from server import SamplingParams

    return [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=5, max_tokens=8, ignore_eos=True, seed=3),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=7, min_tokens=4, seed=9),
        SamplingParams(temperature=1.2, max_tokens=9, ignore_eos=True, logit_bias={7: 3.0}),
    ]


def test_overlapped_launch_reads_nothing_from_the_device(tmp_path, monkeypatch):
    """Everything an overlapped launch does besides the model's forward (planning, uploads,
    logits, sampling of every kind of row, the readback's launch) leaves device values alone."""
    from model.checkpoint import write_random_checkpoint
    from server import LLM

    ckpt = write_random_checkpoint("tiny-v3", str(tmp_path / "m"), seed=2)
    llm = LLM(ckpt, block_size=16, num_gpu_blocks_override=128, async_scheduling=True)
    runner = llm.engine.runner
    inside, reads = [False], []
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            if inside[0]:
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (reads.append("synchronize") if inside[0] else None,
                                                               sync(*a) if torch.cuda.is_available() else None))
    launch = runner.launch

    def watched(out, pending=None):
        inside[0] = not out.is_empty and runner.can_overlap(out)
        try:
            return launch(out, pending)
        finally:
            inside[0] = False

    def paused(forward):  # the model itself runs eagerly on the CPU (a graph replay on the GPU)
        def run(*args):
            was, inside[0] = inside[0], False
            try:
                return forward(*args)
            finally:
                inside[0] = was
        return run

    runner.launch = watched
    runner._forward_decode, runner._forward_mixed = paused(runner._forward_decode), paused(runner._forward_mixed)
    prompts = [[3 + i, 9, 11 + i, 4] * (2 + i) for i in range(6)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_mixed_params())
    assert runner.num_overlapped_steps >= 5
    assert reads == []
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 10, 8, 11, 7, 9]


@pytest.mark.gpu
def test_overlapped_decode_launch_does_not_synchronize_on_gpu(tmp_path):
    """Under decode CUDA graphs, with top-p / top-k / min_p / seeded / logit-bias rows: every
    overlapped pure-decode launch runs with CUDA's sync debug mode set to error (a host sync
    raises)."""
    from model.checkpoint import load_config_dict, write_random_checkpoint
    from server import LLM

    cfg = dict(load_config_dict("tiny-v3"), kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=256)
    ckpt = write_random_checkpoint(cfg, str(tmp_path / "m"), seed=3)
    llm = LLM(ckpt, device="cuda", dtype="bfloat16", num_gpu_blocks_override=64, block_size=64,
              max_cudagraph_capture_size=8, max_num_seqs=8, kv_cache_dtype="fp8", async_scheduling=True)
    runner = llm.engine.runner
    assert runner.decode_graphs is not None
    launch = runner.launch
    checked = []

    def strict(out, pending=None):
        if not out.is_decode_only or not runner.can_overlap(out):
            return launch(out, pending)
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = launch(out, pending)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(runner.decode_graphs.fits(len(out.scheduled)))
        return step

    runner.launch = strict
    prompts = [[3 + i, 9, 11 + i, 4] * (2 + i) for i in range(6)]
    llm.generate(prompt_token_ids=prompts, sampling_params=_mixed_params())
    assert len(checked) >= 4 and all(checked)  # overlapped pure-decode launches, each a graph replay
