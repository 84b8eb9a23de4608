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

import functools
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


def _prefilled(family: str, cache: str, dtype: torch.dtype, g: torch.Generator, device: str = "cpu"):
    """A bundled model (torch attention: the writes are under test) and one state per prompt of
    LENGTHS random tokens."""
    model = load_v4_family(FIXTURES[family], dtype, device)
    model.configure_cache(cache, page_rows=4, attention_backend="torch")
    states = [model.new_state() for _ in LENGTHS]
    with torch.no_grad():
        for n, s in zip(LENGTHS, states):
            if n:
                model(torch.randint(2, model.config.vocab_size, (n,), generator=g).to(device), s)
    return model, states


def _decode_batch(family: str, cache: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    model, states = _prefilled(family, cache, dtype, g)
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


# ---- the fused kernels against the reference ---------------------------------------------------
FORMATS = ["plain", "fake_v41_window", "fake_v41_entry", "fake_v41_key", "v41_window", "v41_entry", "v41_key",
           "v4_row", "v4_key"]
PAGE_ROWS = 4


def format_codec(fmt: str, dim: int, rope_dims: int, dtype: torch.dtype):
    """The pools' codec of encoding ``fmt`` (model/v4/cache_codecs.py, model/v41/model.py)."""
    from kernels.microscaling import fake_quant_fp4, fake_quant_fp8_ue8m0
    from model.v4.cache_codecs import v4_fp8_index_key_codec, v4_fp8_row_codec
    from model.v4.cache_pool import RowCodec, plain_codec
    from kernels import v4_cache_formats as f

    make = {
        "plain": lambda: plain_codec(dim, dtype),
        "fake_v41_window": lambda: plain_codec(dim, dtype, lambda x: fake_quant_fp8_ue8m0(x, 32), fmt),
        "fake_v41_entry": lambda: plain_codec(dim, dtype, lambda x: fake_quant_fp4(x, 16, "e4m3"), fmt),
        "fake_v41_key": lambda: plain_codec(dim, dtype, lambda x: fake_quant_fp4(x, 32, "ue8m0"), fmt),
        "v41_window": lambda: RowCodec(dim, f.v41_window_row_bytes(dim), torch.uint8, f.pack_v41_window_rows,
                                       lambda r: f.unpack_v41_window_rows(r), fmt),
        "v41_entry": lambda: RowCodec(dim, f.v41_entry_bytes(dim), torch.uint8, f.pack_v41_entries,
                                      lambda r: f.unpack_v41_entries(r), fmt),
        "v41_key": lambda: RowCodec(dim, f.v41_index_key_bytes(dim), torch.uint8, f.pack_v41_index_keys,
                                    lambda r: f.unpack_v41_index_keys(r), fmt),
        "v4_row": lambda: v4_fp8_row_codec(dim, rope_dims, torch.float32),
        "v4_key": lambda: v4_fp8_index_key_codec(dim, torch.float32),
    }
    return make[fmt]()


def _poisoned(rows: int, codec, device) -> torch.Tensor:
    t = torch.empty(rows, codec.width, dtype=codec.dtype, device=device)
    return t.fill_(float("nan")) if codec.dtype.is_floating_point else t.fill_(0xFF)


def _signs_times_pow2(shape, g, device) -> torch.Tensor:
    """±2^k with one k per row: RMS statistics that are exact in any summation order."""
    sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    k = torch.randint(-2, 3, (*shape[:-1], 1), generator=g).float()
    return (sign * torch.exp2(k)).to(device)


def _compare(fmt, codec, got: torch.Tensor, want: torch.Tensor, exact: bool, what: str) -> None:
    """Written rows [n, width]: bytes equal when ``exact``; else the decoded values within a
    quantization step of the row's largest value and nearly all rows equal: at most one row
    in ten (at least one), since the kernels' float32 sums run in another order than torch's
    and a last-bit difference flips a bf16 / e4m3 rounding in a few rows. Plain float32 rows
    have no rounding to hide those bits: there only the values are compared, within 1e-5."""
    same_rows = (got.view(torch.uint8) == want.view(torch.uint8)).all(-1)
    if exact:
        assert bool(same_rows.all()), (what, fmt, (~same_rows).nonzero().flatten().tolist()[:8])
        return
    fp32_plain = fmt == "plain" and got.dtype == torch.float32
    if not fp32_plain:
        differ = int((~same_rows).sum())
        assert differ <= max(1, same_rows.numel() // 10), (what, fmt, same_rows.float().mean().item())
    a, b = codec.decode(got).float(), codec.decode(want).float()
    fp4 = "entry" in fmt or fmt in ("v41_key", "fake_v41_key")
    step = (1e-5 if fp32_plain else 0.02) if fmt == "plain" else (0.35 if fp4 else 0.13)
    tol = step * b.abs().amax(-1, keepdim=True) + 1e-6
    assert bool(((a - b).abs() <= tol).all()), (what, fmt, ((a - b).abs() - tol).max().item())


def _disjoint_page_tables(batch: int, pages: int, g) -> torch.Tensor:
    """[batch, pages] page ids, no page in two requests' tables (unit 0 is the scratch unit).
    Requests sharing a row would leave whichever program stored last: on a GPU, any one."""
    return (torch.randperm(batch * pages, generator=g) + 1).view(batch, pages)


def _rope_tables(b: int, rope_dims: int, dtype, g, device):
    ang = torch.rand(b, rope_dims // 2, generator=g) * 6.2832
    return ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)


def check_write_rows(fmt: str, dim: int, rope_dims: int, dtype: torch.dtype, after_cast: bool, ring: bool,
                     exact: bool, batch: int, device: str = "cpu", seed: int = 0, impl=None) -> None:
    """The fused row write (``impl``: default the Triton wrapper) vs the reference, into
    NaN-poisoned pools: ring rows, or paged rows of windows of 2 (open tokens write nothing)."""
    from kernels.v4_kv_write import RowNorm, RowStore, RowTarget, write_rows_reference
    from kernels.v4_kv_write_triton import write_rows_triton

    impl = impl or write_rows_triton
    g = torch.Generator().manual_seed(seed)
    codec = format_codec(fmt, dim, rope_dims, dtype)
    x = (_signs_times_pow2((batch, dim), g, device) if exact else torch.randn(batch, dim, generator=g).to(device))
    x = x.to(dtype)
    w = (torch.rand(dim, generator=g) * 1.5 + 0.25).to(dtype if after_cast else torch.float32).to(device)
    norm = RowNorm(w, 1e-20 if exact else 1e-6, after_cast)
    cos, sin = _rope_tables(batch, rope_dims, dtype, g, device)
    positions = torch.randint(0, 300, (batch,), generator=g)
    units = batch + 1
    if ring:
        rows, ratio = 8, 1
        base = (torch.randperm(batch, generator=g) + 1) * rows
        target = RowTarget(positions.to(device), rows, ring_base=base.to(device))
    else:
        rows, ratio = PAGE_ROWS, 2
        pages = 300 // (ratio * rows) + 1
        table = _disjoint_page_tables(batch, pages, g)
        units = batch * pages + 1
        target = RowTarget(positions.to(device), rows, page_table=table.to(device), ratio=ratio)
    want, got = _poisoned(units * rows, codec, device), _poisoned(units * rows, codec, device)
    ref_latent = write_rows_reference(x, norm, cos, sin, RowStore(want, codec.encode, fmt), target)
    latent = impl(x, norm, cos, sin, RowStore(got, codec.encode, fmt), target, True)
    written = target.flat_rows()[(positions.to(device) + 1) % ratio == 0]
    assert written.numel() > 0 and written.unique().numel() == written.numel()
    _compare(fmt, codec, got[written], want[written], exact, "rows")
    untouched = torch.ones(units * rows, dtype=torch.bool, device=device)
    untouched[written] = False
    untouched[:rows] = False  # the scratch unit: the reference's sink for open tokens
    assert torch.equal(got[untouched].view(torch.uint8), want[untouched].view(torch.uint8)), "wrote outside its rows"
    tol = 0 if exact else (2e-2 if dtype == torch.bfloat16 else 1e-5)
    torch.testing.assert_close(latent, ref_latent, rtol=tol, atol=tol)


# (ratio, overlap, position bias, raw dtype, model dtype, V4.1 norm): V4 CSA / HCA / fp32, V4.1 ratio 2
COMPRESSORS = {"v4_csa": (4, True, True, torch.bfloat16, torch.bfloat16, False),
               "v4_hca": (8, False, True, torch.bfloat16, torch.bfloat16, False),
               "v4_csa_fp32": (4, True, True, torch.float32, torch.float32, False),
               "v41": (2, False, False, torch.float32, torch.bfloat16, True)}


def check_compress(kind: str, fmt: str, dim: int, rope_dims: int, exact: bool, batch: int, device: str = "cpu",
                   seed: int = 0, ratio: int | None = None, impl=None) -> None:
    """The fused compressor step vs the reference: rings holding other requests' rows and a
    NaN-poisoned scratch unit, tokens at every phase of the window (closing or not, window 0
    without a previous window), entries into NaN-poisoned pages."""
    from kernels.v4_kv_write import RowNorm, RowStore, RowTarget, compress_step_reference
    from kernels.v4_kv_write_triton import compress_step_triton

    impl = impl or compress_step_triton
    m, overlap, has_bias, raw_dtype, dtype, after_cast = COMPRESSORS[kind]
    m = ratio or m
    g = torch.Generator().manual_seed(seed)
    codec = format_codec(fmt, dim, rope_dims, dtype)
    width, r = (2 * dim, 2 * m) if overlap else (dim, m)
    units = batch + 1
    if exact:  # equal gates (softmax weights 1/slots), kv rows ±2^k alike in every slot and half (CSA: Ca, Cb)
        rows = _signs_times_pow2((batch, 1, dim), g, "cpu").repeat(1, r, 2 if overlap else 1)
        kv_ring = torch.cat([torch.full((r, width), float("nan")), rows.reshape(-1, width)])
        gate_ring = torch.zeros(units * r, width)
        kv, gate = rows[:, 0].clone(), torch.zeros(batch, width)
        bias = (torch.rand(1, dim, generator=g) * 2).repeat(m, width // dim) if has_bias else None
    else:
        kv_ring, gate_ring = torch.randn(units * r, width, generator=g), torch.randn(units * r, width, generator=g)
        kv_ring[:r] = float("nan")
        kv, gate = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
        bias = torch.randn(m, width, generator=g) if has_bias else None
    positions = torch.randint(0, 8 * m, (batch,), generator=g)
    positions[: min(batch, 3)] = torch.tensor([m - 1, 2 * m - 1, 0])[: min(batch, 3)]  # window 0, window 1, open
    base = (torch.randperm(batch, generator=g) + 1) * r
    if exact:  # each request's own rows in its ring unit, so its window is all ±2^k of one k
        kv_ring[(base.unsqueeze(-1) + torch.arange(r)).flatten()] = rows.reshape(-1, width)
    pages = 8 // PAGE_ROWS + 1
    table = _disjoint_page_tables(batch, pages, g)
    w = (torch.rand(dim, generator=g) * 1.5 + 0.25).to(dtype if after_cast else torch.float32)
    cos, sin = _rope_tables(batch, rope_dims, dtype, g, device)
    to = dict(device=device)
    kv, gate, kv_ring, gate_ring = (t.to(raw_dtype).to(**to) for t in (kv, gate, kv_ring, gate_ring))
    bias = None if bias is None else bias.to(**to)
    norm = RowNorm(w.to(**to), 1e-20 if exact else 1e-6, after_cast)
    ring = RowTarget(positions.to(**to), r, ring_base=base.to(**to))
    target = RowTarget(positions.to(**to), PAGE_ROWS, page_table=table.to(**to), ratio=m)
    n_rows = (batch * pages + 1) * PAGE_ROWS
    want, got = _poisoned(n_rows, codec, device), _poisoned(n_rows, codec, device)
    rings_want, rings_got = (kv_ring.clone(), gate_ring.clone()), (kv_ring.clone(), gate_ring.clone())
    ref_latent = compress_step_reference(kv, gate, *rings_want, ring, base.to(**to), m, overlap, bias, norm, cos,
                                         sin, RowStore(want, codec.encode, fmt), target)
    latent = impl(kv, gate, *rings_got, ring, base.to(**to), m, overlap, bias, norm, cos, sin,
                  RowStore(got, codec.encode, fmt), target, True)
    for a, b in zip(rings_got, rings_want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "rings"
    closes = (positions.to(**to) + 1) % m == 0
    written = target.flat_rows()[closes]
    assert written.unique().numel() == written.numel()
    _compare(fmt, codec, got[written], want[written], exact, f"{kind} entries")
    untouched = torch.ones(n_rows, dtype=torch.bool, device=device)
    untouched[written] = False
    untouched[:PAGE_ROWS] = False
    assert torch.equal(got[untouched].view(torch.uint8), want[untouched].view(torch.uint8)), "wrote outside"
    tol = 0 if exact else (2e-2 if dtype == torch.bfloat16 else 1e-5)
    torch.testing.assert_close(latent[closes], ref_latent[closes], rtol=tol, atol=tol)


def _one_request(target, b: int):
    """RowTarget of request b alone."""
    from dataclasses import replace

    def cut(t):
        return None if t is None else t[b:b + 1]

    return replace(target, positions=cut(target.positions), ring_base=cut(target.ring_base),
                   page_table=cut(target.page_table))


def in_program_order(order):
    """(row write, compressor step) impls running the Triton wrappers one request per launch,
    requests in ``order``: under the interpreter (programs in grid order) this plays a launch's
    programs in another order, as a GPU may. Results equal to the one-launch results show the
    programs do not depend on each other."""
    from kernels.v4_kv_write_triton import compress_step_triton, write_rows_triton

    def rows(x, norm, cos, sin, store, target, want_latent=False):
        out = {b: write_rows_triton(x[b:b + 1], norm, cos[b:b + 1], sin[b:b + 1], store, _one_request(target, b),
                                    want_latent) for b in order(x.shape[0])}
        return torch.cat([out[b] for b in sorted(out)]) if want_latent else None

    def compress(kv, gate, kv_ring, gate_ring, ring, gate_base, ratio, overlap, bias, norm, cos, sin, store, target,
                 want_latent=False):
        out = {b: compress_step_triton(kv[b:b + 1], gate[b:b + 1], kv_ring, gate_ring, _one_request(ring, b),
                                       gate_base[b:b + 1], ratio, overlap, bias, norm, cos[b:b + 1], sin[b:b + 1],
                                       store, _one_request(target, b), want_latent)
               for b in order(kv.shape[0])}
        return torch.cat([out[b] for b in sorted(out)]) if want_latent else None

    return rows, compress


def reversed_order(n: int) -> list[int]:
    return list(range(n))[::-1]


def check_shared_rows_expose_program_order() -> None:
    """Two requests writing one paged row: the stored record is the last program's, so the
    reversed order stores the other one; the order check above would catch a kernel whose
    programs touch each other's rows (rings, gates, entries) the same way."""
    from kernels.v4_kv_write import RowNorm, RowStore, RowTarget
    from kernels.v4_kv_write_triton import write_rows_triton

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, generator=g)
    cos, sin = _rope_tables(2, 16, torch.float32, g, "cpu")
    norm = RowNorm(torch.rand(64, generator=g) + 0.5, 1e-6)
    shared = RowTarget(torch.tensor([1, 1]), PAGE_ROWS, page_table=torch.tensor([[1], [1]]), ratio=2)
    stores = []
    for run in (write_rows_triton, in_program_order(reversed_order)[0]):
        stores.append(torch.full((2 * PAGE_ROWS, 64), float("nan")))
        run(x, norm, cos, sin, RowStore(stores[-1], lambda v: v, "plain"), shared)
    assert not torch.equal(stores[0][PAGE_ROWS], stores[1][PAGE_ROWS])


_INTERPRET_ORDER_SCRIPT = """
import torch
from tests.kernels.test_v4_kv_write import (check_compress, check_shared_rows_expose_program_order,
                                            check_write_rows, in_program_order, reversed_order)
rows, compress = in_program_order(reversed_order)
for fmt, dim, dtype, ring in [("v4_key", 32, torch.bfloat16, True), ("v41_entry", 64, torch.float32, False),
                              ("plain", 64, torch.float32, True)]:
    check_write_rows(fmt, dim, 16, dtype, False, ring, False, 6, seed=1, impl=rows)
for kind, fmt in [("v4_csa", "v4_key"), ("v4_csa_fp32", "plain"), ("v41", "v41_entry"), ("v4_hca", "plain")]:
    for exact in (True, False):
        check_compress(kind, fmt, 32 if fmt == "v4_key" else 64, 16, exact, 6, impl=compress)
check_shared_rows_expose_program_order()
print("interpreter ok")
"""


# The row writes and the compressors: two scripts, run at once (one core each).
_INTERPRET_SCRIPTS = ["""
import torch
from tests.kernels.test_v4_kv_write import FORMATS, check_write_rows
for i, fmt in enumerate(FORMATS):
    dim = 32 if fmt.endswith("key") else 64
    for exact in (True, False):
        check_write_rows(fmt, dim, 16, (torch.bfloat16, torch.float32)[i % 2], i % 3 == 0, i % 2 == 0, exact, 6,
                         seed=i)
print("interpreter ok")
""", """
from tests.kernels.test_v4_kv_write import check_compress
for kind, fmts, ratio in [("v4_csa", ["plain", "v4_row"], None), ("v4_hca", ["v4_row"], 20),
                          ("v4_csa_fp32", ["v4_key"], None), ("v41", ["fake_v41_entry", "v41_entry"], None)]:
    for fmt in fmts:
        for exact in (True, False):
            check_compress(kind, fmt, 32 if fmt == "v4_key" else 64, 16, exact, 6, ratio=ratio)
print("interpreter ok")
"""]


@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    from tests.kernels.test_mxfp8_gemm import run_interpreted

    run_interpreted(*_INTERPRET_SCRIPTS)


@pytest.mark.slow
def test_triton_programs_in_reversed_order_under_interpreter():
    """Each launch replayed one request per launch in reversed order (:func:`in_program_order`)
    writes what the reference writes; and a shared target row does show the order."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", _INTERPRET_ORDER_SCRIPT], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0 and "interpreter ok" in res.stdout, res.stderr[-4000:]


# ---- GPU: real shapes (V4 / V4.1-Flash: head_dim 512, RoPE 64, index keys 128) ------------------
def _dim(fmt: str) -> int:
    return 128 if fmt.endswith("key") else 512


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_row_write_on_gpu(fmt, exact):
    for i, (dtype, after_cast, ring, batch) in enumerate([(torch.bfloat16, True, True, 128),
                                                          (torch.bfloat16, False, False, 32),
                                                          (torch.float32, False, True, 1)]):
        check_write_rows(fmt, _dim(fmt), 64, dtype, after_cast, ring, exact, batch, "cuda", seed=i)


GPU_COMPRESS = [("v4_csa", "plain"), ("v4_csa", "v4_row"), ("v4_csa", "v4_key"), ("v4_hca", "plain"),
                ("v4_hca", "v4_row"), ("v4_csa_fp32", "plain"), ("v41", "fake_v41_entry"), ("v41", "v41_entry")]


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("kind,fmt", GPU_COMPRESS)
def test_fused_compress_on_gpu(kind, fmt, exact):
    ratio = 128 if kind == "v4_hca" else None
    for batch in (1, 32, 128):
        check_compress(kind, fmt, _dim(fmt), 64, exact, batch, "cuda", seed=batch, ratio=ratio)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["v41_window", "v4_row"])
def test_fused_writes_replay_in_a_cuda_graph(fmt):
    """Row write and compressor step captured once, replayed on new positions and inputs copied
    into the captured buffers: each replay writes what the reference writes for those inputs."""
    from kernels.v4_kv_write import RowNorm, RowStore, RowTarget, compress_step_reference, write_rows_reference
    from kernels.v4_kv_write_triton import compress_step_triton, write_rows_triton

    g = torch.Generator().manual_seed(0)
    b, d, m, r = 32, 512, 4, 8
    codec = format_codec(fmt, d, 64, torch.bfloat16)
    x, kv, gate = (torch.empty(n, dtype=torch.bfloat16, device="cuda") for n in ((b, d), (b, 2 * d), (b, 2 * d)))
    cos, sin = (torch.empty(b, 32, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    positions = torch.zeros(b, dtype=torch.long, device="cuda")
    base = (torch.arange(b, device="cuda") + 1) * r
    table = (torch.arange(b * 4, device="cuda").view(b, 4) + 1)
    norm = RowNorm(torch.rand(d, generator=g).cuda() + 0.5, 1e-6)
    bias = torch.randn(m, 2 * d, generator=g).cuda()
    window, entries = _poisoned((b + 1) * r, codec, "cuda"), _poisoned((4 * b + 1) * PAGE_ROWS, codec, "cuda")
    kv_ring = torch.randn((b + 1) * r, 2 * d, generator=g).to(torch.bfloat16).cuda()
    gate_ring = torch.randn((b + 1) * r, 2 * d, generator=g).to(torch.bfloat16).cuda()
    ring = RowTarget(positions, r, ring_base=base)
    paged = RowTarget(positions, PAGE_ROWS, page_table=table, ratio=m)

    def step(rows, entry_rows, kvr, gater, row_fn=write_rows_triton, comp_fn=compress_step_triton):
        row_fn(x, norm, cos, sin, RowStore(rows, codec.encode, fmt), ring)
        comp_fn(kv, gate, kvr, gater, ring, base, m, True, bias, norm, cos, sin,
                RowStore(entry_rows, codec.encode, fmt), paged)

    from tests.kernels.test_mxfp8_gemm import capture

    graph, _ = capture(lambda: step(window, entries, kv_ring, gate_ring))
    for _ in range(3):
        positions.copy_(torch.randint(0, 60, (b,), generator=g))
        for t in (x, kv, gate):
            t.copy_(torch.randn(t.shape, generator=g))
        ang = torch.rand(b, 32, generator=g) * 6
        cos.copy_(ang.cos())
        sin.copy_(ang.sin())
        want = [t.clone() for t in (window, entries, kv_ring, gate_ring)]
        step(*want, row_fn=write_rows_reference, comp_fn=compress_step_reference)
        graph.replay()
        torch.cuda.synchronize()
        closes = (positions + 1) % m == 0
        _compare(fmt, codec, window[ring.flat_rows()], want[0][ring.flat_rows()], False, "graph window")
        if closes.any():
            rows = paged.flat_rows()[closes]
            _compare(fmt, codec, entries[rows], want[1][rows], False, "graph entries")
        assert torch.equal(kv_ring, want[2]) and torch.equal(gate_ring, want[3])


@pytest.mark.gpu
@pytest.mark.parametrize("family,cache", [("v4", "auto"), ("v4", "fp8"), ("v41", "auto"), ("v41", "fp8")])
def test_model_decode_with_fused_writes_on_gpu(family, cache):
    """The bundled models' batched decode (bf16 on CUDA) with the fused writes gives the logits
    the torch writes give, step after step, from the same states."""
    g = torch.Generator().manual_seed(0)
    model, fused = _prefilled(family, cache, torch.bfloat16, g, "cuda")
    with torch.no_grad():
        plain = [s.clone() for s in fused]
        logits = getattr(model, "compute_logits", lambda h: h)
        for step in range(6):
            ids = torch.randint(2, model.config.vocab_size, (len(fused),), generator=g).cuda()
            model.kv_write = "triton"
            got = logits(model.decode(ids, fused)).float()
            model.kv_write = "torch"
            want = logits(model.decode(ids, plain)).float()
            scale = want.abs().amax().item()
            assert (got - want).abs().amax().item() <= 0.05 * scale, (step, (got - want).abs().amax().item(), scale)


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills():
    """Every encoding's row kernel and the V4 CSA / HCA / index and V4.1 compressors at real
    shapes, compiled here for sm_90 (Triton's bundled ptxas): no stack, no local memory."""
    pytest.importorskip("triton")
    import triton

    from kernels.v4_kv_write_triton import _compress_kernel, _layout, _write_rows_kernel
    from tests.kernels.test_mxfp8_gemm import _PTXAS, _compile_sm90, two_at_a_time

    if not _PTXAS.exists():
        pytest.skip("needs triton's bundled ptxas")

    def consts(fmt, dim):
        code, block = _layout(fmt, dim, 64)
        width = format_codec(fmt, dim, 64, torch.bfloat16).width
        return dict(D=dim, ROPE=64, FMT=code, BLOCK=block, NB=triton.next_power_of_2(-(-dim // block)),
                    BH=triton.next_power_of_2(block // 2), WIDTH=width)

    def dst(fmt):
        return "*bf16" if fmt == "plain" or fmt.startswith("fake") else "*u8"

    ints = ("stride_x", "stride_cs", "stride_t", "rows", "ratio", "stride_new", "R")
    common = dict(W="*bf16", eps="fp32", COS="*bf16", SIN="*bf16", POS="*i64", TABLE="*i64", LAT="*bf16",
                  **dict.fromkeys(ints, "i32"))
    cases, calls = [], []
    for fmt in FORMATS:
        for ring in (True, False):
            types = dict(common, X="*bf16", BASE="*i64", DST=dst(fmt))
            c = dict(consts(fmt, _dim(fmt)), RING=ring, AFTER_CAST=True, BF16=True, LATENT=not ring)
            cases.append((fmt, ring))
            calls.append(functools.partial(_compile_sm90, _write_rows_kernel, types, c, num_warps=4,
                                           enable_fp_fusion=False))
    for m, overlap, raw, fmt in [(4, True, "*bf16", "v4_row"), (128, False, "*bf16", "v4_row"),
                                 (4, True, "*bf16", "v4_key"), (2, False, "*fp32", "v41_entry")]:
        dim = _dim(fmt)
        slots = 2 * m if overlap else m
        types = dict(common, KV=raw, GATE=raw, KV_RING=raw, GATE_RING=raw, KV_BASE="*i64", GATE_BASE="*i64",
                     BIAS="*fp32", W="*fp32", DST=dst(fmt))
        c = dict(consts(fmt, dim), M=m, WR=2 * dim if overlap else dim, BLOCK_W=1024 if overlap else dim,
                 SC=min(slots, 8), OVERLAP=overlap, HAS_BIAS=raw == "*bf16", RAW_BF16=raw == "*bf16",
                 AFTER_CAST=raw == "*fp32", BF16=True, LATENT=raw == "*fp32", PRECISE_EXP=True)
        cases.append((m, fmt))
        calls.append(functools.partial(_compile_sm90, _compress_kernel, types, c, num_warps=8 if slots >= 8 else 4,
                                       enable_fp_fusion=False))
    for case, (_, usage) in zip(cases, two_at_a_time(calls)):
        assert " STACK:0 " in usage and usage.endswith("LOCAL:0"), (case, usage)
