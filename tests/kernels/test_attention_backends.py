"""The attention backend registry (kernels/attention/): what each class declares, the one
``auto`` policy and its one log line, clear refusals of explicit requests, and prefill kept
apart from decode. GPUs are simulated by patching torch's device queries: nothing here runs a
GPU kernel (the kernels' own tests do)."""

from __future__ import annotations

import logging

import pytest
import torch

import kernels.attention as attention
from kernels import mla_decode_cuda as mdc
from kernels.attention import (DECODE_BACKENDS, PREFILL_BACKENDS, AttentionSpec, BackendUnavailable, DecodeBackend,
                               PrefillBackend, select_decode_backend, select_prefill_backend)

FP8 = torch.float8_e4m3fn


def spec(device="cuda", cache=FP8, heads=16, rank=512, rope=64, page=64, query_len=1):
    return AttentionSpec(torch.device(device), cache, heads, rank, rope, page, 192 ** -0.5, torch.bfloat16,
                         query_len=query_len)


@pytest.fixture
def gpu(monkeypatch):
    """A simulated GPU of the given compute capability, whose CUDA library builds (or not)."""

    def make(capability=(9, 0), library_builds=True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)

        def build():
            if not library_builds:
                raise mdc.CudaKernelUnavailable("nvcc failed building mla_decode_wgmma_sm90a.cu:\nerror: x")
            return "built"

        monkeypatch.setattr(mdc, "default_library_path", build)

    return make


def test_every_backend_declares_what_it_runs():
    from server.config import ATTENTION_BACKENDS

    assert ATTENTION_BACKENDS == ("auto", *DECODE_BACKENDS)  # the flag's choices are the registry
    assert set(DECODE_BACKENDS) == {"torch", "triton", "cuda", "flashinfer", "trtllm"}
    for name, cls in {**DECODE_BACKENDS, **PREFILL_BACKENDS}.items():
        assert cls.name == name and cls.support.devices and cls.support.cache_dtypes
        assert cls.support.describe()
    graph_safe = {name for name, cls in DECODE_BACKENDS.items() if cls.support.cuda_graph_safe}
    assert graph_safe == {"triton", "cuda"}
    assert DECODE_BACKENDS["cuda"].support.capability_majors == (9,)
    assert DECODE_BACKENDS["trtllm"].support.capability_majors == (10,)


@pytest.mark.parametrize("case,want", [
    (dict(device="cpu"), "torch"),
    (dict(device="cpu", cache=torch.float32), "torch"),
    (dict(capability=(9, 0)), "cuda"),
    (dict(capability=(9, 0), heads=128, query_len=2), "cuda"),
    (dict(capability=(9, 0), library_builds=False), "triton"),
    (dict(capability=(9, 0), page=16), "triton"),  # the cuda kernels need pages of whole 64-token tiles
    (dict(capability=(8, 0)), "triton"),
    (dict(capability=(10, 0)), "triton"),
    (dict(capability=(9, 0), cache=torch.bfloat16), "cuda"),  # the bf16 narrow kernel (<= 32 rows)
    (dict(capability=(9, 0), cache=torch.bfloat16, heads=128), "triton"),  # > 32 rows: FlashInfer is never auto
    (dict(capability=(9, 0), cache=torch.bfloat16, library_builds=False), "triton"),
    (dict(capability=(9, 0), cache=torch.float32), "torch"),
    (dict(capability=(9, 0), cache=torch.bfloat16, rank=96), "torch"),  # not a power of two
], ids=lambda v: str(v) if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()))
def test_auto_policy(gpu, case, want):
    case = dict(case)
    capability, builds = case.pop("capability", None), case.pop("library_builds", True)
    if capability is not None:
        gpu(capability, builds)
    assert select_decode_backend("auto", spec(**case)).name == want


def test_auto_logs_exactly_one_line_naming_the_backend_and_why(gpu, caplog):
    gpu((9, 0))
    with caplog.at_level(logging.INFO, logger="kernels.attention"):
        backend = select_decode_backend("auto", spec())
    assert backend.name == "cuda"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["attention backend: cuda (auto: Hopper SM90 with an fp8 latent cache; CUDA-graph safe)"]
    caplog.clear()
    gpu((9, 0), library_builds=False)
    with caplog.at_level(logging.INFO, logger="kernels.attention"):
        select_decode_backend("auto", spec())
    lines = [r.getMessage() for r in caplog.records]  # the build failure is the reason, not a second line
    assert len(lines) == 1 and lines[0].startswith("attention backend: triton (auto: fp8 latent cache, cuda backend "
                                                   "unavailable (nvcc failed building"), lines


def test_cpu_auto_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="kernels.attention"):
        select_decode_backend("auto", spec(device="cpu", cache=torch.float32))
    assert [r.getMessage() for r in caplog.records] == [
        "attention backend: torch (auto: cpu device, the torch reference; eager only)"]


