"""The engine's command-line flags, declared once for ``serve`` and ``bench throughput``.

:data:`ENGINE_FLAGS` lists every engine flag: its names (vLLM's spellings and aliases), how
argparse reads it, its help, and the :class:`~server.config.EngineConfig` field it sets.
:func:`add_engine_arguments` builds a parser's engine groups from it and
:func:`engine_config_from_namespace` turns the flags given into an EngineConfig plus the
notes to log once (flags accepted that do not apply here). A flag added to the table
appears in both sub-commands, unless it is marked ``serve_only`` (``bench throughput`` has
its own ``--seed`` that also seeds the engine, and runs on one node).

Flags not given keep EngineConfig's defaults (argparse never fills them in), so the help
shows those defaults and a config built from no flags equals ``EngineConfig()``.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any

from server.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    LINEAR_BACKENDS,
    PREFILL_ATTENTION_BACKENDS,
    EngineConfig,
)


class CLIError(ValueError):
    """A command line we cannot read; the message names the offending flag."""


def human_int(text: str) -> int:
    """``10240``, ``10k`` (10,000), ``10K`` (10,240), ``1.5m``: vLLM's readable integers."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}")
    number, suffix = m.groups()
    power = "kmgt".index(suffix.lower()) + 1 if suffix else 0
    value = float(number) * ((1000 if suffix.islower() else 1024) ** power if suffix else 1)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class MergeJSONAction(argparse.Action):
    """A JSON-object flag that may repeat (JSON form, then dotted keys): the dicts merge."""

    def __call__(self, parser, namespace, values, option_string=None):
        value = json_value(values)
        if isinstance(value, int) and not isinstance(value, bool):
            value = {"level": value}  # vLLM's ``--compilation-config 3``
        if not isinstance(value, dict):
            parser.error(f"{option_string}: expected a JSON object, got {values!r}")
        merged = dict(getattr(namespace, self.dest, None) or {})
        merged.update(value)
        setattr(namespace, self.dest, merged)


@dataclass(frozen=True)
class Flag:
    """One engine flag. ``dest`` is the EngineConfig field it sets, or, for the flags that
    :func:`engine_config_from_namespace` interprets (JSON configs), the name it is read under."""

    names: tuple[str, ...]
    dest: str
    group: str
    help: str = ""
    type: Callable[[str], Any] | None = None
    choices: tuple | None = None
    boolean: bool = False
    nargs: str | None = None
    metavar: str | None = None
    merge_json: bool = False
    serve_only: bool = False

    def argparse_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"dest": self.dest, "default": argparse.SUPPRESS, "help": self.help}
        if self.boolean:
            kw["action"] = argparse.BooleanOptionalAction
        elif self.merge_json:
            kw["action"] = MergeJSONAction
        for key in ("type", "choices", "nargs", "metavar"):
            if getattr(self, key) is not None:
                kw[key] = getattr(self, key)
        return kw


def _flag(*names: str, dest: str | None = None, **kw) -> Flag:
    return Flag(names, dest or names[0].lstrip("-").replace("-", "_"), **kw)


# Flags that EngineConfig has no field for: read and interpreted here.
_INTERPRETED = ("compilation_config", "speculative_config")

