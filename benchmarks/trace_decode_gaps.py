"""Why the GPU sits idle in a decode phase: the host's share that async scheduling does not hide,
and what the host was doing meanwhile. Runs ``--batch`` requests of ``--input-len`` random tokens
to ``--output-len`` tokens on a preset's shape (random weights), profiles the decode steps after
the prompts are in (torch.profiler; the engine's phases annotated at run time, no engine change),
and reports from the timelines:

- the span, GPU busy time (union of kernel/copy intervals), idle share and gaps per step;
- the largest gaps: the kernel before and after, the host call that launched the next one (its
  engine phase > aten op > CUDA call) and what the host did during the gap;
- over all gaps: host time by engine phase and by innermost host event (a Python phase's own
  time, an aten op, cudaLaunchKernel, cudaStreamSynchronize ...), top ``--top``, and the
  (kernel before -> kernel after) pairs that hold the most idle time;
- per step: cudaGraphLaunch, kernel launches, copies, host syncs (by call and phase), host time
  by engine phase, and GPU time by kernel.

    python3 -m benchmarks.trace_decode_gaps --model deepseek-v2-lite --kv-cache-dtype fp8 \\
        --batch 96 --input-len 1024 --output-len 64 [--no-async-scheduling] [--python-stacks] [--trace PATH]

Writes ONE small JSON (``$OUT/decode_gaps.json``); the Chrome trace only with ``--trace``.
``--device cpu`` runs the same on the CPU (no kernels there: host events and counts only), as
a smoke check. Nothing is asserted on time; the numbers go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import os
import tempfile
from collections import Counter, defaultdict

import torch

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("user_annotation", "cpu_op", "python_function", "cuda_runtime", "cuda_driver")
STEP = "mlaserve.step"
PHASE_PREFIX = "mlaserve."
# Host calls that wait for the device.
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cudaMemcpy2D", "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize"})
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                          "cudaLaunchCooperativeKernel"})
COPY_CALLS = frozenset({"cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemcpy", "cudaMemset"})
# Engine methods annotated while profiling (object path from the engine, phase name).
ENGINE_PHASES = (
    ("scheduler.schedule", "schedule"),
    ("runner.launch", "launch"),
    ("runner.execute", "execute"),
    ("runner.plan", "plan"),
    ("runner.run_plan", "inputs"),  # its own time: attention arrays, the upload, the forward context
    ("runner._forward_decode", "forward"),
    ("runner._forward_mixed", "forward"),
    ("runner.model.compute_logits", "logits"),
    ("runner.sampler.sample_tokens", "sample"),
    ("runner.collect", "collect"),
    ("_process", "process"),
)


def _short(name: str, width: int = 72) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


# ---- the analysis (pure: a list of Chrome-trace events in, a small dict out) ---------------------

def kernel_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """(start µs, end µs) of every GPU kernel and memcpy/memset, sorted."""
    return sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                  if e.get("ph") == "X" and e.get("cat") in GPU_CATS)


def idle_report(spans: list[tuple[float, float]], top: int = 5) -> dict:
    """Span, busy time (union of intervals), idle share and the ``top`` largest gaps, in µs."""
    if not spans:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_share": 0.0, "largest_gaps_us": [], "num_gaps_over_20us": 0}
    busy, gaps = 0.0, []
    start, end = spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    span = max(e for _, e in spans) - spans[0][0]
    return {"span_us": span, "busy_us": busy, "idle_share": 1 - busy / span if span else 0.0,
            "largest_gaps_us": sorted(gaps, reverse=True)[:top], "num_gaps_over_20us": sum(g > 20 for g in gaps)}


def _gaps(gpu: list[dict], min_us: float) -> list[tuple[float, float, dict, dict]]:
    """(start, end, kernel before, kernel after) of every idle stretch longer than ``min_us``."""
    gaps = []
    last = None  # the event whose end is the busy segment's end
    for e in gpu:
        if last is not None and e["ts"] > last["ts"] + last.get("dur", 0):
            start = last["ts"] + last.get("dur", 0)
            if e["ts"] - start > min_us:
                gaps.append((start, e["ts"], last, e))
        if last is None or e["ts"] + e.get("dur", 0) > last["ts"] + last.get("dur", 0):
            last = e
    return gaps


def host_segments(events: list[dict]) -> list[tuple[float, float, tuple[str, ...]]]:
    """The host thread's time as non-overlapping (start, end, stack of event names) segments,
    innermost last; time inside no event is left out. A child is clamped to its parent."""
    evs = sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0)))
    segs: list[tuple[float, float, tuple[str, ...]]] = []
    stack: list[tuple[float, str]] = []  # (end, name)
    cursor = evs[0]["ts"] if evs else 0.0

    def emit(until: float) -> None:
        nonlocal cursor
        if stack and until > cursor:
            segs.append((cursor, until, tuple(n for _, n in stack)))
        cursor = max(cursor, until)

    for e in evs:
        start, end = e["ts"], e["ts"] + e.get("dur", 0)
        while stack and stack[-1][0] <= start:
            emit(stack[-1][0])
            stack.pop()
        emit(start)
        if stack:
            end = min(end, stack[-1][0])
        stack.append((end, e["name"]))
    while stack:
        emit(stack[-1][0])
        stack.pop()
    return segs


def overlay(under: list, over: list) -> list[tuple[float, float, tuple[str, ...]]]:
    """Two segmentations of one timeline as one: each stretch's stack is ``under``'s then
    ``over``'s. The engine's phase annotations and the op / Python-call events nest among
    themselves but not always with each other (an annotation opens inside
    ``record_function.__enter__``), so each is segmented alone and then overlaid."""
    cuts = sorted({t for s, e, _ in under for t in (s, e)} | {t for s, e, _ in over for t in (s, e)})
    out = []
    i = j = 0
    for a, b in zip(cuts, cuts[1:]):
        while i < len(under) and under[i][1] <= a:
            i += 1
        while j < len(over) and over[j][1] <= a:
            j += 1
        stack = (under[i][2] if i < len(under) and under[i][0] <= a else ()) + \
                (over[j][2] if j < len(over) and over[j][0] <= a else ())
        if stack:
            out.append((a, b, stack))
    return out


def _phase(stack: tuple[str, ...]) -> str:
    for name in reversed(stack):
        if name.startswith(PHASE_PREFIX) and name != STEP:
            return name[len(PHASE_PREFIX):]
    return "(engine loop)" if STEP in stack else "(outside steps)"


def _chain(stack: tuple[str, ...]) -> str:
    """engine phase > outermost op > innermost call."""
    ops = [n for n in stack if not n.startswith(PHASE_PREFIX)]
    parts = [_phase(stack)] + ([ops[0]] if ops else []) + ([ops[-1]] if len(ops) > 1 else [])
    return " > ".join(_short(p, 40) for p in parts)


def _overlaps(segs, starts, lo: float, hi: float):
    """(segment, overlap µs) of the segments that overlap [lo, hi)."""
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(segs) and segs[i][0] < hi:
        s, e, stack = segs[i]
        ov = min(e, hi) - max(s, lo)
        if ov > 0:
            yield stack, ov
        i += 1


def _main_thread(events: list[dict]):
    steps = Counter(e.get("tid") for e in events if e.get("name") == STEP)
    if steps:
        return steps.most_common(1)[0][0]
    ops = Counter(e.get("tid") for e in events if e.get("cat") == "cpu_op")
    return ops.most_common(1)[0][0] if ops else None


def analyze_trace(events: list[dict], top: int = 15, num_largest: int = 8, min_gap_us: float = 20.0,
                  window: tuple[float, float] | None = None) -> dict:
    """Everything the report prints, from Chrome-trace events. ``window`` (µs): only the GPU
    events starting and the host events overlapping it; default: the whole trace."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    if window is not None:
        lo, hi = window
        xs = [e for e in xs if e["ts"] < hi and e["ts"] + e.get("dur", 0) > lo
              and (e.get("cat") not in GPU_CATS or e["ts"] >= lo)]
    gpu = sorted((e for e in xs if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    tid = _main_thread(xs)
    host = [e for e in xs if e.get("cat") in HOST_CATS and e.get("tid") == tid]
    runtime = [e for e in xs if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    steps = sum(1 for e in host if e["name"] == STEP) or 1
    segs = overlay(host_segments([e for e in host if e["cat"] == "user_annotation"]),
                   host_segments([e for e in host if e["cat"] != "user_annotation"]))
    starts = [s for s, _, _ in segs]

    rep = idle_report([(e["ts"], e["ts"] + e.get("dur", 0)) for e in gpu], top=num_largest)
    rep["steps"] = steps
    rep["idle_us_per_step"] = (rep["span_us"] - rep["busy_us"]) / steps
    gaps = _gaps(gpu, min_gap_us)
    rep["gaps_over_min_per_step"] = len(gaps) / steps
    rep["min_gap_us"] = min_gap_us

    by_corr = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}

    def launcher(kernel: dict) -> str:
        call = by_corr.get(kernel.get("args", {}).get("correlation"))
        if call is None:
            return "?"
        stack = next((st for st, _ in _overlaps(segs, starts, call["ts"], call["ts"] + max(call.get("dur", 0), 1e-3))),
                     (call["name"],))
        return _chain(stack)

    by_phase, by_event, pairs = Counter(), Counter(), defaultdict(lambda: [0.0, 0])
    largest = []
    for start, end, before, after in gaps:
        pair = f"{_short(before['name'], 50)} -> {_short(after['name'], 50)}"
        pairs[pair][0] += end - start
        pairs[pair][1] += 1
        here = Counter()
        for stack, ov in _overlaps(segs, starts, start, end):
            by_phase[_phase(stack)] += ov
            by_event[_short(stack[-1])] += ov
            here[_short(stack[-1], 50)] += ov
        largest.append((end - start, before, after, here))
    largest.sort(key=lambda g: -g[0])
    rep["largest_gaps"] = [
        {"us": round(us, 1), "before": _short(b["name"]), "after": _short(a["name"]), "launched_by": launcher(a),
         "host": [[n, round(v, 1)] for n, v in here.most_common(5)]}
        for us, b, a, here in largest[:num_largest]]
    rep["gap_host_us_by_phase"] = [[n, round(v, 1)] for n, v in by_phase.most_common(top)]
    rep["gap_host_us_by_event"] = [[n, round(v, 1)] for n, v in by_event.most_common(top)]
    rep["gap_kernel_pairs"] = [[p, round(v[0], 1), v[1]] for p, v in
                               sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]]

    calls = Counter(e["name"] for e in runtime)
    rep["per_step"] = {
        "cudaGraphLaunch": calls["cudaGraphLaunch"] / steps,
        "kernel_launches": sum(calls[n] for n in LAUNCH_CALLS) / steps,
        "copies": sum(calls[n] for n in COPY_CALLS) / steps,
        "host_syncs": sum(calls[n] for n in SYNC_CALLS) / steps,
        "gpu_kernels": sum(1 for e in gpu if e.get("cat") == "kernel") / steps,
        "host_ops": sum(1 for e in host if e.get("cat") == "cpu_op") / steps,
    }
    syncs = Counter()
    for e in runtime:
        if e["name"] in SYNC_CALLS:
            stack = next((st for st, _ in _overlaps(segs, starts, e["ts"], e["ts"] + max(e.get("dur", 0), 1e-3))), ())
            syncs[f"{e['name']} in {_phase(stack)}"] += 1
    rep["syncs_per_step"] = {k: v / steps for k, v in syncs.most_common(top)}
    kernel_us = Counter()
    for e in gpu:
        kernel_us[_short(e["name"])] += e.get("dur", 0)
    rep["gpu_us_per_step_by_kernel"] = [[n, round(v / steps, 1)] for n, v in kernel_us.most_common(top)]
    rep["host_us_per_step_by_phase"] = _phase_totals(segs, steps, top)
    return rep


def _phase_totals(segs, steps: int, top: int) -> list[list]:
    """Host time per step by engine phase (inside a step), whether or not the GPU was busy."""
    totals = Counter()
    for s, e, stack in segs:
        if STEP in stack:
            totals[_phase(stack)] += e - s
    return [[n, round(v / steps, 1)] for n, v in totals.most_common(top)]


def decode_window(events: list[dict]) -> tuple[float, float] | None:
    """From the second step after the last step that scheduled prefill work (async: its kernels
    run during the next step too) to the end of the last step; None: no step annotations."""
    steps = sorted((e for e in events if e.get("name") == STEP and e.get("ph") == "X"), key=lambda e: e["ts"])
    if not steps:
        return None
    mixed = [e["ts"] for e in events if e.get("name") == PHASE_PREFIX + "prefill_scheduled"]
    first = 0
    if mixed:
        last = max(mixed)
        first = min(len(steps) - 1, bisect.bisect_right([s["ts"] for s in steps], last) - 1 + 2)
    return steps[first]["ts"], max(s["ts"] + s.get("dur", 0) for s in steps)


def format_report(rep: dict) -> str:
    ps = rep["per_step"]
    span, steps = rep["span_us"], rep["steps"]
    lines = [
        f"{steps} steps: span {span / 1e3:.1f} ms ({span / 1e3 / steps:.2f} ms/step), "
        f"GPU busy {rep['busy_us'] / 1e3:.1f} ms, idle {100 * rep['idle_share']:.1f} % "
        f"({rep['idle_us_per_step']:.0f} us/step), "
        f"gaps > {rep['min_gap_us']:g} us: {rep['gaps_over_min_per_step']:.1f}/step",
        f"per step: cudaGraphLaunch {ps['cudaGraphLaunch']:.2f}, kernel launches {ps['kernel_launches']:.1f}, "
        f"copies {ps['copies']:.1f}, host syncs {ps['host_syncs']:.2f}, GPU kernels {ps['gpu_kernels']:.1f}, "
        f"host aten ops {ps['host_ops']:.1f}",
        "host syncs per step: " + (", ".join(f"{k} {v:.2f}" for k, v in rep["syncs_per_step"].items()) or "none"),
        "host time per step by phase (us): " + ", ".join(f"{n} {v:g}" for n, v in rep["host_us_per_step_by_phase"]),
        "largest gaps:",
        f"  {'us':>8}  kernel before -> kernel after | launched by | host during the gap",
    ]
    for g in rep["largest_gaps"]:
        host = "; ".join(f"{n} {v:g}" for n, v in g["host"])
        lines.append(f"  {g['us']:>8.0f}  {_short(g['before'], 40)} -> {_short(g['after'], 40)} | "
                     f"{g['launched_by']} | {host}")
    for title, key in (("gap time by host phase", "gap_host_us_by_phase"),
                       ("gap time by innermost host event", "gap_host_us_by_event")):
        lines.append(f"{title} (us, all gaps):")
        lines += [f"  {v:>10.0f}  {n}" for n, v in rep[key]]
    lines.append("gap time by kernel pair (us, count):")
    lines += [f"  {v:>10.0f} {c:>6}  {p}" for p, v, c in rep["gap_kernel_pairs"]]
    lines.append("GPU time per step by kernel (us):")
    lines += [f"  {v:>10.1f}  {n}" for n, v in rep["gpu_us_per_step_by_kernel"]]
    return "\n".join(lines)


# ---- the run -------------------------------------------------------------------------------------

def annotate_engine(engine) -> None:
    """Wrap the engine's step phases in ``record_function`` (mlaserve.<phase>); the scheduler
    also marks a step that schedules prefill work (the decode window starts after it)."""
    from torch.profiler import record_function

    def wrap(name, fn):
        @functools.wraps(fn)
        def annotated(*args, **kwargs):
            with record_function(PHASE_PREFIX + name):
                return fn(*args, **kwargs)
        return annotated

    for path, name in ENGINE_PHASES:
        obj = engine
        *parents, attr = path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, attr, wrap(name, getattr(obj, attr)))
    schedule = engine.scheduler.schedule

    def marked():
        out = schedule()
        if out.scheduled and not out.is_decode_only:
            with record_function(PHASE_PREFIX + "prefill_scheduled"):
                pass
        return out

    engine.scheduler.schedule = marked


