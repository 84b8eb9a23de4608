"""Host cost of one decode step through the real engine, with the model's forward taken out.

A decode step on the GPU is one CUDA-graph replay; everything around it runs on the host:
scheduling, the step plan and attention metadata, the eager launches around the graph (input
copies, the logits GEMM, sampling), the readback, and output processing (stop checks,
detokenization, the deltas). With ``--async-scheduling`` that work overlaps the previous step's
GPU time only while it is shorter. This runs ``EngineCore`` (on the CPU, or ``--device cuda``
for real launches) with a preset's shape (default ``tiny-v2``), the decoder forward replaced by
a fixed hidden-state buffer (what a graph replay returns), and times each phase of ``--steps``
steady decode steps at ``--batch`` sequences (exclusive time per phase, so the phases sum to
the step; medians over the steps).

    python3 -m benchmarks.bench_decode_host [--batch 96] [--input-len 1024] [--steps 50]
        [--no-async-scheduling] [--temperature 1.0] [--top-p 0.95] [--cprofile 25] [--count-ops]
        [--device cuda --model deepseek-v2-lite --num-layers 1]

``--count-ops`` also counts the host->device uploads and the tensor ops per step that launch
work on a GPU (a kernel or a copy each; views and ``torch.from_numpy`` staging left out).
Prints a table (µs per step); JSON to ``$OUT/decode_host.json`` when ``$OUT`` is set. Nothing
is asserted on time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import tempfile
import time
from collections import Counter

import torch

# (object attribute path, phase): what each engine phase is; the decoder forward is stubbed.
PHASES = (
    ("engine.scheduler.schedule", "schedule"),
    ("engine.runner.plan", "plan"),
    ("runner_module.attention_arrays", "metadata"),
    ("runner_module.build_attention_metadata", "metadata"),
    ("runner_module.upload_arrays", "upload"),
    ("engine.runner._input_ids", "upload"),
    ("engine.runner._forward_decode", "forward (stub)"),
    ("engine.runner.model.compute_logits", "logits"),
    ("engine.runner._sampling_rows", "sampling rows"),
    ("engine.runner.sampler.sample_tokens", "sample"),
    ("engine.runner.collect", "collect"),
    ("engine.scheduler.update_after_step", "update"),
    ("detok_class.add_tokens", "detokenize"),
    ("engine._process", "process"),
    ("acc_class.apply", "outputs"),
)


class PhaseTimer:
    """Exclusive wall time per phase: a nested phase's time is not also charged to its caller."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.totals: Counter = Counter()
        self.calls: Counter = Counter()
        self._stack: list[float] = []  # time already charged to children, per open phase
        self.enabled = False

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            self._stack.append(0.0)
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = self.clock() - t0
                child = self._stack.pop()
                self.totals[name] += dt - child
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1] += dt

        return timed


    def overhead_s(self, calls: int = 20000) -> float:
        """Seconds one timed call adds (measured on a no-op); charged to ``other`` otherwise."""
        probe = PhaseTimer(self.clock)
        probe.enabled = True
        noop = probe.wrap("noop", lambda: None)
        outer = probe.wrap("outer", lambda: [noop() for _ in range(calls)])
        t0 = self.clock()
        outer()
        total = self.clock() - t0
        base0 = self.clock()
        for _ in range(calls):
            pass
        base = self.clock() - base0
        return max(0.0, (total - base) / calls)


def _resolve(roots: dict, path: str):
    head, *rest = path.split(".")
    obj = roots[head]
    for part in rest[:-1]:
        obj = getattr(obj, part)
    return obj, rest[-1]


def instrument(roots: dict, timer: PhaseTimer) -> None:
    """Wrap every phase's function that exists (older engines lack some)."""
    for path, name in PHASES:
        obj, attr = _resolve(roots, path)
        if hasattr(obj, attr):
            setattr(obj, attr, timer.wrap(name, getattr(obj, attr)))


UPLOADERS = ("to_device", "upload_arrays")  # each call: one host->device copy on a GPU
UPLOADING_MODULES = ("server.runner", "server.sampler", "model.forward_context")


