"""Opt-in per-step time breakdown of the engine: where does a benchmark's wall time go?

Enabled by ``MLASERVE_STEP_PROFILE=1`` (read when the runner is built, so it reaches an
engine subprocess too) or by setting ``StepProfiler.enabled`` (``bench throughput
--step-profile`` does that on its in-process engine). When on, every non-empty step is
timed in phases: ``plan`` (step plan, attention metadata, host->device uploads),
``forward`` (model + logits), ``sample`` (sampling, prompt logprobs, the device->host copy
of token ids) and ``sched`` (the rest of ``EngineCore.step``: scheduling, detokenization,
stop checks). On CUDA the device is synchronized at each phase boundary so GPU time lands
in the phase that queued it; this slows the run a little, which is why it is opt-in. When
off, the runner and engine skip every call here (no timing, no synchronize).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from server import envs
from server.step_roofline import Ceilings, StepCost, measure_ceilings

PHASES = ("plan", "forward", "sample", "sched")
KINDS = ("decode-graph", "decode-eager", "prefill", "mixed")


def env_enabled() -> bool:
    return envs.MLASERVE_STEP_PROFILE


def classify_step(num_decodes: int, num_seqs: int, decode_graphs, graphs_off_reason: str,
                  fits: bool | None = None) -> tuple[str, str | None]:
    """(kind, why a pure decode ran eagerly). Mirrors the runner's decode: a pure decode replays
    a graph iff ``fits`` (default ``decode_graphs.fits(batch)``; the V4 runner also checks every
    request's context against the graphs' ``max_tokens``); one token per sequence there."""
    if num_decodes and num_decodes == num_seqs:
        if fits is None:
            fits = decode_graphs is not None and decode_graphs.fits(num_seqs)
        if decode_graphs is not None and fits:
            return "decode-graph", None
        if decode_graphs is None:
            return "decode-eager", graphs_off_reason
        if num_seqs > decode_graphs.max_batch:
            return "decode-eager", f"batch > captured max {decode_graphs.max_batch}"
        if decode_graphs.graphs and getattr(decode_graphs, "max_tokens", None):
            return "decode-eager", f"a request past the graphs' {decode_graphs.max_tokens} tokens"
        return "decode-eager", "no graph captured"
    return ("mixed" if num_decodes else "prefill"), None


def graphs_off_reason(device: torch.device, config) -> str:
    """Why a runner has no decode graphs (the first rule of ``cuda_graphs.maybe_capture`` that applies)."""
    if device.type != "cuda":
        return f"graphs off ({device.type})"
    if config.enforce_eager:
        return "graphs off (enforce_eager)"
    if config.cudagraph_mode == "NONE":
        return "graphs off (cudagraph_mode NONE)"
    return "graphs off (DEP or attention backend not graph-safe)"


@dataclass(slots=True)
class StepRecord:
    kind: str = ""
    num_seqs: int = 0
    num_tokens: int = 0
    reason: str | None = None
    wall_s: float = 0.0  # runner time, plus ``sched`` once the engine step ends
    phases: dict[str, float] = field(default_factory=dict)
    cost: StepCost | None = None  # the step's least FLOPs and bytes (MLA models)
    _t: float = 0.0  # last phase boundary


@dataclass
class _KindTotals:
    steps: int = 0
    seqs: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    reasons: Counter = field(default_factory=Counter)
    cost: StepCost | None = StepCost(0.0, 0.0, 0.0, 0.0)  # summed over the steps; None: a step had none


class StepProfiler:
    def __init__(self, enabled: bool | None = None, device: torch.device | None = None,
                 max_records: int = 100_000, cost_model=None, ceilings: Ceilings | None = None) -> None:
        """``cost_model`` (``server.step_roofline.MLAStepCostModel``) prices each step's FLOPs and
        bytes; ``ceilings`` are the rates to divide them by (measured on the CUDA device at the
        first summary when not given). Without either, no roofline columns."""
        self.enabled = env_enabled() if enabled is None else enabled
        self._sync_device = device if device is not None and device.type == "cuda" else None
        self.cost_model = cost_model
        self.ceilings = ceilings
        self.records: deque[StepRecord] = deque(maxlen=max_records)  # the latest steps, for inspection
        self.reset()

    def reset(self) -> None:
        self.records.clear()
        self._kinds: dict[str, _KindTotals] = {}
        self._open: StepRecord | None = None  # runner step of the engine step in progress
        self._runner_s = 0.0
        self.engine_steps = 0
        self.engine_s = 0.0
        self.runner_s = 0.0

    def _now(self) -> float:
        if self._sync_device is not None:
            torch.cuda.synchronize(self._sync_device)
        return time.perf_counter()

    # ---- called by the runner (only when enabled) ---------------------------------------------
    def begin(self) -> StepRecord:
        rec = StepRecord()
        rec._t = self._now()
        rec.wall_s = rec._t  # start time until end_runner_step
        return rec

    def mark(self, rec: StepRecord, phase: str) -> None:
        """Close ``phase``: the time since the previous boundary."""
        t = self._now()
        rec.phases[phase] = rec.phases.get(phase, 0.0) + (t - rec._t)
        rec._t = t

    def end_runner_step(self, rec: StepRecord, last_phase: str) -> None:
        self.mark(rec, last_phase)
        rec.wall_s = rec._t - rec.wall_s
        rec.phases.setdefault("sched", 0.0)
        k = self._kinds.setdefault(rec.kind, _KindTotals())
        k.steps += 1
        k.seqs += rec.num_seqs
        k.tokens += rec.num_tokens
        k.wall_s += rec.wall_s
        for p, s in rec.phases.items():
            k.phases[p] = k.phases.get(p, 0.0) + s
        if rec.reason:
            k.reasons[rec.reason] += 1
        k.cost = None if rec.cost is None or k.cost is None else k.cost + rec.cost
        self.records.append(rec)
        self._open = rec
        self._runner_s += rec.wall_s

    def _ceilings(self) -> Ceilings | None:
        """The rates, measured once on the profiled CUDA device (None elsewhere, or when the
        measurement finds no memory left)."""
        if self.ceilings is None and self._sync_device is not None and self.cost_model is not None:
            try:
                self.ceilings = measure_ceilings(self._sync_device)
            except torch.OutOfMemoryError:
                self.cost_model = None  # no rooflines this run
                torch.cuda.empty_cache()
        return self.ceilings

    # ---- called by EngineCore.step (only when enabled) ----------------------------------------
    def end_engine_step(self, total_s: float) -> None:
        """Charge what the engine step spent outside the runner to its step (``sched``)."""
        sched = max(0.0, total_s - self._runner_s)
        self.engine_steps += 1
        self.engine_s += total_s
        self.runner_s += self._runner_s
        rec, self._open, self._runner_s = self._open, None, 0.0
        if rec is not None:
            rec.phases["sched"] += sched
            rec.wall_s += sched
            k = self._kinds[rec.kind]
            k.phases["sched"] += sched
            k.wall_s += sched

    # ---- results ------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Per kind: steps, seconds, ms/step, batch, tokens/s, phase seconds; plus the
        top-level split of engine-step time into scheduler/engine vs runner; with a cost model,
        each kind's roofline ms/step at the device's measured rates."""
        ceilings = self._ceilings()
        kinds = {}
        for name in sorted(self._kinds, key=lambda n: KINDS.index(n) if n in KINDS else len(KINDS)):
            k = self._kinds[name]
            kinds[name] = {
                "steps": k.steps, "total_s": k.wall_s, "mean_ms": 1e3 * k.wall_s / k.steps,
                "mean_batch": k.seqs / k.steps, "tokens": k.tokens,
                "tokens_per_s": k.tokens / k.wall_s if k.wall_s > 0 else 0.0,
                "phases_s": dict(k.phases), "eager_reasons": dict(k.reasons),
            }
            if k.cost is not None and ceilings is not None:
                compute, nbytes = self.cost_model.roofline_s(k.cost, ceilings)
                kinds[name]["roofline_ms"] = {"compute": 1e3 * compute / k.steps, "bytes": 1e3 * nbytes / k.steps}
        out = {"kinds": kinds, "engine_steps": self.engine_steps, "engine_s": self.engine_s,
               "runner_s": self.runner_s, "scheduler_s": max(0.0, self.engine_s - self.runner_s),
               "synchronized": self._sync_device is not None}
        if ceilings is not None:
            c = ceilings
            out["ceilings"] = {"bf16_tflops": c.bf16_flops / 1e12, "fp8_tflops": c.fp8_flops / 1e12,
                               "hbm_tbs": c.hbm_bytes / 1e12}
        return out


