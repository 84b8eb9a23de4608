"""Prefix caching of the DeepSeek-V4 family (server/v4_prefix_cache.py): hits restore a state
snapshot at a block boundary and give the cold run's logits; snapshots live in the KV pools,
are evicted whole, and every page and state comes back. (Hits among 16 concurrent requests
under chunking, preemption and async scheduling: test_v4_serving.py.)"""

from __future__ import annotations

import json
import os

import pytest
import torch

from model.config import parse_model_config
from server.kv_cache import BlockManager
from server.sampling_params import SamplingParams
from server.scheduler import ScheduledSeq
from server.sequence import Sequence
from server.v4_kv_specs import v4_family_kv_cache_specs
from tests.server import test_v4_serving as serving
from tests.server.test_v4_serving import V4, V41, assert_no_leaks, golden, make_core

tokenizer_dir = serving.tokenizer_dir  # the fixtures' servable tokenizer (a pytest fixture)
one_torch_thread = serving.one_torch_thread

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
ARITH = os.path.join(ROOT, "configs", "arith-v41")


def generate(core, prompt, params, request_id="r"):
    """Run one request alone: (token ids, their logprobs, prompt logprobs, cached tokens)."""
    core.add_request(request_id, prompt, params)
    ids, lps, plps, cached = [], [], None, 0
    while core.has_unfinished():
        for delta in core.step():
            cached = max(cached, delta.num_cached_tokens)
            if delta.prompt_logprobs is not None:
                plps = [None if e is None else e.logprob for e in delta.prompt_logprobs]
            for sd in delta.seqs:
                ids += sd.token_ids
                lps += [e.logprob for e in sd.logprobs or ()]
        core.scheduler.check_invariants()
    return ids, lps, plps, cached


PLAIN = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
ECHO = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)


@pytest.mark.parametrize("fixture", [V4, V41], ids=["v4", "v41"])
def test_resent_prompt_hits_and_gives_the_cold_runs_logits(fixture, tokenizer_dir):
    prompt = golden(fixture)["prompt_ids"]  # 40 tokens: the last boundary inside it is 32
    core = make_core(fixture, tokenizer_dir)
    bm = core.block_manager
    cold = generate(core, prompt, PLAIN, "a")
    assert cold[3] == 0 and bm.prefix_cache_hits == 0
    hit = generate(core, prompt, PLAIN, "b")
    assert hit[3] == 32 and bm.prefix_cache_hits == 32 and bm.prefix_cache_queries == 2 * len(prompt)
    assert hit[:2] == cold[:2]  # bit for bit: the same forward from the same state
    # Prompt logprobs need every position: no hit, and the same values each time.
    echo = generate(core, prompt, ECHO, "c")
    assert echo[3] == 0 and bm.prefix_cache_hits == 32
    assert generate(core, prompt, ECHO, "d")[:3] == echo[:3]
    assert echo[0] == cold[0]
    # Against no prefix caching at all (one unsplit forward): the same text, logprobs to rounding.
    off = generate(make_core(fixture, tokenizer_dir, enable_prefix_caching=False), prompt, PLAIN)
    assert off[0] == cold[0] and max(abs(a - b) for a, b in zip(off[1], cold[1])) < 1e-5
    assert_no_leaks(core)


def test_shared_prefixes_hit_at_the_right_boundary(tokenizer_dir, monkeypatch):
    base = golden(V41)["prompt_ids"]  # 40 tokens, blocks of 16
    ref = make_core(V41, tokenizer_dir, enable_prefix_caching=False)
    core = make_core(V41, tokenizer_dir)
    bm = core.block_manager

    def check(prompt, cached, rid):
        got = generate(core, prompt, PLAIN, rid)
        assert got[3] == cached, (rid, got[3])
        assert got[0] == generate(ref, prompt, PLAIN, rid)[0]

    check(base, 0, "a")  # snapshot at 32
    check(base[:36] + [7, 8, 9, 10, 11], 32, "longer")  # shares 36 tokens: restores 32
    check(base + [5] * 20, 32, "next-turn")  # extends the first prompt (60 tokens: 48 kept too)
    check(base[:20] + [3] * 10, 0, "leaves-at-16")  # shares block 0 only: a snapshot there now
    check(base[:20] + [4] * 12, 16, "hits-16")
    check(base[:15] + [4] * 12, 0, "inside-block-0")
    check([9] + base[1:33], 0, "first-token-differs")  # the hash chain covers the whole prefix
    assert bm.prefix_cache_hits == 32 + 32 + 16
    assert_no_leaks(core)
    # Checkpoints every 16 tokens: a prompt diverging at 20 hits 16 at once.
    monkeypatch.setenv("MLASERVE_V4_PREFIX_SNAPSHOT_INTERVAL", "10")  # rounded up to 16
    core = make_core(V41, tokenizer_dir)
    check(base, 0, "a")
    check(base[:20] + [6] * 5, 16, "b")
    assert_no_leaks(core)