def run_profiled(llm, prompts, params, device: str, python_stacks: bool):
    """Run ``prompts`` to completion through the engine, each step annotated; the profile."""
    import time

    from torch.profiler import ProfilerActivity, profile, record_function

    from server.outputs import OutputAccumulator

    engine = llm.engine
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    accs = {}
    with profile(activities=activities, record_shapes=False, with_stack=python_stacks) as prof:
        for i, p in enumerate(prompts):
            engine.add_request(f"trace-{i}", p, params)
            accs[f"trace-{i}"] = OutputAccumulator(f"trace-{i}", None, p, 1, False, time.monotonic())
        while engine.has_unfinished():
            with record_function(STEP):
                for delta in engine.step():
                    accs[delta.request_id].apply(delta, time.monotonic())
        if device == "cuda":
            torch.cuda.synchronize()
    return prof


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke check (host events only)")
    ap.add_argument("--python-stacks", action="store_true", help="Python function events too (slows the host)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    ap.add_argument("--trace", default=None, help="also keep the Chrome trace at this path (large)")
    args = ap.parse_args()
    if args.output_len < 4:
        ap.error("--output-len: at least 4 (the first tokens are the prefill steps')")
    from server import LLM, SamplingParams
    from server.bench.throughput import materialize_model

    g = torch.Generator().manual_seed(0)
    with materialize_model(args.model, args.num_layers) as model_dir:
        llm = LLM(model_dir, device=args.device, kv_cache_dtype=args.kv_cache_dtype, load_format="dummy",
                  max_model_len=args.input_len + args.output_len + 64, async_scheduling=args.async_scheduling,
                  max_num_seqs=max(args.batch, 1))
    vocab = llm.engine.vocab_size
    prompts = [torch.randint(0, vocab, (args.input_len,), generator=g).tolist() for _ in range(args.batch)]
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    llm.generate(prompt_token_ids=[p[:64] for p in prompts], sampling_params=warm)
    # Prefill everything first (1 token each), so the profiled run is decode steps only
    # beyond its first steps: prefix caching turns the second run's prompts into hits.
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=1, ignore_eos=True))
    if args.device == "cuda":
        torch.cuda.synchronize()
    annotate_engine(llm.engine)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature,
                            top_p=args.top_p)
    prof = run_profiled(llm, prompts, params, args.device, args.python_stacks)
    path = args.trace or os.path.join(tempfile.mkdtemp(prefix="mlaserve-trace-"), "decode_trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    if not args.trace:
        os.remove(path)
    rep = analyze_trace(events, top=args.top, min_gap_us=args.min_gap_us, window=decode_window(events))
    print(f"decode of {args.batch} requests x {args.output_len} tokens ({args.kv_cache_dtype} KV, async "
          f"{'on' if args.async_scheduling else 'off'}, T={args.temperature} top_p={args.top_p}, {args.device}):")
    print(format_report(rep))
    if args.trace:
        print(f"trace: {path}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "decode_gaps.json"), "w") as f:
            json.dump({"args": vars(args), **rep}, f, indent=1)


if __name__ == "__main__":
    main()