ENGINE_FLAGS: tuple[Flag, ...] = (
    # model
    _flag("--tokenizer", group="model", help="tokenizer directory (default: the model directory)"),
    _flag("--chat-template", group="model", serve_only=True,
          help="chat template (a Jinja file or the template text) instead of the checkpoint's"),
    _flag("--dtype", group="model", choices=DTYPES,
          help="compute dtype; auto: the checkpoint's on GPU (bf16 for FP8 checkpoints), float32 on CPU"),
    _flag("--load-format", group="model", choices=("auto", "dummy"),
          help="auto: load the checkpoint's weights; dummy: random weights in the checkpoint's shapes, made on "
               "the device (benchmarks)"),
    _flag("--kv-cache-dtype", group="model", choices=KV_CACHE_DTYPES),
    _flag("--device", group="model", choices=("auto", "cpu", "cuda")),
    _flag("--seed", group="model", type=int, serve_only=True),
    _flag("--max-logprobs", group="model", type=int,
          help="the most logprobs / top_logprobs / prompt_logprobs a request may ask for (default 20, as vLLM)"),
    _flag("--trust-remote-code", group="model", boolean=True,
          help="accepted for vLLM compatibility; checkpoint code is never run"),
    _flag("--speculative-config", group="model", type=json_value, metavar="JSON",
          help="accepted for vLLM compatibility; speculative decoding is not supported (MTP weights are not "
               "loaded)"),
    # scheduling
    _flag("--max-model-len", group="scheduling", type=human_int, help="e.g. 10240, 10k, 8K"),
    _flag("--max-num-seqs", group="scheduling", type=int),
    _flag("--max-num-batched-tokens", group="scheduling", type=human_int),
    _flag("--enable-chunked-prefill", group="scheduling", boolean=True),
    _flag("--block-size", group="scheduling", type=int),
    _flag("--enable-prefix-caching", group="scheduling", boolean=True),
    _flag("--async-scheduling", group="scheduling", boolean=True),
    # memory
    _flag("--gpu-memory-utilization", group="memory", type=float),
    _flag("--kv-cache-memory-bytes", group="memory", type=human_int),
    _flag("--num-gpu-blocks-override", group="memory", type=int),
    _flag("--swap-space", group="memory", type=float, help="accepted; KV is never swapped here"),
    # execution
    _flag("--enforce-eager", group="execution", boolean=True),
    _flag("--optimization-level", group="execution", type=int, choices=(0, 1, 2, 3),
          help="-O<n>, vLLM's levels: -O0 captures no CUDA graphs; -O1..-O3 capture full decode graphs (there "
               "is no torch.compile here)"),
    _flag("--compilation-config", group="execution", merge_json=True, metavar="JSON",
          help="vLLM CompilationConfig; cudagraph_mode, cudagraph_capture_sizes and max_cudagraph_capture_size "
               "apply, other keys are ignored. Dotted form: --compilation-config.cudagraph_mode FULL_DECODE_ONLY"),
    _flag("--cudagraph-capture-sizes", "--cuda-graph-sizes", dest="cudagraph_capture_sizes", group="execution",
          type=int, nargs="+", metavar="N",
          help="decode batch sizes to capture as CUDA graphs (sorted, deduplicated, those above --max-num-seqs "
               "dropped); default: 1 2 4 8, steps of 8 to 256, of 16 beyond, up to --max-cudagraph-capture-size"),
    _flag("--max-cudagraph-capture-size", group="execution", type=int,
          help="the largest decode batch captured (default: min(512, --max-num-seqs))"),
    _flag("--attention-backend", group="execution", choices=ATTENTION_BACKENDS),
    _flag("--prefill-attention-backend", group="execution", choices=PREFILL_ATTENTION_BACKENDS,
          help="the prompt-chunk attention (auto: sdpa on CUDA, torch on CPU; flashinfer: FlashInfer's ragged "
               "fa3 on Hopper, opt-in; DeepSeek-V4/V4.1: auto = triton, the sparse prefill kernel, on Hopper, "
               "torch elsewhere)"),
    _flag("--linear-backend", group="execution", choices=LINEAR_BACKENDS,
          help="DeepSeek-V4.1's FP8 linears (e4m3 with 32x32 UE8M0 blocks): auto (mxfp8 on a GPU with FP8 tensor "
               "cores, else dequantized), mxfp8 (kept as stored; activations quantized to MXFP8, the CUDA C++ GEMM "
               "on Hopper, Triton elsewhere), dequantized (multiplied out to --dtype at load)"),
    # parallelism
    _flag("--tensor-parallel-size", "-tp", group="parallelism", type=int),
    _flag("--data-parallel-size", "-dp", group="parallelism", type=int),
    _flag("--enable-expert-parallel", group="parallelism", boolean=True),
    _flag("--tp-reduction", group="parallelism", choices=("reduce_scatter", "all_reduce"),
          help="how TP sums row-parallel outputs: reduce-scatter over tokens (default) or all-reduce (for A/B "
               "comparison; same results)"),
    _flag("--nnodes", group="parallelism", type=int, serve_only=True),
    _flag("--node-rank", group="parallelism", type=int, serve_only=True),
    _flag("--master-addr", group="parallelism"),
    _flag("--master-port", group="parallelism", type=int),
)