def count_uploads(counter: Counter) -> None:
    """Count the host->device uploads (``to_device`` / ``upload_arrays`` calls) per step."""
    import importlib

    for mod_name in UPLOADING_MODULES:
        mod = importlib.import_module(mod_name)
        for name in UPLOADERS:
            fn = getattr(mod, name, None)
            if fn is not None:
                def counted(*args, _fn=fn, **kwargs):
                    counter["uploads"] += 1
                    return _fn(*args, **kwargs)
                setattr(mod, name, counted)


def stub_forward(runner, hidden_size: int, dtype: torch.dtype) -> None:
    """Replace the decoder forward by a fixed random hidden-state buffer (no model compute)."""
    buf = torch.randn(8192, hidden_size, generator=torch.Generator().manual_seed(0)).to(runner.device, dtype)

    def forward(input_ids, positions, ctx):
        return buf[: input_ids.shape[0]]

    runner._forward_decode = forward
    runner._forward_mixed = forward


# Ops that only make a new view or wrap host memory: no kernel or copy on a GPU.
VIEW_OPS = frozenset({"view", "slice", "alias", "detach", "detach_", "lift_fresh", "as_strided", "unsqueeze",
                      "squeeze", "expand", "t", "transpose", "_unsafe_view", "select", "unbind", "split", "reshape",
                      "permute", "_reshape_alias", "narrow"})


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops dispatched that launch work on a GPU (a kernel or a copy each)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if name not in VIEW_OPS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _preset_dir(model: str, num_layers: int | None, max_len: int, vocab: int | None):
    """A preset checkpoint directory whose max_position_embeddings covers ``max_len``
    (``vocab``: another vocabulary size; a small one keeps the CPU's sampling compute small)."""
    from model.checkpoint import load_config_dict
    from server.bench.throughput import materialize_model

    cfg = load_config_dict(model)
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), max_len)
    if vocab is not None:
        cfg["vocab_size"] = vocab
    with tempfile.TemporaryDirectory(prefix="mlaserve-host-") as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        with materialize_model(path, num_layers) as model_dir:
            yield model_dir


