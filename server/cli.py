"""The ``mlaserve`` command line: vLLM's flag names, one parse into one ``EngineConfig``.

``mlaserve serve [MODEL_DIR] [flags]`` (== ``python -m server serve ...``) accepts vLLM's
spellings: ``--max-model-len`` and ``--max_model_len``, ``--flag=value``, ``-tp``/``-dp``,
``--compilation-config '{json}'``, the dotted ``--compilation-config.cudagraph_mode X`` (also
``--compilation_config.cudagraph_mode``, ``-O.cudagraph_mode=X``) and ``-O3``. A flag that does
not apply here is accepted and logged once at start-up; an unknown flag is an error naming it.

Sub-commands are a registry. ``serve`` lives here; to add ``foo``, create
``server/cli_foo.py`` defining ``SUBCOMMAND = Subcommand(name="foo", help="...",
add_arguments=<fn(parser)>, run=<fn(namespace) -> exit code>)``. Every ``server/cli_*.py``
is discovered at start-up; one that fails to import is listed as unavailable (running it
prints the import error) instead of breaking the other sub-commands.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import importlib
import importlib.resources
import json
import logging
import os
import pkgutil
import re
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from server import envs
from server.config import ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, EngineConfig, EngineConfigError

logger = logging.getLogger("mlaserve")

# Flags whose value is a JSON object and that therefore take dotted sub-keys.
DICT_FLAGS = ("--compilation-config",)
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


def bundled_model_dir() -> str:
    """The tiny arithmetic checkpoint shipped in the ``configs`` package (``configs/arith/``)."""
    return str(importlib.resources.files("configs") / "arith")


# ----------------------------------------------------------------------------- argv spelling


def _human_int(text: str) -> int:
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


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _set_dotted(target: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        node = target.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"sub-key {part!r} is both a value and a group")
        target = node
    target[path[-1]] = value


class CLIError(ValueError):
    """A command line we cannot read; the message names the offending flag."""


def normalize_argv(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Rewrite vLLM's alternative spellings into the canonical ``--dash-flag value`` form.

    Also returns {rewritten token: as the user typed it}, so errors can quote the original.
    """
    out: list[str] = []
    typed: dict[str, str] = {}
    dotted: dict[str, dict] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok == "--":
            out.extend(argv[i - 1:])
            break
        if tok.startswith("-O") and not tok.startswith("--"):
            rest = tok[2:]
            if rest.startswith("."):  # -O.key=value / -O.key value
                tok = "--compilation-config" + rest
            else:
                if rest.startswith("="):
                    rest = rest[1:]
                if not rest:
                    if i >= len(argv):
                        raise CLIError("-O expects a value (an optimization level or a JSON object)")
                    rest, i = argv[i], i + 1
                out.extend(["--optimization-level", rest] if rest.isdigit() else ["--compilation-config", rest])
                continue
        if not tok.startswith("--") or tok == "--":
            out.append(tok)
            continue
        key, eq, value = tok.partition("=")
        base, dot, sub = key.partition(".")
        base = "--" + base[2:].replace("_", "-")
        if dot and base in DICT_FLAGS:
            if not eq:
                if i >= len(argv):
                    raise CLIError(f"{key} expects a value")
                value, i = argv[i], i + 1
            path = [p.replace("-", "_") for p in sub.split(".")]
            if not all(path):
                raise CLIError(f"{key}: empty sub-key")
            try:
                _set_dotted(dotted.setdefault(base, {}), path, _json_value(value))
            except ValueError as e:
                raise CLIError(f"{key}: {e}") from e
            continue
        name = base + (("." + sub) if dot else "")
        out.append(name + eq + value if eq else name)
        typed[out[-1]] = tok
    for base, obj in dotted.items():  # after any '{json}' form, so dotted keys win
        out.extend([base, json.dumps(obj)])
    return out, typed


class _MergeJSONAction(argparse.Action):
    """``--compilation-config`` may repeat (JSON form, then dotted keys): dicts merge."""

    def __call__(self, parser, namespace, values, option_string=None):
        value = _json_value(values)
        if isinstance(value, int) and not isinstance(value, bool):
            value = {"level": value}  # vLLM's ``--compilation-config 3``
        if not isinstance(value, dict):
            parser.error(f"{option_string}: expected a JSON object, got {values!r}")
        merged = dict(getattr(namespace, self.dest) or {})
        merged.update(value)
        setattr(namespace, self.dest, merged)


