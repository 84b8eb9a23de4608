"""The packed V4/V4.1 cache records: V4.1's round trips equal the model's fake quantization
bit for bit; V4's MODEL1 pages have FlashMLA's byte layout and a bounded error."""

import pytest
import torch

from kernels.microscaling import fake_quant_fp4, fake_quant_fp8_ue8m0
from kernels.v4_cache_formats import (
    V4_DATA_BYTES,
    V4_RECORD_BYTES,
    pack_v4_records,
    pack_v41_entries,
    pack_v41_index_keys,
    pack_v41_window_rows,
    unpack_v4_records,
    unpack_v41_entries,
    unpack_v41_index_keys,
    unpack_v41_window_rows,
    v4_page_bytes,
    v4_pages_as_flashmla,
    v41_entry_bytes,
    v41_index_key_bytes,
    v41_window_row_bytes,
)


def _rows(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes, one near-zero block and one large block.
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-6, 6, shape, generator=g).float())
    x[..., :32] *= 1e-6
    x[..., 32:64] *= 1e3
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v41_records_are_the_fake_quantization(dtype):
    x = _rows(3, 5, 512).to(dtype)
    k = _rows(7, 128, seed=1).to(dtype)
    w = pack_v41_window_rows(x)
    e = pack_v41_entries(x)
    i = pack_v41_index_keys(k)
    assert w.dtype == e.dtype == i.dtype == torch.uint8
    assert w.shape[-1] == v41_window_row_bytes(512) == 528
    assert e.shape[-1] == v41_entry_bytes(512) == 288
    assert i.shape[-1] == v41_index_key_bytes(128) == 68
    assert torch.equal(unpack_v41_window_rows(w, dtype), fake_quant_fp8_ue8m0(x, 32))
    assert torch.equal(unpack_v41_entries(e, dtype), fake_quant_fp4(x, 16, "e4m3"))
    assert torch.equal(unpack_v41_index_keys(i, dtype), fake_quant_fp4(k, 32, "ue8m0"))


def test_v41_bad_width_names_the_record():
    with pytest.raises(ValueError, match="window rows"):
        pack_v41_window_rows(torch.randn(2, 48))


def test_v4_pages_layout_and_error():
    page_size = 64
    rows = _rows(3, page_size, 512, seed=2)
    pages = pack_v4_records(rows)
    assert pages.shape == (3, v4_page_bytes(page_size)) and v4_page_bytes(page_size) % 576 == 0
    assert V4_RECORD_BYTES == 584
    # Layout: token t's data at t*576, its 7 scale bytes at page_size*576 + t*8 (+1 zero pad byte).
    t = 5
    data = pages[1, t * V4_DATA_BYTES:(t + 1) * V4_DATA_BYTES]
    rope = data[448:].contiguous().view(torch.bfloat16)
    assert torch.equal(rope, rows[1, t, 448:].to(torch.bfloat16))
    scales = pages[1, page_size * V4_DATA_BYTES + t * 8: page_size * V4_DATA_BYTES + (t + 1) * 8]
    assert scales[7] == 0
    first = data[:64].view(torch.float8_e4m3fn).float() * torch.exp2(scales[0].float() - 127)
    assert torch.equal(first, unpack_v4_records(pages, page_size)[1, t, :64])
    back = unpack_v4_records(pages, page_size)
    rel = (back[..., :448] - rows[..., :448]).abs() / rows[..., :448].abs().reshape(3, page_size, 7, 64).amax(
        -1, keepdim=True).expand(3, page_size, 7, 64).reshape(3, page_size, 448)
    assert rel.max() <= 2 ** -4  # e4m3: 3 mantissa bits, scale ≥ amax/448
    view = v4_pages_as_flashmla(pages, page_size)
    assert view.shape == (3, page_size, 1, 584) and view.stride(0) == pages.shape[1]
    # A shape container over the page (FlashMLA addresses tokens inside it as above).
    assert view.data_ptr() == pages.data_ptr()
    assert torch.equal(view[1].reshape(-1).view(torch.uint8), pages[1, : page_size * V4_RECORD_BYTES])


def test_v4_page_needs_512_wide_rows():
    with pytest.raises(ValueError, match="V4 records"):
        pack_v4_records(torch.randn(2, 4, 576))


def test_v4_row_records_hold_the_model1_bytes_and_fit_tiny_heads():
    """A row per token (the V4 pools): for d = 512 the 576 data bytes and 8 scale bytes of the
    token's MODEL1 record; tiny heads (fewer than 64 no-RoPE dims) take one scale."""
    from kernels.v4_cache_formats import pack_v4_rows, unpack_v4_rows, v4_row_bytes

    rows = _rows(2, 8, 512, seed=3)
    rec = pack_v4_rows(rows, 64)
    pages = pack_v4_records(rows)
    assert rec.shape == (2, 8, 584) and v4_row_bytes(512, 64) == 584
    assert torch.equal(rec[..., :576].reshape(2, -1), pages[:, : 8 * V4_DATA_BYTES])
    assert torch.equal(rec[..., 576:].reshape(2, -1), pages[:, 8 * V4_DATA_BYTES: 8 * V4_RECORD_BYTES])
    assert torch.equal(unpack_v4_rows(rec, 512, 64), unpack_v4_records(pages, 8))
    tiny = _rows(5, 32, seed=4)
    assert v4_row_bytes(32, 8) == 24 + 16 + 8
    back = unpack_v4_rows(pack_v4_rows(tiny, 8), 32, 8)
    assert torch.equal(back[:, 24:], tiny[:, 24:].to(torch.bfloat16).float())
    assert ((back[:, :24] - tiny[:, :24]).abs() <= tiny[:, :24].abs().amax(-1, keepdim=True) * 2 ** -4).all()


def test_v4_index_keys_round_trip_within_e4m3():
    from kernels.v4_cache_formats import pack_v4_index_keys, unpack_v4_index_keys, v4_index_key_bytes

    k = _rows(6, 128, seed=5)
    rec = pack_v4_index_keys(k)
    assert rec.shape == (6, v4_index_key_bytes(128)) == (6, 132)
    err = (unpack_v4_index_keys(rec) - k).abs()
    assert (err <= k.abs().amax(-1, keepdim=True) * 2 ** -4).all()