def run(model: str = "tiny-v2", batch: int = 96, input_len: int = 1024, steps: int = 50, warmup: int = 8,
        async_scheduling: bool = True, temperature: float = 1.0, top_p: float = 0.95, top_k: int = 0,
        num_layers: int | None = None, cprofile: int = 0, count_ops: bool = False, vocab: int | None = None,
        cpu_clock: bool = True, device: str = "cpu") -> dict:
    import server.runner as runner_module
    from server import LLM, SamplingParams
    from server.outputs import OutputAccumulator
    from server.tokenizer import IncrementalDetokenizer

    output_len = warmup + steps + 64  # no request ends before the op count (admissions are spread)
    max_len = input_len + output_len + 64
    with _preset_dir(model, num_layers, max_len, vocab) as model_dir:
        kv = {"kv_cache_memory_bytes": 1 << 31} if device == "cpu" else {}
        llm = LLM(model_dir, device=device, load_format="dummy", max_model_len=max_len, max_num_seqs=batch,
                  async_scheduling=async_scheduling, **kv)
    engine = llm.engine
    stub_forward(engine.runner, engine.model_config.hidden_size, engine.model.dtype)
    clock = time.thread_time if cpu_clock else time.perf_counter
    timer = PhaseTimer(clock)
    instrument({"engine": engine, "runner_module": runner_module, "detok_class": IncrementalDetokenizer,
                "acc_class": OutputAccumulator}, timer)
    g = torch.Generator().manual_seed(0)
    vocab = min(engine.vocab_size, engine.tokenizer.vocab_size)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=temperature, top_p=top_p,
                            top_k=top_k)
    accs = {}
    for i in range(batch):
        prompt = torch.randint(2, vocab, (input_len,), generator=g).tolist()
        engine.add_request(str(i), prompt, params)
        accs[str(i)] = OutputAccumulator(str(i), None, prompt, 1, False, time.monotonic())

    def step() -> None:
        for delta in engine.step():
            accs[delta.request_id].apply(delta, time.monotonic())

    while engine.scheduler.num_waiting or any(s.num_output_tokens < 2 for s in engine.scheduler.running.values()):
        step()  # prefill (stubbed), then the first decodes
    for _ in range(warmup):
        step()
    profiler = cProfile.Profile() if cprofile else None
    timer.enabled = True
    walls, per_step, calls = [], [], []
    if profiler is not None:
        profiler.enable()
    for _ in range(steps):
        before, before_calls = dict(timer.totals), sum(timer.calls.values())
        t0 = clock()
        step()
        wall = clock() - t0
        walls.append(wall)
        spent = {name: timer.totals[name] - before.get(name, 0.0) for _, name in PHASES}
        spent["other"] = wall - sum(spent.values())
        per_step.append(spent)
        calls.append(sum(timer.calls.values()) - before_calls)
    if profiler is not None:
        profiler.disable()
    timer.enabled = False
    ops = uploads = None
    if count_ops:
        counter, calls_seen = OpCounter(), Counter()
        count_uploads(calls_seen)
        with counter:
            for _ in range(5):
                step()
        ops = {k: v / 5 for k, v in counter.ops.most_common()}
        uploads = calls_seen["uploads"] / 5
    # Medians per phase: the host is shared, and a median ignores the steps another process stalled.
    overhead = timer.overhead_s()
    for spent, n in zip(per_step, calls):  # what the timer itself cost is not the engine's
        spent["other"] -= n * overhead
    phases = {name: 1e6 * statistics.median(s[name] for s in per_step) for name in dict.fromkeys(per_step[0])}
    host = [w - s["forward (stub)"] - n * overhead for w, s, n in zip(walls, per_step, calls)]
    result = {"device": device, "batch": batch, "input_len": input_len, "steps": steps,
              "async_scheduling": async_scheduling, "temperature": temperature, "top_p": top_p, "top_k": top_k,
              "model": model, "vocab": engine.vocab_size, "clock": "cpu" if cpu_clock else "wall",
              "step_us_mean": 1e6 * statistics.mean(walls), "host_us_per_step": 1e6 * statistics.median(host),
              "phases_us": phases, "ops_per_step": ops, "uploads_per_step": uploads,
              "timer_us_per_call": 1e6 * overhead, "timed_calls_per_step": statistics.median(calls)}
    print(f"decode host cost: batch {batch}, context {input_len}, async {'on' if async_scheduling else 'off'}, "
          f"T={temperature} top_p={top_p} top_k={top_k}, {steps} steps ({device}, forward stubbed, "
          f"{'thread CPU time' if cpu_clock else 'wall time'})")
    print(f"{'phase':<16}{'us/step':>10}{'us/seq':>9}")
    for name, us in phases.items():
        print(f"{name:<16}{us:>10.0f}{us / batch:>9.2f}")
    print(f"{'host total':<16}{result['host_us_per_step']:>10.0f}{result['host_us_per_step'] / batch:>9.2f}"
          f"   (medians; timer overhead {result['timer_us_per_call']:.2f} us x "
          f"{result['timed_calls_per_step']:.0f} calls/step taken out)")
    if ops is not None:
        print(f"host->device uploads per step: {uploads:g}; device ops per step: {sum(ops.values()):.0f} (" +
              ", ".join(f"{k} {v:g}" for k, v in list(ops.items())[:12]) + ")")
    if profiler is not None:
        s = io.StringIO()
        pstats.Stats(profiler, stream=s).sort_stats("tottime").print_stats(cprofile)
        print(s.getvalue())
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-v2")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=None, help="override the preset's vocab_size (>= 262)")
    ap.add_argument("--cprofile", type=int, default=0, help="print the N functions with the most own time")
    ap.add_argument("--device", default="cpu", help="cuda: real launches (the GPU then waits for the host)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default=None,
                    help="cpu: this thread's CPU time (steady on a shared host; the default on the CPU); "
                         "wall: perf_counter (the default on CUDA, where waiting for the GPU may spin)")
    ap.add_argument("--count-ops", action="store_true", help="count tensor ops per step")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    clock = a.clock or ("cpu" if a.device == "cpu" else "wall")
    res = run(a.model, a.batch, a.input_len, a.steps, a.warmup, a.async_scheduling, a.temperature, a.top_p,
              a.top_k, a.num_layers, a.cprofile, a.count_ops, a.vocab, clock == "cpu", a.device)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "decode_host.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
