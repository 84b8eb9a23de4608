"""The ``mlaserve`` command line: vLLM's flag names, one parse into one ``EngineConfig``.

``mlaserve serve [MODEL_DIR] [flags]`` (== ``python -m server serve ...``) accepts vLLM's
spellings: ``--max-model-len`` and ``--max_model_len``, ``--flag=value``, ``-tp``/``-dp``,
``--compilation-config '{json}'``, the dotted ``--compilation-config.cudagraph_mode X`` (also
``--compilation_config.cudagraph_mode``, ``-O.cudagraph_mode=X``) and ``-O3``. A flag that does
not apply here is accepted and logged once at start-up; an unknown flag is an error naming it.
The engine flags themselves are one table, server/engine_args.py, shared with ``bench throughput``.

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
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from server import envs
from server.config import EngineConfig, EngineConfigError
from server.engine_args import CLIError, add_engine_arguments, engine_config_from_namespace, human_int, json_value

logger = logging.getLogger("mlaserve")

# Flags whose value is a JSON object and that therefore take dotted sub-keys.
DICT_FLAGS = ("--compilation-config", "--speculative-config")


def bundled_model_dir() -> str:
    """The tiny arithmetic checkpoint shipped in the ``configs`` package (``configs/arith/``)."""
    return str(importlib.resources.files("configs") / "arith")


# ----------------------------------------------------------------------------- argv spelling


def _set_dotted(target: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        node = target.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"sub-key {part!r} is both a value and a group")
        target = node
    target[path[-1]] = value


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
                _set_dotted(dotted.setdefault(base, {}), path, json_value(value))
            except ValueError as e:
                raise CLIError(f"{key}: {e}") from e
            continue
        name = base + (("." + sub) if dot else "")
        out.append(name + eq + value if eq else name)
        typed[out[-1]] = tok
    for base, obj in dotted.items():  # after any '{json}' form, so dotted keys win
        out.extend([base, json.dumps(obj)])
    return out, typed


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
    max_request_body_bytes: int = 8 * 1024 * 1024
    notes: list[str] = field(default_factory=list)  # flags accepted that do not apply here


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("--max-request-body-bytes", type=human_int, default=8 * 1024 * 1024,
                   help="a larger request body is refused (413) before it is parsed (default 8M)")
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true", default=None,
                   help="(/tokenizer_info is always on)")
    add_engine_arguments(p, serve=True)


def serve_args_from_namespace(ns: argparse.Namespace) -> ServeArgs:
    """The single place where serve flags become an EngineConfig (raises CLIError / EngineConfigError)."""
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        raise CLIError(f"MODEL_DIR {ns.model_tag!r} and --model {ns.model!r} disagree; give one")
    fixed: dict[str, Any] = {"model": ns.model_tag or ns.model or bundled_model_dir()}
    if ns.served_model_name:
        fixed["served_model_name"] = ns.served_model_name[0]
        fixed["served_model_names"] = tuple(ns.served_model_name)
    config, notes = engine_config_from_namespace(ns, serve=True, **fixed)
    if ns.disable_log_requests:
        notes.append("--disable-log-requests: request logging is already off (see --enable-log-requests)")
    if ns.enable_tokenizer_info_endpoint:
        notes.append("--enable-tokenizer-info-endpoint: /tokenizer_info is always enabled")
    api_key = ns.api_key or envs.MLASERVE_API_KEY or envs.VLLM_API_KEY
    return ServeArgs(engine_config=config, host=ns.host, port=ns.port, api_key=api_key,
                     uvicorn_log_level=ns.uvicorn_log_level, log_requests=ns.enable_log_requests,
                     log_stats=not ns.disable_log_stats, max_request_body_bytes=ns.max_request_body_bytes,
                     notes=notes)


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
                                      log_stats=args.log_stats,
                                      max_request_body_bytes=args.max_request_body_bytes))
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
