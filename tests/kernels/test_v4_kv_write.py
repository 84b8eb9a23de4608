"""The V4 / V4.1 decode KV writes (kernels/v4_kv_write.py, kernels/v4_kv_write_triton.py).

- CPU: the factored reference, as the models' decode now calls it, leaves every pool byte
  what the models' previous chain of torch ops left (kept below as the oracle), on the
  bundled V4 / V4.1 fixtures with both cache dtypes and requests in every window phase.
- Triton under ``TRITON_INTERPRET=1`` on tiny shapes, and on a GPU at real shapes: records
  byte-identical to the reference where the pre-quantization values are exact (rows whose
  RMS statistic is a power of two, so every sum order gives the same bits), close values on
  random rows; NaN-poisoned pools, padded (scratch) rows, window-closing and open tokens,
  CUDA-graph capture and replay.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.rope import apply_trailing_rope
from model.v4_family import load_v4_family

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
FIXTURES = {"v4": os.path.join(ROOT, "tests", "fixtures", "dev-v4-s0"),
            "v41": os.path.join(ROOT, "tests", "fixtures", "dev-v41-s0")}
LENGTHS = [0, 1, 3, 6, 7, 12, 15]  # next tokens close windows of 2, 4, 8 or not


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny shapes run faster on one thread than on two OpenMP threads of a shared box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- the previous chain (the models' decode writes before the fused path) ---------------------
def _old_v4_window(attn, x, batch, pools, cos, sin):
    kv = apply_trailing_rope(attn.kv_norm(attn.kv_proj(x)), cos, sin)
    pool = pools["window"]
    pool.put(attn.layer_idx, batch.ring_rows(pools, "window", batch.positions.unsqueeze(-1)),
             pool.codec.encode(kv).unsqueeze(1))


def _old_v4_pool_rows(comp, kv, gate, prev_kv, prev_gate, has_prev, window_ids, rope):
    gate = gate + comp.position_bias
    if comp.overlap:
        d = comp.head_dim
        prev = has_prev.view(-1, 1, 1)
        ca_kv = torch.where(prev, prev_kv[..., :d], torch.zeros((), dtype=kv.dtype))
        ca_gate = torch.where(prev, (prev_gate + comp.position_bias)[..., :d],
                              torch.full((), float("-inf"), dtype=gate.dtype))
        kv = torch.cat([ca_kv, kv[..., d:]], dim=1)
        gate = torch.cat([ca_gate, gate[..., d:]], dim=1)
    pooled = comp.kv_norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
    cos, sin = rope.cos_sin(window_ids * comp.ratio, pooled.dtype)
    return apply_trailing_rope(pooled, cos, sin)


def _old_v4_decode_store(comp, x, batch, pools, rope):
    m, layer, p = comp.ratio, comp.pool_layer, batch.positions
    kv_name, gate_name, name = (comp.pool_prefix + k for k in ("kv", "gate", "entries"))
    kv_pool, gate_pool, entries = pools[kv_name], pools[gate_name], pools[name]
    here = p.unsqueeze(-1)
    kv_pool.put(layer, batch.ring_rows(pools, kv_name, here), comp.kv_proj(x).unsqueeze(1))
    gate_pool.put(layer, batch.ring_rows(pools, gate_name, here), comp.gate_proj(x).unsqueeze(1))
    this = (p + 1 - m).unsqueeze(-1) + torch.arange(m)
    window = (p + 1) // m - 1
    closes = (p + 1) % m == 0
    prev = (this - m) if comp.overlap else None
    new = _old_v4_pool_rows(
        comp, kv_pool.get(layer, batch.ring_rows(pools, kv_name, this)),
        gate_pool.get(layer, batch.ring_rows(pools, gate_name, this)),
        None if prev is None else kv_pool.get(layer, batch.ring_rows(pools, kv_name, prev)),
        None if prev is None else gate_pool.get(layer, batch.ring_rows(pools, gate_name, prev)),
        window > 0, window.clamp_min(0), rope)
    target = batch.paged_rows(pools, name, window.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    entries.put(layer, torch.where(closes, target, torch.zeros_like(target)), entries.codec.encode(new))


def _old_v41_window(attn, x, batch, pools, cos, sin):
    kv = apply_trailing_rope(attn.kv_norm(attn.wkv(x)), cos, sin)
    pool = pools["window"]
    pool.put(attn.layer_idx, batch.ring_rows(pools, "window", batch.positions.unsqueeze(-1)),
             pool.codec.encode(kv).unsqueeze(1))


def _old_v41_decode_compress(attn, x, batch, pools, rope):
    r, p, pre = attn.ratio, batch.positions, attn.source_pools
    if r > 1:
        kv, gate = attn.compressor.project(x)
        here = batch.ring_rows(pools, pre + "kv", p.unsqueeze(-1))
        pools[pre + "kv"].put(0, here, kv.unsqueeze(1))
        pools[pre + "gate"].put(0, here, gate.unsqueeze(1))
        group = batch.ring_rows(pools, pre + "kv", (p + 1 - r).unsqueeze(-1) + torch.arange(r))
        latent = attn.compressor.pool(pools[pre + "kv"].get(0, group), pools[pre + "gate"].get(0, group), x.dtype)
    else:
        latent = attn.compressor.norm(attn.compressor.wkv(x))
    index = ((p + 1) // r - 1).clamp_min(0)
    cos, sin = rope.cos_sin(index * r, latent.dtype)
    target = batch.paged_rows(pools, pre + "entries", index.unsqueeze(-1)).squeeze(-1)
    rows = torch.where((p + 1) % r == 0, target, torch.zeros_like(target))
    entries = pools[pre + "entries"]
    entries.put(0, rows, entries.codec.encode(apply_trailing_rope(latent, cos, sin)))
    if attn.indexer is not None:
        keys = pools[pre + "keys"]
        keys.put(0, rows, keys.codec.encode(attn.indexer.raw_keys(latent, cos, sin)))


# ---- CPU: the factored reference is the previous chain, bit for bit ---------------------------
def _snapshot(pools) -> dict[str, torch.Tensor]:
    return {name: p.data.clone() for name, p in pools.items()}


def _restore(pools, snap) -> None:
    for name, p in pools.items():
        p.data.copy_(snap[name])


def _assert_same_bytes(pools, snap) -> None:
    for name, p in pools.items():
        assert torch.equal(p.data.view(torch.uint8), snap[name].view(torch.uint8)), name


def _decode_batch(family: str, cache: str, dtype: torch.dtype):
    model = load_v4_family(FIXTURES[family], dtype, "cpu")
    model.configure_cache(cache, page_rows=4)
    g = torch.Generator().manual_seed(0)
    states = [model.new_state() for _ in LENGTHS]
    with torch.no_grad():
        for n, s in zip(LENGTHS, states):
            if n:
                model(torch.randint(2, model.config.vocab_size, (n,), generator=g), s)
    ids = torch.randint(2, model.config.vocab_size, (len(states),), generator=g)
    batch = model.prepare_decode(ids, states).index
    x = torch.randn(len(states), model.config.hidden_size, generator=g).to(dtype)
    return model, batch, x


@pytest.mark.parametrize("cache", ["auto", "fp8"])
@pytest.mark.parametrize("family", ["v4", "v41"])
def test_reference_is_the_previous_decode_chain(family, cache):
    model, batch, x = _decode_batch(family, cache, torch.bfloat16 if cache == "auto" else torch.float32)
    pools = model.cache_pools()
    from model.v4.sparse_attention import write_window_row

    checked = 0
    with torch.no_grad():
        for layer in model.model.layers:
            if family == "v4":
                attn = layer.self_attn
                rope = model.compress_rope if layer.uses_compress_rope else model.main_rope
                parts = [("window", lambda a=attn: write_window_row(
                              pools["window"], a.layer_idx, batch, pools, a.kv_proj(x), a.row_norm, cos, sin, "torch"),
                          lambda a=attn: _old_v4_window(a, x, batch, pools, cos, sin))]
                comps = [] if attn.compressor is None else [attn.compressor]
                if attn.kind == "csa":
                    comps.append(attn.compressor.indexer)
                for c in comps:
                    parts.append(("compress", lambda c=c: c.decode_store(x, batch, pools, rope, "torch"),
                                  lambda c=c: _old_v4_decode_store(c, x, batch, pools, rope)))
            else:
                attn = layer.attn
                rope = model.model.compress_rope if attn.ratio else model.model.main_rope
                parts = [("window", lambda a=attn: write_window_row(
                              pools["window"], a.layer_idx, batch, pools, a.wkv(x), a.row_norm, cos, sin, "torch"),
                          lambda a=attn: _old_v41_window(a, x, batch, pools, cos, sin))]
                if attn.compressor is not None:
                    parts.append(("compress", lambda a=attn: a._decode_compress(x, batch, pools, rope, "torch"),
                                  lambda a=attn: _old_v41_decode_compress(a, x, batch, pools, rope)))
            cos, sin = rope.cos_sin(batch.positions, x.dtype)
            for _, new, old in parts:
                before = _snapshot(pools)
                new()
                after = _snapshot(pools)
                _restore(pools, before)
                old()
                _assert_same_bytes(pools, after)
                assert any(not torch.equal(after[n].view(torch.uint8), before[n].view(torch.uint8)) for n in after)
                checked += 1
    assert checked >= 6