# ----------------------------------------------------------------------------- serve flags


@dataclass
class ServeArgs:
    """Everything ``serve`` needs: the engine config plus the HTTP server's own settings."""

    engine_config: EngineConfig
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    uvicorn_log_level: str = "info"
    log_requests: bool = False
    log_stats: bool = True
    notes: list[str] = field(default_factory=list)  # flags accepted that do not apply here


# argparse dest -> EngineConfig field, for flags that map one-to-one.
_ENGINE_FIELDS = (
    "tokenizer", "chat_template", "dtype", "load_format", "kv_cache_dtype", "device", "seed", "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens", "enable_chunked_prefill", "block_size", "enable_prefix_caching",
    "async_scheduling", "gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks_override",
    "swap_space", "enforce_eager", "max_cudagraph_capture_size", "attention_backend",
    "tensor_parallel_size", "data_parallel_size", "enable_expert_parallel", "nnodes", "node_rank",
    "master_addr", "master_port", "trust_remote_code", "tp_reduction",
)


def add_scheduling_arguments(g) -> None:
    """The engine's scheduling flags (vLLM's spellings); shared by `serve` and `bench throughput`."""
    g.add_argument("--max-model-len", type=_human_int, default=None, help="e.g. 10240, 10k, 8K")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=_human_int, default=None)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    bool_flag = argparse.BooleanOptionalAction
    p.add_argument("model_tag", nargs="?", metavar="MODEL_DIR",
                   help="checkpoint directory (Hugging Face layout). Default: the bundled tiny "
                        f"arithmetic model, configs/arith/ inside the installed package "
                        f"({bundled_model_dir()})")
    p.add_argument("--model", help="same as MODEL_DIR")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces, as vLLM)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $MLASERVE_API_KEY or "
                        "$VLLM_API_KEY)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model; the first is reported (default: MODEL_DIR)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--enable-log-requests", action="store_true", default=False, help="log every request")
    g.add_argument("--disable-log-requests", action="store_true", default=None,
                   help="(request logging is already off by default)")
    g.add_argument("--disable-log-stats", action="store_true", default=False,
                   help="no periodic throughput / queue / KV usage log line")
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true", default=None,
                   help="(/tokenizer_info is always on)")
    g = p.add_argument_group("model")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: MODEL_DIR)")
    g.add_argument("--chat-template", default=None,
                   help="chat template (a Jinja file or the template text) instead of the checkpoint's")
    g.add_argument("--dtype", choices=DTYPES, default=None)
    g.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                   help="auto: load the checkpoint's weights; dummy: random weights in the checkpoint's "
                        "shapes, made on the device (benchmarks)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None)
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--trust-remote-code", action=bool_flag, default=None,
                   help="accepted for vLLM compatibility; checkpoint code is never run")
    add_scheduling_arguments(p.add_argument_group("scheduling"))
    g = p.add_argument_group("memory")
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--kv-cache-memory-bytes", type=_human_int, default=None)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--swap-space", type=float, default=None, help="accepted; KV is never swapped here")
    g = p.add_argument_group("execution")
    g.add_argument("--enforce-eager", action=bool_flag, default=None)
    g.add_argument("--max-cudagraph-capture-size", type=int, default=None)
    g.add_argument("--compilation-config", action=_MergeJSONAction, default=None,
                   metavar="JSON", help="vLLM CompilationConfig; cudagraph_mode, max_cudagraph_capture_size "
                                        "and cudagraph_capture_sizes apply, other keys are ignored. Dotted "
                                        "form: --compilation-config.cudagraph_mode FULL_DECODE_ONLY")
    g.add_argument("--optimization-level", type=int, default=None, help="-O<n>: accepted, no torch.compile here")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None)
    g.add_argument("--enable-expert-parallel", action=bool_flag, default=None)
    g.add_argument("--tp-reduction", choices=["reduce_scatter", "all_reduce"], default=None,
                   help="how TP sums row-parallel outputs: reduce-scatter over tokens (default) or "
                        "all-reduce (for A/B comparison; same results)")
    g.add_argument("--nnodes", type=int, default=None)
    g.add_argument("--node-rank", type=int, default=None)
    g.add_argument("--master-addr", default=None)
    g.add_argument("--master-port", type=int, default=None)


def _cuda_unavailable(device: str) -> bool:
    if device == "cpu":
        return True
    if device == "cuda":
        return False
    import torch

    return not torch.cuda.is_available()