# vLLM CompilationConfig keys we accept but do not use (no torch.compile / piecewise graphs here).
IGNORED_COMPILATION_KEYS = frozenset({
    "level", "mode", "debug_dump_path", "cache_dir", "backend", "custom_ops", "splitting_ops",
    "use_inductor", "compile_sizes", "inductor_compile_config", "inductor_passes",
    "cudagraph_num_of_warmups", "cudagraph_copy_inputs", "full_cuda_graph", "use_inductor_graph_partition",
    "pass_config", "local_cache_dir", "compile_cache_save_format", "dynamic_shapes_config",
    "cudagraph_specialize_lora", "use_cudagraph", "max_capture_size", "compile_mm_encoder",
})
# vLLM cudagraph modes -> ours. We capture full graphs for pure-decode steps only.
CUDAGRAPH_MODE_MAP = {"NONE": "NONE", "FULL_DECODE_ONLY": "FULL_DECODE_ONLY", "FULL": "FULL_DECODE_ONLY",
                      "FULL_AND_PIECEWISE": "FULL_DECODE_ONLY", "PIECEWISE": "FULL_DECODE_ONLY"}
# Flags that only matter with a CUDA device: noted once when given on CPU.
GPU_ONLY_FIELDS = (("gpu_memory_utilization", "--gpu-memory-utilization"), ("enforce_eager", "--enforce-eager"),
                   ("max_cudagraph_capture_size", "--max-cudagraph-capture-size"),
                   ("cudagraph_capture_sizes", "--cudagraph-capture-sizes"),
                   ("cudagraph_mode", "--compilation-config.cudagraph_mode"))


def _field_defaults() -> dict[str, Any]:
    return {f.name: f.default for f in fields(EngineConfig) if f.default is not MISSING}


def add_engine_arguments(parser: argparse.ArgumentParser, serve: bool) -> None:
    """Add the table's flags to ``parser`` in their help groups (``serve=False``: bench's subset)."""
    defaults = _field_defaults()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in ENGINE_FLAGS:
        if flag.serve_only and not serve:
            continue
        group = groups.get(flag.group)
        if group is None:
            group = groups[flag.group] = parser.add_argument_group(flag.group)
        kw = flag.argparse_kwargs()
        default = defaults.get(flag.dest)
        if default is not None and "default:" not in flag.help:
            kw["help"] = (flag.help + " " if flag.help else "") + f"(default: {default})"
        group.add_argument(*flag.names, **kw)


def engine_flags(serve: bool) -> list[Flag]:
    return [f for f in ENGINE_FLAGS if serve or not f.serve_only]