def test_bundled_arith_v41_hits_match_cold():
    """configs/arith-v41 (real weights, its own tokenizer): few-shot prompts sharing their shots."""
    from server.config import EngineConfig
    from server.engine_core import EngineCore

    cfg = dict(device="cpu", block_size=16, max_num_seqs=4, max_num_batched_tokens=24)
    core = EngineCore(EngineConfig(**cfg), ARITH)
    ref = EngineCore(EngineConfig(**cfg, enable_prefix_caching=False), ARITH)
    shots = core.tokenizer.encode("12+7=19\n30+45=75\n8+8=16\n41+2=43\n")  # 33 tokens with BOS
    params = SamplingParams(max_tokens=4, temperature=0)
    for i, q in enumerate(["21+4=", "50+13=", "6+6="]):
        prompt = shots + core.tokenizer.encode(q, add_special_tokens=False)
        got = generate(core, prompt, params, str(i))
        assert got[0] == generate(ref, prompt, params, str(i))[0]
        assert got[3] == (32 if i else 0)  # the first prompt's snapshot at 32 lies inside the shots
    assert_no_leaks(core)


# ---- the block manager's accounting, without a model ------------------------------------------
def v41_specs(block_size: int, slots: int):
    with open(os.path.join(V41, "config.json"), encoding="utf-8") as f:
        cfg = parse_model_config(json.load(f))
    return v4_family_kv_cache_specs(cfg, block_size, "auto", torch.float32, 16, snapshot_slots=slots)


def schedule_prefill(bm: BlockManager, seq: Sequence, hit=None):
    hit = bm.find_prefix(seq) if hit is None else hit
    num_new = seq.num_tokens - hit.num_tokens
    bm.allocate(seq, num_new, hit)
    entry = ScheduledSeq(seq, num_new, seq.num_computed_tokens)
    seq.num_computed_tokens += num_new
    return hit, bm.end_snapshot_pass([entry])


def test_snapshot_pages_are_free_evictable_and_pinned_while_restored():
    bm = BlockManager(8, 16, True, v41_specs(16, slots=2), max_num_seqs=2)
    total = bm.num_total_blocks
    a = Sequence(0, "a", list(range(40)), SamplingParams(max_tokens=1))
    _, ops = schedule_prefill(bm, a)
    assert [b for b, _ in ops.takes[0]] == [32] and not ops.restores
    bm.free(a)
    # The snapshot holds a 32-token request's pages, counted free (evictable).
    assert len(bm.snapshots) == 1 and bm.num_free_blocks == total and bm.num_cached_free_blocks > 0
    bm.check_invariants([])
    # A re-sent prompt restores it and pins it: its pages are not free while restored.
    b = Sequence(1, "b", list(range(40)), SamplingParams(max_tokens=1))
    hit = bm.find_prefix(b)
    assert hit.num_tokens == 32 and hit.snapshot is not None
    need = bm.num_blocks_needed(b, 8, hit)
    held = sum(bm.snapshots.pages_taken_by(hit, g) for g in range(len(bm.groups)))
    assert held > 0 and need > held
    _, ops = schedule_prefill(bm, b, hit)
    assert list(ops.restores) == [1] and b.num_computed_tokens == 40
    bm.check_invariants([b])
    bm.free(b)
    # A request that needs every page evicts the snapshot whole; the runner is told to drop it.
    c = Sequence(2, "c", [7] * 128, SamplingParams(max_tokens=1))
    assert bm.can_allocate(c, 128)
    bm.allocate(c, 128)
    ops = bm.end_snapshot_pass([])
    assert len(ops.drops) == 1 and len(bm.snapshots) == 0
    bm.check_invariants([c])
    bm.free(c)
    assert bm.num_free_blocks == total and bm.num_cached_free_blocks == 0


def test_snapshots_are_planned_only_into_free_pages():
    """A snapshot never makes a request wait: with the pools full, none is planned."""
    bm = BlockManager(2, 16, True, v41_specs(16, slots=1), max_num_seqs=1)
    a = Sequence(0, "a", list(range(32)), SamplingParams(max_tokens=1))
    _, ops = schedule_prefill(bm, a)
    assert not ops.takes and len(bm.snapshots) == 0
    bm.free(a)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_total_blocks
