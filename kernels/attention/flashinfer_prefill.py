"""FlashInfer's ragged prefill (SM90 fa3) as a prefill backend (optional: flashinfer-python).

Every prefill chunk of a step in one kernel launch per layer: q ragged by ``qo_indptr``, the
up-projected keys/values ragged by ``kv_indptr`` ([cached prefix ‖ chunk] per chunk, laid out
by the MLA layer), causal aligned to the bottom right (query i of a chunk sees keys
0 .. kv_len - q_len + i), which is FlashInfer's causal mask whenever kv_len > q_len. FA3's
Hopper kernels take q/k 192 wide and v 128 (DeepSeek's non-absorbed MLA heads) or equal widths
of 64/128/256, in bf16 or fp16.

``plan`` runs once per step on the host lengths (no device sync: the indptrs are built on the
host), every layer's ``forward_varlen`` runs on that plan. The float workspace is the one the
FlashInfer decode backend uses (``shared_workspace``). Not CUDA-graph safe; prefill never runs
in a graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention.base import (FP8_E4M3, LATENT_16_BIT, AttentionSpec, BackendSupport, PrefillBackend,
                                    PrefillMetadata, missing_module_reason)
from kernels.attention.flashinfer_decode import import_flashinfer, shared_workspace

# (q/k, v) head widths FA3's prefill kernels are built for.
FA3_HEAD_DIMS = ((192, 128), (64, 64), (128, 128), (256, 256))


@dataclass
class FlashInferPrefillMetadata(PrefillMetadata):
    plan_id: int = 0  # which plan of the wrapper this step's layers run on


class FlashInferPrefill(PrefillBackend):
    """Plan once per step, one ragged fa3 launch per layer."""

    name = "flashinfer"
    support = BackendSupport(devices=("cuda",), cache_dtypes=(torch.float32, *LATENT_16_BIT, FP8_E4M3),
                             capability_majors=(9,))
    head_dims = FA3_HEAD_DIMS

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        reason = super().unsupported_reason(spec) or missing_module_reason("flashinfer", "flashinfer-python")
        if reason:
            return reason
        if spec.compute_dtype not in LATENT_16_BIT:
            return f"needs a bf16 or fp16 model (--dtype); got {spec.compute_dtype}"
        if (spec.qk_head_dim, spec.v_head_dim) not in cls.head_dims:
            return f"needs q/k, v head widths in {cls.head_dims}; the model has ({spec.qk_head_dim}, {spec.v_head_dim})"
        return None

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self._fi = import_flashinfer()
        self.workspace = shared_workspace(spec.device)
        self.wrapper = self._fi.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend="fa3")
        self._plan_id = 0

    def plan(self, metadata: PrefillMetadata) -> FlashInferPrefillMetadata:
        spec = self.spec
        # Host int32 indptrs: FlashInfer reads them on the host to split the work.
        qo = torch.tensor(metadata.qo_indptr_cpu, dtype=torch.int32)
        kv = torch.tensor(metadata.kv_indptr_cpu, dtype=torch.int32)
        self.wrapper.plan(qo, kv, num_qo_heads=spec.num_heads, num_kv_heads=spec.num_heads,
                          head_dim_qk=spec.qk_head_dim, head_dim_vo=spec.v_head_dim, causal=True,
                          sm_scale=spec.softmax_scale, q_data_type=spec.compute_dtype,
                          kv_data_type=spec.compute_dtype, o_data_type=spec.compute_dtype)
        self._plan_id += 1
        fields = {name: getattr(metadata, name) for name in PrefillMetadata.__dataclass_fields__}
        return FlashInferPrefillMetadata(**fields, plan_id=self._plan_id)

    def forward(self, q, k, v, softmax_scale):
        raise RuntimeError("the flashinfer prefill backend runs whole steps (forward_varlen) only")

    def forward_varlen(self, q, k, v, metadata, softmax_scale):
        if getattr(metadata, "plan_id", None) != self._plan_id:
            raise RuntimeError("FlashInfer prefill metadata from an earlier step: plan() once per step")
        spec = self.spec
        want = (metadata.qo_indptr_cpu[-1], metadata.kv_indptr_cpu[-1], spec.num_heads)
        if (q.shape[0], k.shape[0], q.shape[1]) != want or v.shape[0] != k.shape[0]:
            raise ValueError(f"planned for {want[0]} query rows, {want[1]} key rows, {want[2]} heads; got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        if softmax_scale != spec.softmax_scale:
            raise ValueError(f"planned for softmax scale {spec.softmax_scale}, got {softmax_scale}")
        return self.wrapper.run(q, k, v.contiguous())  # v is a slice of kv_b_proj's output
