"""Sampler tests: each behaviour checked against an independent per-row reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

import server.sampler as sampler_mod
from server.sampler import (
    Sampler,
    SamplingRow,
    apply_min_tokens,
    apply_penalties,
    compute_prompt_logprobs,
    filter_logits,
    make_request_generator,
)
from server.sampling_params import SamplingParams

NEG_INF = float("-inf")


def row(params: SamplingParams | None = None, prompt=(), output=(), eos=(1,), seeded: bool = True) -> SamplingRow:
    params = params or SamplingParams()
    gen = make_request_generator(params.seed, "cpu") if seeded else None
    return SamplingRow(params=params, prompt_token_ids=list(prompt), output_token_ids=list(output),
                       generator=gen, eos_token_ids=list(eos))


# -- references (plain Python, one row at a time) ---------------------------------------------

def ref_penalties(logits: list[float], prompt: list[int], output: list[int], rep: float, freq: float,
                  pres: float) -> list[float]:
    out = list(logits)
    seen = set(prompt) | set(output)
    for t in seen:
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


def ref_kept(logits: list[float], min_p: float, top_k: int, top_p: float) -> set[int]:
    """Tokens that survive min_p, then top-k, then top-p (distinct logits assumed)."""
    m = max(logits)
    probs = [math.exp(x - m) for x in logits]
    z = sum(probs)
    probs = [p / z for p in probs]
    kept = [i for i in range(len(logits)) if probs[i] >= min_p * max(probs)]
    kept.sort(key=lambda i: -logits[i])
    if top_k > 0:
        kept = kept[:top_k]
    if top_p < 1.0:
        z = sum(probs[i] for i in kept)
        out, mass = [], 0.0
        for i in kept:
            if mass >= top_p:
                break
            out.append(i)
            mass += probs[i] / z
        kept = out
    return set(kept)


def ref_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


# -- penalties and min_tokens ------------------------------------------------------------------

def test_penalties_match_reference():
    rng = random.Random(0)
    vocab = 40
    rows, expected = [], []
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(0)) * 3
    for i in range(12):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 15))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 15))]
        rep = rng.choice([1.0, 1.3, 0.7])
        freq = rng.choice([0.0, 0.5, -1.0])
        pres = rng.choice([0.0, 1.5, -0.5])
        rows.append(row(SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres),
                        prompt, output))
        expected.append(ref_penalties(logits[i].tolist(), prompt, output, rep, freq, pres))
    out = logits.clone()
    apply_penalties(out, rows)
    torch.testing.assert_close(out, torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_prompt_cache_reuses_and_refreshes():
    cache = sampler_mod.PromptTokenCache()
    a, b = [3, 3, 5], [7]
    first = cache.lookup([a, b], 10, torch.device("cpu"))
    assert sorted(first[0].tolist()) == [3, 5] and first[1].tolist() == [7]
    again = cache.lookup([a], 10, torch.device("cpu"))
    assert again[0] is first[0]  # same prompt list: converted once
    a.append(9)  # a changed list is converted again
    assert sorted(cache.lookup([a], 10, torch.device("cpu"))[0].tolist()) == [3, 5, 9]
    assert cache.lookup([b], 10, torch.device("cpu"))[0] is not first[1]  # b left the batch in between


def test_penalties_across_steps_with_cache():
    vocab = 20
    gen = torch.Generator().manual_seed(5)
    sampler = Sampler()
    params = SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.4, presence_penalty=0.3)
    rows = [row(params, prompt=[1, 2, 3]), row(params, prompt=[4, 4, 5]), row(SamplingParams(temperature=0.0))]
    for _ in range(6):
        logits = torch.randn(3, vocab, generator=gen)
        expected = []
        for i, r in enumerate(rows):
            p = r.params
            ref = ref_penalties(logits[i].tolist(), r.prompt_token_ids, r.output_token_ids, p.repetition_penalty,
                                p.frequency_penalty, p.presence_penalty)
            expected.append(max(range(vocab), key=lambda t: ref[t]))
        got = sampler(logits, rows).token_ids
        assert got == expected
        for r, t in zip(rows, got):
            r.output_token_ids.append(t)


def test_penalty_token_out_of_range_is_an_error():
    logits = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="out of range"):
        apply_penalties(logits, [row(SamplingParams(repetition_penalty=1.2), prompt=[3, 8])])


def test_min_tokens_masks_eos_and_stop_ids_only_while_short():
    params = SamplingParams(min_tokens=3, stop_token_ids=[5], temperature=0.0)
    logits = torch.zeros(3, 8)
    logits[:, 1] = 10.0  # EOS
    logits[:, 5] = 9.0  # stop token
    logits[:, 2] = 1.0
    rows = [row(params, output=[2]), row(params, output=[2, 2, 2]), row(params, output=[2, 2], eos=(1, 7))]
    masked = logits.clone()
    apply_min_tokens(masked, rows)
    assert masked[0, 1] == NEG_INF and masked[0, 5] == NEG_INF
    assert masked[2, 1] == NEG_INF and masked[2, 7] == NEG_INF and masked[2, 5] == NEG_INF
    assert torch.equal(masked[1], logits[1])
    assert Sampler()(logits, rows).token_ids == [2, 1, 2]


def test_min_tokens_blocks_eos_when_sampling_and_with_ignore_eos():
    params = SamplingParams(min_tokens=5, temperature=1.0, ignore_eos=True)
    logits = torch.zeros(64, 6)
    logits[:, 1] = 6.0  # EOS would win ~96% of draws
    rows = [row(params, output=[0] * (i % 5), seeded=False) for i in range(64)]
    assert 1 not in Sampler(3)(logits, rows).token_ids


# -- greedy ------------------------------------------------------------------------------------

def test_greedy_is_argmax_of_penalized_logits():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 50, generator=gen)
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(8)]
    rows += [row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[int(logits[i].argmax())])
             for i in range(8, 16)]
    got = Sampler()(logits, rows).token_ids
    assert got[:8] == logits[:8].argmax(dim=-1).tolist()
    for i in range(8, 16):
        ref = ref_penalties(logits[i].tolist(), rows[i].prompt_token_ids, [], 2.0, 0.0, 0.0)
        assert got[i] == max(range(50), key=lambda t: ref[t])


# -- filtering ---------------------------------------------------------------------------------

@pytest.mark.parametrize("ks", [
    [0, 0, 1, 2, 5, 17, 30, 100],  # top-p-only rows (sorted whole) beside top-k rows (candidates)
    [0, 0, 0, 2, 3],
    [1, 2, 5, 17],  # every row top-k: no index, one path
    [0],  # every row top-p / min_p only
])
def test_filter_matches_reference(ks):
    rng = random.Random(len(ks) + sum(ks))
    vocab, n = 30, 60
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(2)) * 2
    min_p = [rng.choice([0.0, 0.0, 0.05, 0.3]) for _ in range(n)]
    top_k = [rng.choice(ks) for _ in range(n)]
    top_p = [rng.choice([1.0, 1.0, 0.05, 0.5, 0.9, 0.99]) for _ in range(n)]
    out = filter_logits(logits, min_p=min_p, top_k=top_k, top_p=top_p)
    for i in range(n):
        kept = {t for t in range(vocab) if out[i, t] != NEG_INF}
        assert kept == ref_kept(logits[i].tolist(), min_p[i], top_k[i], top_p[i]), (min_p[i], top_k[i], top_p[i])
        for t in kept:
            assert out[i, t] == logits[i, t]


def test_filter_leaves_unfiltered_rows_and_input_untouched():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    out = filter_logits(logits, min_p=[0.0] * 3, top_k=[0, 5, 0], top_p=[1.0, 1.0, 1.0])
    assert torch.equal(logits, before)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert int((out[1] > NEG_INF).sum()) == 5


def test_sampling_never_emits_filtered_tokens():
    vocab = 12
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(4)) * 1.5
    cases = [dict(top_k=3), dict(top_p=0.6), dict(min_p=0.2), dict(top_k=5, top_p=0.8, min_p=0.1)]
    sampler = Sampler(7)
    for case in cases:
        params = SamplingParams(temperature=1.3, **case)
        kept = ref_kept((base / 1.3).tolist(), params.min_p, params.top_k, params.top_p)
        logits = base.expand(2000, vocab).clone()
        tokens = sampler(logits, [row(params, seeded=False) for _ in range(2000)]).token_ids
        assert set(tokens) <= kept, case
        assert len(set(tokens)) == len(kept), case  # and every kept token does come up


# -- the sampled distribution ------------------------------------------------------------------

def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def test_temperature_sampling_follows_softmax():
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temp, draws = 0.7, 40000
    logits = base.expand(draws, 5).clone()
    tokens = Sampler(11)(logits, [row(SamplingParams(temperature=temp), seeded=False)] * draws).token_ids
    counts = [tokens.count(t) for t in range(5)]
    # 4 degrees of freedom: P(chi2 > 35) is about 5e-7, so a correct sampler passes.
    assert chi_square(counts, ref_softmax((base / temp).tolist())) < 35.0
    # ...and the check is sharp enough to reject the untempered distribution.
    assert chi_square(counts, ref_softmax(base.tolist())) > 200.0


def test_top_k_top_p_renormalize_the_kept_tokens():
    base = torch.tensor([1.5, 1.2, 1.0, 0.3, -0.2, -2.0])
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.75)
    kept = sorted(ref_kept(base.tolist(), 0.0, 4, 0.75))
    draws = 30000
    tokens = Sampler(5)(base.expand(draws, 6).clone(), [row(params, seeded=False)] * draws).token_ids
    probs = ref_softmax([base[t].item() for t in kept])
    assert chi_square([tokens.count(t) for t in kept], probs) < 35.0


def test_seeded_draws_follow_softmax():
    base = torch.tensor([0.5, 0.0, -0.5, 1.0])
    draws = 4000
    rows = [row(SamplingParams(temperature=1.0, seed=s)) for s in range(draws)]
    tokens = Sampler()(base.expand(draws, 4).clone(), rows).token_ids
    assert chi_square([tokens.count(t) for t in range(4)], ref_softmax(base.tolist())) < 35.0


# -- seeds and batch invariance ----------------------------------------------------------------

def test_make_request_generator():
    assert make_request_generator(None, "cpu") is None
    a, b = make_request_generator(42, "cpu"), make_request_generator(42, torch.device("cpu"))
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


def test_seeded_row_is_batch_invariant():
    vocab, steps = 64, 6
    gen = torch.Generator().manual_seed(9)
    my_logits = [torch.randn(vocab, generator=gen) for _ in range(steps)]

    def run(batch_mates: int, global_seed: int, seed: int = 1234) -> list[int]:
        sampler = Sampler(global_seed)
        me = row(SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=seed))
        rng = random.Random(batch_mates)
        mates = [row(SamplingParams(temperature=rng.choice([0.0, 0.5, 1.5]), top_k=rng.choice([0, 3]),
                                    min_p=rng.choice([0.0, 0.1]), repetition_penalty=rng.choice([1.0, 1.2]),
                                    seed=rng.choice([None, rng.randrange(100)])),
                     prompt=[rng.randrange(vocab) for _ in range(5)])
                 for _ in range(batch_mates)]
        out = []
        for step in range(steps):
            others = torch.randn(batch_mates, vocab, generator=gen) * 4
            pos = step % (batch_mates + 1)
            logits = torch.cat([others[:pos], my_logits[step][None], others[pos:]])
            rows = mates[:pos] + [me] + mates[pos:]
            token = sampler(logits, rows).token_ids[pos]
            me.output_token_ids.append(token)
            out.append(token)
        return out

    alone = run(0, 0)
    assert run(7, 123) == alone
    assert run(31, 5) == alone
    assert run(0, 0, seed=4321) != alone  # another seed draws another sequence (64 tokens, 6 steps)


def test_unseeded_rows_depend_on_global_seed():
    logits = torch.zeros(200, 50)
    rows = [row(SamplingParams(temperature=1.0), seeded=False)] * 200
    assert Sampler(1)(logits, rows).token_ids == Sampler(1)(logits, rows).token_ids
    assert Sampler(1)(logits, rows).token_ids != Sampler(2)(logits, rows).token_ids


# -- logprobs ----------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_with_rank_and_top():
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(4, 20, generator=gen) * 2
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=3)),
        row(SamplingParams(temperature=2.0, top_k=2, repetition_penalty=1.5, logprobs=0), prompt=[0, 1, 2]),
        row(SamplingParams(temperature=0.5)),
        row(SamplingParams(temperature=0.0, logprobs=20)),
    ]
    result = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    assert result.logprobs[2] is None
    for i in (0, 1, 3):
        entry, tok = result.logprobs[i], result.token_ids[i]
        assert entry.token_id == tok
        assert entry.logprob == pytest.approx(ref[i, tok].item(), abs=1e-5)
        order = sorted(range(20), key=lambda t: -ref[i, t].item())
        assert entry.rank == order.index(tok) + 1
        k = rows[i].params.logprobs
        expected_ids = set(order[:k]) | {tok}
        assert set(entry.top) == expected_ids
        for t, lp in entry.top.items():
            assert lp == pytest.approx(ref[i, t].item(), abs=1e-5)
    assert result.logprobs[0].rank == 1 and len(result.logprobs[0].top) == 3
    assert list(result.logprobs[1].top) == [result.token_ids[1]]


def test_compute_prompt_logprobs():
    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(13))
    nxt = [3, 0, 9, 9, 4]
    ref = torch.log_softmax(logits, dim=-1)
    out = compute_prompt_logprobs(logits, nxt, num_top=2)
    assert [e.token_id for e in out] == nxt
    for j, e in enumerate(out):
        assert e.logprob == pytest.approx(ref[j, nxt[j]].item(), abs=1e-5)
        assert e.rank == int((ref[j] >= ref[j, nxt[j]]).sum())
        assert set(e.top) == set(ref[j].topk(2).indices.tolist()) | {nxt[j]}
    assert compute_prompt_logprobs(logits[:0], [], 3) == []
    with pytest.raises(ValueError):
        compute_prompt_logprobs(logits, nxt[:4], 1)


def test_bad_logits_shape():
    with pytest.raises(ValueError, match="num_rows"):
        Sampler()(torch.zeros(2, 5), [row()])


def test_large_mixed_batch():
    b, v = 256, 4096
    logits = torch.randn(b, v, generator=torch.Generator().manual_seed(14))
    rows = [row(SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.1,
                               frequency_penalty=0.2, logprobs=2, seed=i if i % 2 else None),
                prompt=list(range(i % 7, 200, 3)), output=[i % v] * 3)
            for i in range(b)]
    result = Sampler()(logits, rows)
    assert len(result.token_ids) == b and all(0 <= t < v for t in result.token_ids)


@pytest.mark.gpu
def test_cuda_batch_invariance_and_speed():
    import time

    dev = torch.device("cuda")
    vocab = 129280  # DeepSeek V3's vocabulary
    gen = torch.Generator(device=dev).manual_seed(0)
    mine = torch.randn(1, vocab, device=dev, generator=gen) * 3
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=77)
    alone = Sampler()(mine, [SamplingRow(params, [1, 2], [3], make_request_generator(77, dev), [1])]).token_ids
    mates = torch.randn(255, vocab, device=dev, generator=gen) * 3
    rows = [SamplingRow(SamplingParams(temperature=0.8, top_p=0.95, min_p=0.01, repetition_penalty=1.1,
                                       seed=i if i % 3 == 0 else None, logprobs=1),
                        list(range(i, i + 500)), list(range(i % 50)), make_request_generator(
                            i if i % 3 == 0 else None, dev), [1]) for i in range(255)]
    batched = Sampler()(torch.cat([mates[:100], mine, mates[100:]]),
                        rows[:100] + [SamplingRow(params, [1, 2], [3], make_request_generator(77, dev), [1])]
                        + rows[100:]).token_ids
    assert batched[100] == alone[0]

    sampler = Sampler()
    logits = torch.cat([mates, mine])
    all_rows = rows + rows[:1]
    for _ in range(3):
        sampler(logits, all_rows)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        sampler(logits, all_rows)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / 10 * 1e3
    print(f"sampler 256 x {vocab} mixed (penalties, top-p, seeded, logprobs): {ms:.2f} ms")
    assert ms < 100.0


def test_logit_bias_forces_and_bans_tokens():
    """OpenAI's logit_bias: +100 makes a token win greedy decoding, -100 removes it."""
    from server.errors import InvalidRequestError

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(-1)
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={7: 100.0}), [1], []),
            SamplingRow(SamplingParams(temperature=0, logit_bias={int(top[1]): -100.0}), [1], []),
            SamplingRow(SamplingParams(temperature=0), [1], [])]
    out = Sampler()(logits, rows).token_ids
    assert out[0] == 7 and out[1] != int(top[1]) and out[2] == int(top[2])
    with pytest.raises(InvalidRequestError):
        SamplingParams(logit_bias={3: 101.0})