@pytest.mark.parametrize("requested,kw,message", [
    ("cuda", dict(device="cpu"), "--attention-backend cuda: needs a CUDA GPU (the engine runs on cpu)"),
    ("triton", dict(device="cpu"), "--attention-backend triton: needs a CUDA GPU (the engine runs on cpu)"),
    ("flashinfer", dict(device="cpu"), "--attention-backend flashinfer: needs a CUDA GPU (the engine runs on cpu)"),
    ("cuda", dict(capability=(8, 9)), "--attention-backend cuda: needs a SM9x GPU; this one is SM89"),
    ("cuda", dict(cache=torch.float16),
     "--attention-backend cuda: needs a KV cache in fp8 e4m3, bfloat16; got float16"),
    ("cuda", dict(cache=torch.bfloat16, heads=128),
     "--attention-backend cuda: a bf16 cache takes at most 32 query rows per request (heads x query tokens); got 128"),
    ("cuda", dict(page=32), "--attention-backend cuda: needs a --block-size that is a multiple of 64; got 32"),
    ("cuda", dict(library_builds=False), "--attention-backend cuda: nvcc failed building mla_decode_wgmma_sm90a.cu:"),
    ("trtllm", dict(), "--attention-backend trtllm: needs a SM10x GPU; this one is SM90"),
    ("triton", dict(cache=torch.float32),
     "--attention-backend triton: needs a KV cache in bfloat16, float16, fp8 e4m3; got float32"),
    ("triton", dict(cache=torch.bfloat16, rank=96),
     "--attention-backend triton: needs a power-of-two kv_lora_rank; the model has 96"),
    ("cuda-magic", dict(device="cpu"), "--attention-backend: unknown backend 'cuda-magic'; one of auto, cuda, "
                                       "triton, flashinfer, trtllm, torch"),
])
def test_explicit_requests_that_cannot_run_are_one_line_errors(gpu, requested, kw, message):
    kw = dict(kw)
    capability, builds = kw.pop("capability", (9, 0)), kw.pop("library_builds", True)
    if kw.get("device") != "cpu":
        gpu(capability, builds)
    with pytest.raises(BackendUnavailable) as err:
        select_decode_backend(requested, spec(**kw))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_flashinfer_not_installed_is_a_clear_error(gpu, monkeypatch):
    gpu((9, 0))
    real_find_spec = attention.base.importlib.util.find_spec
    monkeypatch.setattr(attention.base.importlib.util, "find_spec",
                        lambda name, *a: None if name == "flashinfer" else real_find_spec(name, *a))
    with pytest.raises(BackendUnavailable, match="^--attention-backend flashinfer: needs the flashinfer-python "
                                                 "package, which is not installed$"):
        select_decode_backend("flashinfer", spec(cache=torch.bfloat16))


def test_explicit_request_logs_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="kernels.attention"):
        select_decode_backend("torch", spec(device="cpu"))
    assert [r.getMessage() for r in caplog.records] == ["attention backend: torch (requested; eager only)"]


def test_prefill_is_chosen_apart_from_decode():
    assert select_prefill_backend("auto", spec(device="cpu")).name == "torch"
    assert select_prefill_backend("auto", spec(device="cuda")).name == "sdpa"
    with pytest.raises(BackendUnavailable, match="^--prefill-attention-backend: unknown backend 'triton'; one of auto, "
                                                 "flashinfer, sdpa, torch$"):
        select_prefill_backend("triton", spec())  # a decode-only backend is never asked to prefill
    with pytest.raises(BackendUnavailable, match="^--prefill-attention-backend sdpa: needs a CUDA GPU"):
        select_prefill_backend("sdpa", spec(device="cpu"))
    assert not any(issubclass(cls, PrefillBackend) for cls in DECODE_BACKENDS.values())
    assert not any(issubclass(cls, DecodeBackend) for cls in PREFILL_BACKENDS.values())


def test_sdpa_warm_up_runs_every_bucket_length_on_slices_laid_out_as_a_step(monkeypatch):
    from kernels import mla_prefill
    from kernels.attention import prefill as prefill_module

    assert mla_prefill.sdpa_warmup_lengths(8192, torch.device("cuda")) == list(range(256, 8193, 256))
    assert mla_prefill.sdpa_warmup_lengths(300, torch.device("cuda"), length_bucket=128) == [128, 256, 384]
    assert mla_prefill.sdpa_warmup_lengths(8192, torch.device("cpu")) == []  # nothing is planned per length there
    assert prefill_module.SdpaPrefill(spec(device="cpu")).warm_up(8192) == 0
    assert prefill_module.SdpaPrefill().warm_up(8192) == 0  # no spec: heads and widths unknown

    # On a GPU the same loop runs the bucket lengths; here the CPU runs it on small ones.
    monkeypatch.setattr(prefill_module, "sdpa_warmup_lengths", lambda n, device: [8, 16, 24])
    calls = []
    real_forward = prefill_module.SdpaPrefill.forward

    def recording_forward(self, q, k, v, scale):
        calls.append((q.shape, k.shape, v.shape, q.dtype, scale, q.untyped_storage().data_ptr()))
        return real_forward(self, q, k, v, scale)

    monkeypatch.setattr(prefill_module.SdpaPrefill, "forward", recording_forward)
    s = AttentionSpec(torch.device("cpu"), FP8, 3, 512, 64, 64, 0.125, torch.bfloat16, qk_head_dim=24, v_head_dim=16)
    assert prefill_module.SdpaPrefill(s).warm_up(20) == 3
    assert [c[:5] for c in calls] == [((n, 3, 24), (n, 3, 24), (n, 3, 24), torch.bfloat16, 0.125) for n in (8, 16, 24)]
    assert len({c[5] for c in calls}) == 1  # slices of one buffer, as a step's chunks are


def test_torch_prefill_backend_is_the_reference():
    from kernels.mla_prefill import mla_prefill_reference

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 4, generator=g)
    out = select_prefill_backend("torch", spec(device="cpu")).forward(q, k, v, 0.3)
    assert torch.equal(out, mla_prefill_reference(q, k, v, 0.3))


def test_query_dtype_follows_the_backend_and_the_cache():
    torch_backend, triton_backend = DECODE_BACKENDS["torch"](), DECODE_BACKENDS["triton"]()
    assert torch_backend.query_dtype(FP8, torch.bfloat16) == torch.bfloat16  # the reference dequantizes the cache
    assert triton_backend.query_dtype(FP8, torch.bfloat16) == FP8
    assert triton_backend.query_dtype(torch.bfloat16, torch.bfloat16) == torch.bfloat16
