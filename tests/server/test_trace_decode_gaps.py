"""benchmarks/trace_decode_gaps.py's analysis on a synthetic Chrome trace: gaps, what the host
did during them (by engine phase and innermost event), who launched the kernel that ended
them, syncs and launches per step, and the decode window."""

from __future__ import annotations

import pytest

from benchmarks.trace_decode_gaps import analyze_trace, decode_window, format_report, host_segments, overlay


def x(name, cat, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def synthetic():
    return [
        x("mlaserve.step", "user_annotation", 0, 1000),
        x("mlaserve.process", "user_annotation", 100, 300),
        x("aten::copy_", "cpu_op", 150, 50),
        x("cudaStreamSynchronize", "cuda_runtime", 160, 35),
        x("mlaserve.launch", "user_annotation", 400, 500),
        x("aten::mm", "cpu_op", 500, 20),
        x("cudaLaunchKernel", "cuda_runtime", 505, 10, corr=2),
        x("mlaserve.forward", "user_annotation", 590, 30),
        x("cudaGraphLaunch", "cuda_runtime", 600, 10, corr=3),
        x("aten::add", "cpu_op", 700, 5, tid=2),  # another thread: ignored
        x("kernel_a", "kernel", 0, 100, tid=7, corr=1),
        x("gemm_b", "kernel", 530, 30, tid=7, corr=2),
        x("graph_c", "kernel", 620, 80, tid=7, corr=3),
        x("graph_d", "kernel", 640, 10, tid=7, corr=3),  # inside c: no gap
    ]


def test_host_segments_are_innermost_and_cover_each_event_once():
    segs = host_segments([e for e in synthetic() if e["tid"] == 1])
    assert all(a[1] <= b[0] for a, b in zip(segs, segs[1:]))
    assert sum(e - s for s, e, _ in segs) == pytest.approx(1000)
    inner = {stack[-1]: 0.0 for _, _, stack in segs}
    for s, e, stack in segs:
        inner[stack[-1]] += e - s
    assert inner["cudaStreamSynchronize"] == pytest.approx(35)
    assert inner["aten::copy_"] == pytest.approx(15)
    assert inner["mlaserve.process"] == pytest.approx(250)


def test_annotations_overlay_python_frames_they_open_inside():
    """record_function's annotation starts inside the Python frame of its ``__enter__``: the
    two nest only among themselves, and the overlay keeps both whole."""
    frames = [x("profiler.py(918): __enter__", "python_function", 0, 10), x("aten::mm", "cpu_op", 20, 10)]
    steps = [x("mlaserve.step", "user_annotation", 5, 95)]
    merged = overlay(host_segments(steps), host_segments(frames))
    assert [(s, e, st) for s, e, st in merged] == [
        (0, 5, ("profiler.py(918): __enter__",)), (5, 10, ("mlaserve.step", "profiler.py(918): __enter__")),
        (10, 20, ("mlaserve.step",)), (20, 30, ("mlaserve.step", "aten::mm")), (30, 100, ("mlaserve.step",))]
    rep = analyze_trace(frames + steps)
    assert rep["host_us_per_step_by_phase"] == [["(engine loop)", 95]]


def test_gap_attribution_launchers_and_counts():
    rep = analyze_trace(synthetic(), min_gap_us=20)
    assert rep["steps"] == 1
    assert rep["busy_us"] == pytest.approx(210) and rep["span_us"] == pytest.approx(700)
    big, small = rep["largest_gaps"]
    assert big["us"] == 430 and big["before"] == "kernel_a" and big["after"] == "gemm_b"
    assert big["launched_by"] == "launch > aten::mm > cudaLaunchKernel"
    assert dict(big["host"])["mlaserve.process"] == 250
    assert small["us"] == 60 and small["launched_by"] == "forward > cudaGraphLaunch"
    assert dict(rep["gap_host_us_by_phase"]) == {"process": 300, "launch": 160, "forward": 30}
    by_event = dict(rep["gap_host_us_by_event"])
    assert by_event["cudaStreamSynchronize"] == 35 and by_event["cudaLaunchKernel"] == 10
    assert sum(by_event.values()) == pytest.approx(490)
    assert rep["gap_kernel_pairs"][0] == ["kernel_a -> gemm_b", 430, 1]
    ps = rep["per_step"]
    assert (ps["cudaGraphLaunch"], ps["kernel_launches"], ps["host_syncs"], ps["gpu_kernels"]) == (1, 1, 1, 4)
    assert rep["syncs_per_step"] == {"cudaStreamSynchronize in process": 1}
    assert rep["gpu_us_per_step_by_kernel"][0] == ["kernel_a", 100]
    text = format_report(rep)
    assert "kernel_a -> gemm_b" in text and "cudaStreamSynchronize in process 1.00" in text
    # A larger minimum leaves the small gap out of the attribution.
    assert len(analyze_trace(synthetic(), min_gap_us=100)["largest_gaps"]) == 1


def test_decode_window_starts_two_steps_after_the_last_prefill():
    steps = [x("mlaserve.step", "user_annotation", 100 * i, 90) for i in range(6)]
    marks = [x("mlaserve.prefill_scheduled", "user_annotation", 105, 0)]  # in step 1
    assert decode_window(steps + marks) == (300, 590)
    assert decode_window(steps) == (0, 590)
    assert decode_window([]) is None
    kernels = [x("early", "kernel", 250, 10, tid=7), x("late", "kernel", 320, 10, tid=7)]
    rep = analyze_trace(steps + marks + kernels, window=decode_window(steps + marks))
    assert rep["steps"] == 3 and rep["per_step"]["gpu_kernels"] == pytest.approx(1 / 3)