def _apply_compilation_config(cc: dict, kw: dict, extra: dict, notes: list[str]) -> None:
    unknown = sorted(set(cc) - IGNORED_COMPILATION_KEYS
                     - {"cudagraph_mode", "max_cudagraph_capture_size", "cudagraph_capture_sizes"})
    if unknown:
        raise CLIError(f"--compilation-config: unknown key(s) {', '.join(unknown)}")
    extra["compilation_config"] = cc
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
        if not isinstance(sizes, list) or not sizes or not all(isinstance(s, int) and s > 0 for s in sizes):
            raise CLIError("--compilation-config.cudagraph_capture_sizes: expected a list of positive integers")
        extra["cudagraph_capture_sizes"] = sorted(set(sizes))
    size = cc.get("max_cudagraph_capture_size", max(sizes) if sizes else None)
    if size is not None:
        if kw.get("max_cudagraph_capture_size") not in (None, size):
            raise CLIError(f"--max-cudagraph-capture-size {kw['max_cudagraph_capture_size']} contradicts "
                           f"--compilation-config max_cudagraph_capture_size {size}")
        kw["max_cudagraph_capture_size"] = size
    ignored = sorted(set(cc) & IGNORED_COMPILATION_KEYS)
    if ignored:
        notes.append(f"--compilation-config: {', '.join(ignored)} do not apply (no torch.compile or "
                     "piecewise graphs here); ignored")


def serve_args_from_namespace(ns: argparse.Namespace) -> ServeArgs:
    """The single place where serve flags become an EngineConfig (raises CLIError / EngineConfigError)."""
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        raise CLIError(f"MODEL_DIR {ns.model_tag!r} and --model {ns.model!r} disagree; give one")
    kw: dict[str, Any] = {f: getattr(ns, f) for f in _ENGINE_FIELDS if getattr(ns, f) is not None}
    kw["model"] = ns.model_tag or ns.model or bundled_model_dir()
    extra: dict[str, Any] = {}
    notes: list[str] = []
    if ns.served_model_name:
        kw["served_model_name"] = ns.served_model_name[0]
        extra["served_model_names"] = list(ns.served_model_name)
    if ns.compilation_config:
        _apply_compilation_config(ns.compilation_config, kw, extra, notes)
    if ns.optimization_level is not None:
        extra["optimization_level"] = ns.optimization_level
        notes.append(f"-O{ns.optimization_level}: optimization levels do not apply (no torch.compile here)")
    if ns.swap_space is not None:
        notes.append("--swap-space: does not apply (preempted requests are recomputed; KV is never swapped "
                     "to CPU)")
    if ns.trust_remote_code:
        notes.append("--trust-remote-code: accepted; mlaserve never runs checkpoint code (the DeepSeek "
                     "architectures are implemented here)")
    if ns.disable_log_requests:
        notes.append("--disable-log-requests: request logging is already off (see --enable-log-requests)")
    if ns.enable_tokenizer_info_endpoint:
        notes.append("--enable-tokenizer-info-endpoint: /tokenizer_info is always enabled")
    gpu_only = [flag for flag, given in (
        ("--gpu-memory-utilization", ns.gpu_memory_utilization is not None),
        ("--enforce-eager", ns.enforce_eager is not None),
        ("--max-cudagraph-capture-size", "max_cudagraph_capture_size" in kw),
        ("--compilation-config.cudagraph_mode", "cudagraph_mode" in kw)) if given]
    if gpu_only and _cuda_unavailable(kw.get("device", "auto")):
        notes.append(f"{', '.join(gpu_only)}: do not apply on CPU (no CUDA device); ignored")
    kw["extra"] = extra
    config = EngineConfig(**kw)
    api_key = ns.api_key or envs.MLASERVE_API_KEY or envs.VLLM_API_KEY
    return ServeArgs(engine_config=config, host=ns.host, port=ns.port, api_key=api_key,
                     uvicorn_log_level=ns.uvicorn_log_level, log_requests=ns.enable_log_requests,
                     log_stats=not ns.disable_log_stats, notes=notes)


