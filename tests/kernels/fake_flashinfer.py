"""A stand-in for FlashInfer's ragged prefill wrapper (flashinfer is a GPU extra, not installed
on CPU): it records every plan, checks each run against the plan it was given, and computes
the torch reference segment by segment from the planned indptrs (so the indptrs are checked by
the output too)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import torch

from kernels.attention import BackendSupport, FlashInferPrefill
from kernels.mla_prefill import mla_prefill_reference


class FakeRaggedPrefillWrapper:
    """Stands in for flashinfer.BatchPrefillWithRaggedKVCacheWrapper (the calls the adapter makes)."""

    created: list["FakeRaggedPrefillWrapper"] = []

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", backend: str = "auto") -> None:
        assert backend == "fa3" and kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.workspace = workspace
        self.plans: list[dict] = []
        self.runs_per_plan: list[int] = []
        FakeRaggedPrefillWrapper.created.append(self)

    def plan(self, qo_indptr, kv_indptr, *, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, causal, sm_scale,
             q_data_type, kv_data_type, o_data_type) -> None:
        for t in (qo_indptr, kv_indptr):  # host int32: planning must not read the device
            assert t.device.type == "cpu" and t.dtype == torch.int32
        self.plans.append(dict(qo_indptr=qo_indptr.tolist(), kv_indptr=kv_indptr.tolist(), num_qo_heads=num_qo_heads,
                               num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
                               causal=causal, sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type,
                               o_data_type=o_data_type))
        self.runs_per_plan.append(0)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.plans[-1]
        qo, kv, h = p["qo_indptr"], p["kv_indptr"], p["num_qo_heads"]
        assert p["causal"] and p["num_kv_heads"] == h
        assert q.shape == (qo[-1], h, p["head_dim_qk"]) and k.shape == (kv[-1], h, p["head_dim_qk"])
        assert v.shape == (kv[-1], h, p["head_dim_vo"]) and v.is_contiguous()
        assert q.dtype == p["q_data_type"] and k.dtype == v.dtype == p["kv_data_type"]
        out = q.new_empty(q.shape[0], h, v.shape[-1], dtype=p["o_data_type"])
        for i in range(len(qo) - 1):
            out[qo[i] : qo[i + 1]] = mla_prefill_reference(q[qo[i] : qo[i + 1]], k[kv[i] : kv[i + 1]],
                                                           v[kv[i] : kv[i + 1]], p["sm_scale"])
        self.runs_per_plan[-1] += 1
        return out


class _AnyHeadDims(tuple):
    def __contains__(self, dims) -> bool:
        return True


def install_fake_flashinfer(monkeypatch, module: types.ModuleType | None = None) -> types.ModuleType:
    """``import flashinfer`` finds a stand-in with the ragged prefill wrapper (added to ``module``
    when given: the decode stand-in), and the flashinfer prefill backend is allowed on CPU for
    any head widths."""
    fi = module
    if fi is None:
        fi = types.ModuleType("flashinfer")
        fi.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
        fi.mla = types.ModuleType("flashinfer.mla")
        monkeypatch.setitem(sys.modules, "flashinfer", fi)
        monkeypatch.setitem(sys.modules, "flashinfer.mla", fi.mla)
    fi.BatchPrefillWithRaggedKVCacheWrapper = FakeRaggedPrefillWrapper
    monkeypatch.setattr(FlashInferPrefill, "support", BackendSupport(devices=("cpu",), cache_dtypes=(
        torch.float32, torch.bfloat16, torch.float8_e4m3fn)))
    monkeypatch.setattr(FlashInferPrefill, "head_dims", _AnyHeadDims())
    monkeypatch.setattr(FakeRaggedPrefillWrapper, "created", [])
    return fi
