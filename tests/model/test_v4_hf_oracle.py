"""Our DeepSeek-V4 equals HF transformers 5.24's DeepseekV4ForCausalLM on tiny random models.

The oracle has every layer kind (sliding, CSA with indexer top-k, HCA) and both MoE kinds
(hash-routed, top-k with correction bias), with randomised sinks, position biases, tid2eid and
mHC parameters; the prompts are longer than the window and give CSA more entries than its
top-k. One-shot prefill, chunked prefill and token-by-token decode must agree.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4")

from model.v4.config import parse_v4_config
from model.v4.model import DeepseekV4ForCausalLM
from tests.model.v4_oracle import build_hf_v4

torch.set_num_threads(1)  # tiny ops are much slower with two OpenMP threads on a 2-core machine

SEQ = 37


@pytest.fixture(scope="module")
def pair():
    hf = build_hf_v4(seed=0)
    ours = DeepseekV4ForCausalLM(parse_v4_config(hf.config.to_dict()))
    ours.load_weights(hf.state_dict().items())
    return hf, ours


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 256, (SEQ,), generator=torch.Generator().manual_seed(7))


def run_chunks(model, ids, sizes):
    state, rows, start = model.new_state(), [], 0
    for n in sizes:
        rows.append(model.compute_logits(model(ids[start:start + n], state)))
        start += n
    assert start == ids.shape[0]
    return torch.cat(rows)


def test_state_dict_matches_hf_names_and_shapes(pair):
    hf, ours = pair
    ref = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == ref


def test_oracle_exercises_every_layer_kind(pair, prompt):
    _, ours = pair
    c = ours.config
    assert set(c.layer_kinds) == {"sliding", "csa", "hca"} and any(c.hash_layers) and not all(c.hash_layers)
    assert SEQ > c.sliding_window and SEQ // 4 > c.index_topk and SEQ // 8 >= 2
    assert ours.model.layers[1].self_attn.sinks.abs().min() > 0
    assert ours.model.layers[0].mlp.gate.tid2eid.unique().numel() == c.n_routed_experts


@pytest.mark.parametrize("seq_len", [1, 13, SEQ])
def test_prefill_log_softmax_matches_hf(pair, prompt, seq_len):
    hf, ours = pair
    ids = prompt[:seq_len]
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids[None]).logits[0].float(), dim=-1)
        out = torch.log_softmax(run_chunks(ours, ids, [seq_len]), dim=-1)
    assert (out - ref).abs().max().item() < 1e-4


def test_chunked_prefill_and_decode_equal_one_shot(pair, prompt):
    _, ours = pair
    with torch.no_grad():
        one_shot = run_chunks(ours, prompt, [SEQ])
        chunked = run_chunks(ours, prompt, [5, 7, 9, SEQ - 21])
        odd = run_chunks(ours, prompt, [1, 3, 8, 4, 21])
        decode = run_chunks(ours, prompt, [1] * SEQ)
    for other in (chunked, odd, decode):
        assert (other - one_shot).abs().max().item() <= 1e-4


def test_chunked_prefill_matches_hf_cached_chunks(pair, prompt):
    """Our per-request state evolves as HF's DynamicCache does, chunk for chunk."""
    from transformers import DynamicCache

    hf, ours = pair
    sizes = [5, 7, 9, SEQ - 21]
    cache, rows, start = DynamicCache(config=hf.config), [], 0
    with torch.no_grad():
        for n in sizes:
            rows.append(hf(prompt[None, start:start + n], cache=cache).logits[0])
            start += n
        diff = run_chunks(ours, prompt, sizes) - torch.cat(rows)
    assert diff.abs().max().item() <= 1e-5


def test_query_blocks_equal_whole_chunk(pair, prompt):
    _, ours = pair
    attns = [layer.self_attn for layer in ours.model.layers]
    with torch.no_grad():
        whole = run_chunks(ours, prompt, [SEQ])
        for attn in attns:
            attn.query_block = 3
        try:
            blocked = run_chunks(ours, prompt, [30, SEQ - 30])
        finally:
            for attn in attns:
                attn.query_block = 256
    assert (blocked - whole).abs().max().item() <= 1e-4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_chunk_boundaries_equal_one_shot(pair, prompt, seed):
    _, ours = pair
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(SEQ - 1, generator=gen)[:6].add(1).tolist())
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, SEQ])]
    with torch.no_grad():
        diff = run_chunks(ours, prompt, sizes) - run_chunks(ours, prompt, [SEQ])
    assert diff.abs().max().item() <= 1e-4, sizes


