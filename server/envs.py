"""Every environment variable mlaserve reads, in one place: name, default, meaning.

``envs.MLASERVE_X`` reads the variable when accessed (not at import), so a spawned engine
process or a test's ``monkeypatch.setenv`` sees the current value. Packages below ``server``
(``kernels``, ``distributed``) never read the environment: the server passes them the value.
A value that does not parse is one error naming the variable. The README lists the same
table (``tests/server/test_envs.py`` keeps the two in step).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


def _flag(raw: str) -> bool:
    return raw.strip().lower() not in ("", "0", "false", "no", "off")


def _nonnegative_seconds(raw: str) -> float:
    value = float(raw)
    if not value >= 0:
        raise ValueError("must be a number of seconds >= 0")
    return value


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be a positive number of seconds")
    return value


def _nonnegative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be an integer >= 0")
    return value


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: Any
    parse: Callable[[str], Any]
    meaning: str


ENV_VARS: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("MLASERVE_API_KEY", None, str,
           "API key required as 'Authorization: Bearer KEY' on /v1/* when --api-key is not given"),
    EnvVar("VLLM_API_KEY", None, str,
           "the same, under vLLM's name (MLASERVE_API_KEY wins when both are set)"),
    EnvVar("MLASERVE_ENGINE_STARTUP_TIMEOUT", 600.0, _seconds,
           "seconds the API process waits for an engine process to load the model and report ready"),
    EnvVar("MLASERVE_ENGINE_ITERATION_TIMEOUT_S", 60.0, _seconds,
           "/health answers 503 when the engine has work and has not finished a loop iteration for "
           "this many seconds (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S)"),
    EnvVar("MLASERVE_TEST_ENGINE_STALL_S", 0.0, _nonnegative_seconds,
           "test hook: the engine loop sleeps this long once, in its first iteration with work"),
    EnvVar("MLASERVE_DIST_INIT_TIMEOUT", 120.0, _seconds,
           "seconds a rank waits at the torch.distributed rendezvous for its peers"),
    EnvVar("MLASERVE_STEP_PROFILE", False, _flag,
           "1: time every engine step in phases (plan, forward, sample, sched); reported in stats"),
    EnvVar("MLASERVE_SKIP_WARMUP", False, _flag,
           "1: the engine serves without its start-up warm-up steps (which compile the GPU kernels' "
           "step shapes before the first request)"),
    EnvVar("OPENAI_API_KEY", None, str,
           "mlaserve bench serve: sent as 'Authorization: Bearer KEY' (as vLLM's benchmark client)"),
    EnvVar("MLASERVE_V4_PREFIX_SNAPSHOT_INTERVAL", 4096, _nonnegative_int,
           "DeepSeek-V4 family prefix caching: also snapshot the request state every this many prompt "
           "tokens (rounded up to whole blocks; 0: only at the prompt's end and where prompts diverge)"),
    EnvVar("MLASERVE_V4_GRAPH_MAX_LEN", 32768, _nonnegative_int,
           "DeepSeek-V4 family decode CUDA graphs cover contexts up to this many tokens (capped at "
           "--max-model-len; their gathers are batch x this wide); a decode step with a longer "
           "request runs eagerly (0: --max-model-len)"),
    EnvVar("MLASERVE_V41_DEQUANTIZE_EXPERTS", False, _flag,
           "1: DeepSeek-V4.1 routed experts stored as MXFP4 (and --load-format dummy's) are made per-expert "
           "modules in the model dtype instead of staying stacked MXFP4 for the W4A8 / W4A16 kernels"),
    EnvVar("MLASERVE_CONTEXT_WORKSPACE_TOKENS", 0, _nonnegative_int,
           "MLA prefill: cached-prefix rows a step up-projects at once; a step whose chunks' prefixes "
           "(prefix-cache hits, earlier chunks) add up to more attends them in windows of this many, "
           "merged by log-sum-exp, bounding the step's memory (0: all at once, however many)"),
    EnvVar("MLASERVE_KERNEL_CACHE", Path.home() / ".cache" / "mlaserve" / "kernels", Path,
           "directory for the compiled CUDA MLA decode library (built with nvcc on first use)"),
)}


class EnvVarError(ValueError):
    """A variable is set to a value that does not parse."""


def read(name: str) -> Any:
    """The variable's parsed value, or its default when unset or empty."""
    var = ENV_VARS[name]
    raw = os.environ.get(name, "")
    if raw == "":
        return var.default
    try:
        return var.parse(raw)
    except ValueError as e:
        raise EnvVarError(f"environment variable {name}={raw!r}: {e}") from None


def check_all() -> None:
    """Read every variable once, so a bad value fails at start-up, not deep inside a run."""
    for name in ENV_VARS:
        read(name)


def __getattr__(name: str) -> Any:
    if name in ENV_VARS:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *ENV_VARS])