def format_summary(s: dict) -> str:
    """The summary as a text table (one row per step kind)."""
    head = f"{'kind':<13}{'steps':>7}{'total s':>9}{'ms/step':>9}{'batch':>7}{'tok/s':>10}" + "".join(
        f"{p + ' %':>10}" for p in PHASES)
    title = "============ Step profile" + (" (CUDA synchronized at phase boundaries)" if s["synchronized"] else "")
    lines = [title, head]
    for name, k in s["kinds"].items():
        pct = [100 * k["phases_s"].get(p, 0.0) / k["total_s"] if k["total_s"] > 0 else 0.0 for p in PHASES]
        lines.append(f"{name:<13}{k['steps']:>7}{k['total_s']:>9.2f}{k['mean_ms']:>9.2f}{k['mean_batch']:>7.1f}"
                     f"{k['tokens_per_s']:>10.0f}" + "".join(f"{v:>10.1f}" for v in pct))
        for reason, n in k["eager_reasons"].items():
            lines.append(f"  eager: {reason} ({n} steps)")
        if "roofline_ms" in k:
            r = k["roofline_ms"]
            lines.append(f"  roofline: compute {r['compute']:.2f} ms/step ({100 * r['compute'] / k['mean_ms']:.0f}% of "
                         f"the step), bytes {r['bytes']:.2f} ms/step ({100 * r['bytes'] / k['mean_ms']:.0f}%)")
    if "ceilings" in s:
        c = s["ceilings"]
        lines.append(f"ceilings (measured): bf16 GEMM {c['bf16_tflops']:.0f} TFLOP/s, FP8 GEMM {c['fp8_tflops']:.0f} "
                     f"TFLOP/s, HBM copy {c['hbm_tbs']:.2f} TB/s")
    e = s["engine_s"]
    share = (lambda x: 100 * x / e) if e > 0 else (lambda x: 0.0)
    lines.append(f"engine steps: {s['engine_steps']}, {e:.2f} s = runner {s['runner_s']:.2f} s "
                 f"({share(s['runner_s']):.1f}%) + scheduler/engine {s['scheduler_s']:.2f} s "
                 f"({share(s['scheduler_s']):.1f}%)")
    return "\n".join(lines)