def test_bfloat16_matches_hf_bfloat16(pair, prompt, tmp_path):
    """In bf16 the same tensors stay float32 as in HF (norms, mHC, sinks, position biases)."""
    from transformers import DeepseekV4ForCausalLM as HFModel

    hf, ours = pair
    hf.save_pretrained(tmp_path)
    hf_bf16 = HFModel.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ours_bf16 = DeepseekV4ForCausalLM(ours.config, dtype=torch.bfloat16)
    ours_bf16.load_weights(hf.state_dict().items())
    fp32_names = {k for k, v in hf_bf16.state_dict().items() if v.dtype == torch.float32}
    assert fp32_names == {k for k, v in ours_bf16.state_dict().items() if v.dtype == torch.float32}
    with torch.no_grad():
        ref = torch.log_softmax(hf_bf16(prompt[None]).logits[0].float(), dim=-1)
        out = torch.log_softmax(run_chunks(ours_bf16, prompt, [SEQ]), dim=-1)
    assert (out - ref).abs().max().item() < 1e-2


def greedy(model, ids, n):
    state = model.new_state()
    logits = model.compute_logits(model(ids, state)[-1:])
    out = []
    for _ in range(n):
        nxt = logits.argmax(-1)
        out.append(int(nxt))
        logits = model.compute_logits(model(nxt, state))
    return out


def test_greedy_continuation_matches_hf_generate(pair, prompt):
    hf, ours = pair
    n = 12
    with torch.no_grad():
        ref = hf.generate(prompt[None, :20], max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, 20:].tolist()
        out = greedy(ours, prompt[:20], n)
    assert out == ref


def test_features_move_the_logits(pair, prompt):
    """Sinks, position bias and the indexer's top-k each change the output (none is a no-op)."""
    _, ours = pair
    with torch.no_grad():
        base = run_chunks(ours, prompt, [SEQ])
        attn = ours.model.layers[1].self_attn
        for tensor in (attn.sinks, attn.compressor.position_bias):
            saved = tensor.clone()
            tensor.zero_()
            moved = (run_chunks(ours, prompt, [SEQ]) - base).abs().max().item()
            tensor.copy_(saved)
            assert moved > 1e-3
        topk = attn.compressor.indexer.topk
        attn.compressor.indexer.topk = 1000
        moved = (run_chunks(ours, prompt, [SEQ]) - base).abs().max().item()
        attn.compressor.indexer.topk = topk
        assert moved > 1e-3


def test_load_weights_errors_name_the_tensor(pair, caplog):
    hf, ours = pair
    sd = hf.state_dict()
    fresh = DeepseekV4ForCausalLM(ours.config)
    with pytest.raises(ValueError, match="unexpected tensor 'model.bogus'"):
        fresh.load_weights([("model.bogus", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape mismatch for lm_head.weight"):
        fresh.load_weights([("lm_head.weight", torch.zeros(1, 1))])
    with pytest.raises(ValueError, match="missing tensor"):
        fresh.load_weights([(k, v) for k, v in sd.items() if k != "model.norm.weight"])
    mtp = [("mtp.0.e_proj.weight", torch.zeros(2, 2)), ("mtp.0.norm.weight", torch.zeros(2))]
    with caplog.at_level("INFO", logger="model.v4.model"):
        fresh.load_weights([*sd.items(), *mtp])  # MTP is skipped, with one log line
    assert [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()] == [
        "skipped 2 MTP tensors (mtp.*): multi-token prediction is not loaded"]
    with pytest.raises(ValueError, match="token id 256 is outside the vocabulary"):
        fresh(torch.tensor([3, 256]), fresh.new_state())


def test_hca_at_the_released_ratio_128_matches_hf():
    """V4-Flash's HCA ratio (128) on a prompt holding two complete windows plus an open one,
    one-shot and with chunks that end mid-window and at a window boundary."""
    hf = build_hf_v4(seed=3, num_hidden_layers=2, layer_types=["sliding_attention", "heavily_compressed_attention"],
                     mlp_layer_types=["moe", "moe"],
                     compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    ours = DeepseekV4ForCausalLM(parse_v4_config(hf.config.to_dict()))
    ours.load_weights(hf.state_dict().items())
    assert ours.config.compress_ratios == (0, 128)
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids[None]).logits[0].float(), dim=-1)
        one = torch.log_softmax(run_chunks(ours, ids, [300]), dim=-1)
        state = ours.new_state()
        ours(ids, state)
        chunked = torch.log_softmax(run_chunks(ours, ids, [100, 28, 1, 127, 44]), dim=-1)
    assert (one - ref).abs().max().item() < 1e-4
    assert (chunked - one).abs().max().item() < 1e-4
    assert state.num_tokens // ours.config.compress_ratios[1] == 2  # windows 0..127 and 128..255; 256..299 open
    assert state.lease.pools["hca128.entries"].data.shape[0] == 1