def run_serve(args: ServeArgs) -> int:
    for note in args.notes:
        logger.info("%s", note)
    model = args.engine_config.model
    if not os.path.isdir(model):
        logger.error("model directory not found: %s (mlaserve loads local Hugging Face checkpoints; "
                     "download one first, e.g. with `huggingface-cli download`)", model)
        return 1
    if args.engine_config.node_rank > 0:
        from server.tp_worker import run_headless_node

        logger.info("node rank %d: running this node's workers headless (the API runs on node 0)",
                    args.engine_config.node_rank)
        return run_headless_node(args.engine_config, model)
    from model.config import ConfigError
    from server.api import run_server
    from server.errors import EngineStartupError
    from server.tokenizer import TokenizerLoadError

    try:
        return asyncio.run(run_server(args.engine_config, args.host, args.port, args.api_key,
                                      uvicorn_log_level=args.uvicorn_log_level, log_requests=args.log_requests,
                                      log_stats=args.log_stats))
    except (ConfigError, TokenizerLoadError, EngineStartupError) as exc:
        # A bad checkpoint or a failed start: one line naming the cause, no traceback wall.
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _serve_main(ns: argparse.Namespace) -> int:
    return run_serve(serve_args_from_namespace(ns))


# ----------------------------------------------------------------------------- sub-commands


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SERVE = Subcommand("serve", "start the OpenAI-compatible server (vLLM's flags)", add_serve_arguments, _serve_main)


def _unavailable(name: str, error: str) -> Subcommand:
    def run(_ns: argparse.Namespace) -> int:
        print(f"mlaserve {name} is unavailable: its module failed to import:\n{error}", file=sys.stderr)
        return 1

    return Subcommand(name, "(unavailable: import failed)", lambda p: None, run)


def discover_subcommands(package: str = "server") -> list[Subcommand]:
    """``serve`` plus the ``SUBCOMMAND`` of every ``<package>/cli_*.py`` module."""
    found = [SERVE]
    pkg = importlib.import_module(package)
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if not info.name.startswith("cli_"):
            continue
        name = info.name[len("cli_"):].replace("_", "-")
        try:
            module = importlib.import_module(f"{package}.{info.name}")
            sub = module.SUBCOMMAND
        except Exception:  # reported when that sub-command is run; the others keep working
            found.append(_unavailable(name, traceback.format_exc()))
            continue
        if not isinstance(sub, Subcommand):
            found.append(_unavailable(name, f"{package}.{info.name}.SUBCOMMAND is not a Subcommand"))
            continue
        found.append(sub)
    return found


def build_parser(subcommands: list[Subcommand]) -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="mlaserve", allow_abbrev=False,
                                     description="Inference server for DeepSeek MLA models (vLLM-compatible).")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True)
    parsers = {}
    for sc in subcommands:
        sp = sub.add_parser(sc.name, help=sc.help, description=sc.help, allow_abbrev=False,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        sc.add_arguments(sp)
        sp.set_defaults(_run=sc.run)
        parsers[sc.name] = sp
    return parser, parsers


def _reject_unknown(sp: argparse.ArgumentParser, unknown: list[str], typed: dict[str, str]) -> None:
    known = [s for a in sp._actions for s in a.option_strings]
    flags = [u for u in unknown if u.startswith("-")] or unknown
    hints = []
    for u in flags:
        close = difflib.get_close_matches(u.split("=")[0], known, n=1)
        shown = typed.get(u, u)
        hints.append(f"{shown} (did you mean {close[0]}?)" if close else shown)
    sp.error(f"unrecognized arguments: {' '.join(hints)}")


def parse_args(argv: list[str] | None = None,
               subcommands: list[Subcommand] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (without the program name); exits 2 with a message on a bad command line."""
    subcommands = discover_subcommands() if subcommands is None else subcommands
    parser, parsers = build_parser(subcommands)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv, typed = normalize_argv(argv)
    except CLIError as e:
        parser.error(str(e))
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        _reject_unknown(parsers[ns.subcommand], unknown, typed)
    ns._parser = parsers[ns.subcommand]
    return ns


def parse_serve_args(argv: list[str]) -> ServeArgs:
    """``mlaserve serve <argv>`` parsed into ServeArgs; exits 2 naming the flag on any error."""
    ns = parse_args(["serve", *argv], subcommands=[SERVE])
    try:
        return serve_args_from_namespace(ns)
    except (CLIError, EngineConfigError) as e:
        ns._parser.error(str(e))
        raise  # unreachable: error() exits


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    ns = parse_args(argv)
    try:
        envs.check_all()
        return ns._run(ns)
    except (CLIError, EngineConfigError, envs.EnvVarError) as e:
        ns._parser.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