def _apply_compilation_config(cc: dict, kw: dict, notes: list[str]) -> None:
    unknown = sorted(set(cc) - IGNORED_COMPILATION_KEYS
                     - {"cudagraph_mode", "max_cudagraph_capture_size", "cudagraph_capture_sizes"})
    if unknown:
        raise CLIError(f"--compilation-config: unknown key(s) {', '.join(unknown)}")
    if "cudagraph_mode" in cc:
        raw = str(cc["cudagraph_mode"]).upper()
        if raw not in CUDAGRAPH_MODE_MAP:
            raise CLIError(f"--compilation-config.cudagraph_mode: must be one of "
                           f"{', '.join(CUDAGRAPH_MODE_MAP)}, got {cc['cudagraph_mode']!r}")
        kw["cudagraph_mode"] = CUDAGRAPH_MODE_MAP[raw]
        if CUDAGRAPH_MODE_MAP[raw] != raw:
            notes.append(f"--compilation-config.cudagraph_mode {raw}: mlaserve captures full CUDA graphs "
                         "for pure-decode steps only; using FULL_DECODE_ONLY")
    sizes = cc.get("cudagraph_capture_sizes")
    if sizes is not None:
        if not isinstance(sizes, list) or not sizes or not all(
                isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
            raise CLIError("--compilation-config.cudagraph_capture_sizes: expected a list of positive integers")
        if "cudagraph_capture_sizes" in kw:
            raise CLIError("--cudagraph-capture-sizes/--cuda-graph-sizes and --compilation-config."
                           "cudagraph_capture_sizes are mutually exclusive")
        kw["cudagraph_capture_sizes"] = sizes
    size = cc.get("max_cudagraph_capture_size")
    if size is not None:
        if kw.get("max_cudagraph_capture_size") not in (None, size):
            raise CLIError(f"--max-cudagraph-capture-size {kw['max_cudagraph_capture_size']} contradicts "
                           f"--compilation-config max_cudagraph_capture_size {size}")
        kw["max_cudagraph_capture_size"] = size
    ignored = sorted(set(cc) & IGNORED_COMPILATION_KEYS)
    if ignored:
        notes.append(f"--compilation-config: {', '.join(ignored)} do not apply (no torch.compile or "
                     "piecewise graphs here); ignored")


def _cuda_unavailable(device: str) -> bool:
    if device == "cpu":
        return True
    if device == "cuda":
        return False
    import torch

    return not torch.cuda.is_available()


def engine_kwargs_from_namespace(ns: argparse.Namespace, serve: bool = True) -> tuple[dict[str, Any], list[str]]:
    """The EngineConfig keyword arguments of the engine flags given in ``ns``, and the notes
    to log once. Raises CLIError naming the flag when flags contradict each other."""
    given = {f.dest: getattr(ns, f.dest) for f in engine_flags(serve) if hasattr(ns, f.dest)}
    interpreted = {k: given.pop(k) for k in _INTERPRETED if k in given}
    kw: dict[str, Any] = dict(given)
    if kw.get("cudagraph_capture_sizes") is not None:
        kw["cudagraph_capture_sizes"] = list(kw["cudagraph_capture_sizes"])
    notes: list[str] = []
    if interpreted.get("compilation_config"):
        _apply_compilation_config(interpreted["compilation_config"], kw, notes)
    sizes = kw.get("cudagraph_capture_sizes")
    if sizes and "max_cudagraph_capture_size" in kw and kw["max_cudagraph_capture_size"] != max(sizes):
        raise CLIError(f"--max-cudagraph-capture-size {kw['max_cudagraph_capture_size']} contradicts the largest "
                       f"capture size {max(sizes)}")
    level = kw.get("optimization_level")
    if level is not None:
        graphs = "no CUDA graphs" if level == 0 else "full CUDA graphs for pure-decode steps"
        notes.append(f"-O{level}: there is no torch.compile here; the level sets the CUDA-graph default "
                     f"({graphs}; an explicit cudagraph_mode wins)")
    if "speculative_config" in interpreted:
        notes.append("--speculative-config: speculative decoding is not supported; decoding one token per step "
                     "(MTP weights are not loaded)")
    if kw.get("swap_space") is not None:
        notes.append("--swap-space: does not apply (preempted requests are recomputed; KV is never swapped "
                     "to CPU)")
    if kw.get("trust_remote_code"):
        notes.append("--trust-remote-code: accepted; mlaserve never runs checkpoint code (the DeepSeek "
                     "architectures are implemented here)")
    gpu_only = [flag for name, flag in GPU_ONLY_FIELDS if kw.get(name) is not None]
    if gpu_only and _cuda_unavailable(kw.get("device", "auto")):
        notes.append(f"{', '.join(gpu_only)}: do not apply on CPU (no CUDA device); ignored")
    return kw, notes


def engine_config_from_namespace(ns: argparse.Namespace, serve: bool = True, **fixed) -> tuple[EngineConfig, list[str]]:
    """An EngineConfig from the engine flags in ``ns`` plus ``fixed`` fields (the model, names)."""
    kw, notes = engine_kwargs_from_namespace(ns, serve)
    return EngineConfig(**kw, **fixed), notes
