"""Start-up of one rank's model side: load → max_model_len → KV blocks → agree → runner → graphs.

The engine process and every TP worker build their model, KV cache and runner through
:func:`build_runner`, so they agree on the context length, the number of KV blocks and the
captured graph sizes by construction (the ranks of a TP group must run identical shapes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import mla_decode_cuda
from model.config import ModelConfig, load_model_config
from model.deepseek import DeepseekForCausalLM
from model.loader import DTYPE_NAMES, CheckpointError, load_model
from model.parallel import ParallelContext
from model.v4_family import V4_FAMILY_MODEL_TYPES, load_v4_family, random_v4_family
from model.v4_loader import read_v4_config
from model.v41.fp8_linear import check_dequantized_linears, mxfp8_shape_problem
from server import envs
from server.config import EngineConfig
from server.cuda_graphs import maybe_capture
from server.kv_cache_spec import max_tokens_per_seq, plan_groups
from server.runner import ModelRunner, determine_num_blocks, model_kv_cache_specs
from server.scheduler import resolve_max_num_batched_tokens
from server.v4_cuda_graphs import maybe_capture_v4
from server.v4_kv_specs import describe_v4_capacity, v4_family_kv_cache_specs, v4_pool_plan
from server.v4_prefix_cache import describe_snapshot_policy
from server.v4_runner import V4FamilyRunner, v4_num_blocks
from server.warmup import warm_up_prefill_attention

logger = logging.getLogger(__name__)


@dataclass
class RunnerSetup:
    model: DeepseekForCausalLM
    runner: ModelRunner
    num_blocks: int
    max_model_len: int  # fits both the model's positions and the KV cache


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available")
    return torch.device("cuda")


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """``--max-model-len``, or the model's limit; above that limit is an error (as vLLM)."""
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"--max-model-len: {config.max_model_len} exceeds the model's max_position_embeddings ({limit})"
        )
    return config.max_model_len


def kv_capacity_tokens(config: EngineConfig, model: DeepseekForCausalLM, num_blocks: int) -> int | None:
    """The longest sequence a cache of ``num_blocks`` holds alone (None: any length), from the
    same layer-group plan the block manager and the runner's tensors use."""
    specs = model_kv_cache_specs(model.config, config, model.dtype)
    return max_tokens_per_seq(plan_groups(specs, num_blocks, config.max_num_seqs))


def fit_kv_capacity(config: EngineConfig, max_model_len: int, capacity: int | None) -> int:
    """One sequence of ``max_model_len`` tokens must fit the KV cache (``capacity`` tokens,
    None: any length): a length the user asked for that does not fit is an error; the model's
    own limit is capped at the capacity."""
    if capacity is None or max_model_len <= capacity:
        return max_model_len
    if config.max_model_len is not None:
        raise ValueError(
            f"--max-model-len: {max_model_len} tokens do not fit the KV cache ({capacity} tokens); "
            "lower it or give the cache more memory"
        )
    logger.info("max_model_len capped at the KV cache capacity: %d tokens", capacity)
    return capacity


def build_runner(config: EngineConfig, model_dir: str, device: torch.device, par: ParallelContext | None = None,
                 agree_num_blocks: Callable[[int], int] | None = None, progress: bool = True) -> RunnerSetup:
    """Load this rank's shard and build its runner, KV cache and decode graphs.

    ``agree_num_blocks`` (TP) turns this rank's KV capacity into the group's (the minimum),
    so every rank sizes its cache, context length and graphs the same.
    """
    mla_decode_cuda.set_cache_dir(envs.MLASERVE_KERNEL_CACHE)
    if is_v4_family(model_dir):
        return build_v4_family_runner(config, model_dir, device, par, agree_num_blocks)
    check_dequantized_linears(config.linear_backend, "this checkpoint (not DeepSeek-V4.1)")
    model = load_model(model_dir, dtype=config.dtype, device=device, par=par, progress=progress,
                       load_format=config.load_format, seed=config.seed)
    max_model_len = resolve_max_model_len(config, model.config)
    num_blocks = determine_num_blocks(config, model.config, model.dtype, device,
                                      model=model, max_model_len=max_model_len)
    if agree_num_blocks is not None:
        num_blocks = agree_num_blocks(num_blocks)
    max_model_len = fit_kv_capacity(config, max_model_len, kv_capacity_tokens(config, model, num_blocks))
    runner = ModelRunner(model, config, num_blocks, device)
    runner.decode_graphs = maybe_capture(runner, config, max_model_len)
    warm_up_prefill_attention(runner, config, max_model_len)
    return RunnerSetup(model, runner, num_blocks, max_model_len)


def is_v4_family(model_dir: str) -> bool:
    """Whether ``model_dir`` holds a DeepSeek-V4 / V4.1 checkpoint (False when unreadable: the
    R1 loader reports that)."""
    try:
        return load_model_config(model_dir).model_type in V4_FAMILY_MODEL_TYPES
    except (OSError, ValueError):
        return False


def check_v4_family_parallel(config: EngineConfig, model_dir: str) -> None:
    """A V4-family checkpoint must split evenly over the parallel layout (checked before any
    worker starts); an uneven split is one line naming the flag."""
    if config.world_size > 1 and is_v4_family(model_dir):
        c = read_v4_config(model_dir, V4_FAMILY_MODEL_TYPES)
        problem = v4_layout_problem(c, config.tensor_parallel_size, config.data_parallel_size,
                                    config.enable_expert_parallel)
        if problem is None and config.linear_backend == "mxfp8" and c.model_type != "deepseek_v4":
            shapes = mxfp8_shape_problem(c, config.tensor_parallel_size)  # auto falls back (logged) instead
            problem = f"--linear-backend mxfp8: {shapes}" if shapes else None
        if problem:
            raise CheckpointError(problem)


def v4_layout_problem(c, tp: int, dp: int, expert_parallel: bool) -> str | None:
    """Why the V4 / V4.1 config ``c`` cannot split over TP ``tp`` × DP ``dp`` (None if it can):
    heads and output groups over the TP ranks; routed experts (whole, or their intermediate
    dim) over the MoE group: every DP × TP rank under DP, the TP ranks without."""
    name = "DeepSeek-V4.1" if c.model_type != "deepseek_v4" else "DeepSeek-V4"
    if c.num_attention_heads % tp or c.o_groups % tp:
        return (f"--tensor-parallel-size {tp}: {name} splits its {c.num_attention_heads} attention heads and "
                f"{c.o_groups} output groups (o_groups) over the TP ranks; use a size that divides both")
    shared = c.moe_intermediate_size * c.n_shared_experts
    if shared % tp:
        return (f"--tensor-parallel-size {tp}: the shared expert's intermediate size {shared} does not split "
                f"over {tp} ranks")
    moe_world = tp * dp
    flags = "--tensor-parallel-size x --data-parallel-size" if dp > 1 else "--tensor-parallel-size"
    if expert_parallel and c.n_routed_experts % moe_world:
        return (f"--enable-expert-parallel: {c.n_routed_experts} routed experts do not split over {moe_world} "
                f"ranks ({flags})")
    if not expert_parallel and c.moe_intermediate_size % moe_world:
        return (f"{flags} = {moe_world}: the experts' intermediate size {c.moe_intermediate_size} does not split "
                f"over {moe_world} ranks (--enable-expert-parallel splits whole experts instead)")
    return None


def build_v4_family_runner(config: EngineConfig, model_dir: str, device: torch.device,
                           par: ParallelContext | None,
                           agree_num_blocks: Callable[[int], int] | None = None) -> RunnerSetup:
    """V4 / V4.1: the model with its per-request states (this rank's shard under ``par``;
    ``--load-format dummy``: random weights made on the device), the cache specs of
    server/v4_kv_specs.py sized from the byte budget (the TP group's minimum), prefix caching
    by state snapshots (server/v4_prefix_cache.py), row pools sized once from the plan, decode
    graphs (server/v4_cuda_graphs.py); ``--attention-backend`` picks the sparse decode backend
    for fp8 records, ``--prefill-attention-backend`` the chunks' sparse prefill backend
    (model/v4/sparse_attention.py); ``--linear-backend`` whether V4.1's FP8 linears run as
    MXFP8 (model/v41/fp8_linear.py)."""
    if par is not None:
        check_v4_family_parallel(config, model_dir)
    if config.dtype == "auto":
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    else:
        dtype = DTYPE_NAMES[config.dtype]
    mxfp4_experts = not envs.MLASERVE_V41_DEQUANTIZE_EXPERTS
    if config.load_format == "dummy":
        model = random_v4_family(model_dir, dtype, device, config.seed, par, mxfp4_experts, config.linear_backend)
    else:
        model = load_v4_family(model_dir, dtype, device, par, mxfp4_experts, config.linear_backend)
    try:
        model.configure_cache(config.kv_cache_dtype, page_rows=config.block_size,
                              attention_backend=config.attention_backend,
                              prefill_backend=config.prefill_attention_backend)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    # Prefix caching: room for one snapshot per running request in the fixed-size pools.
    slots = config.max_num_seqs if config.enable_prefix_caching else 0
    if config.enable_prefix_caching:
        logger.info("prefix caching is on for %s: %s", model.config.model_type,
                    describe_snapshot_policy(envs.MLASERVE_V4_PREFIX_SNAPSHOT_INTERVAL, config.block_size, slots))
    else:
        logger.info("prefix caching is off for %s (--no-enable-prefix-caching)", model.config.model_type)
    max_model_len = resolve_max_model_len(config, model.config)
    step_tokens = resolve_max_num_batched_tokens(config, max_model_len)
    specs = v4_family_kv_cache_specs(model.config, config.block_size, config.kv_cache_dtype, dtype, step_tokens,
                                     snapshot_slots=slots)
    num_blocks = v4_num_blocks(config, specs, device, model, min(step_tokens, max_model_len))
    if agree_num_blocks is not None:
        num_blocks = agree_num_blocks(num_blocks)
    groups = plan_groups(specs, num_blocks, config.max_num_seqs)
    max_model_len = fit_kv_capacity(config, max_model_len, max_tokens_per_seq(groups))
    logger.info("KV cache (%s, --kv-cache-dtype %s): %s", model.config.model_type, config.kv_cache_dtype,
                describe_v4_capacity(groups, max_model_len))
    # The row pools, once, at the plan's sizes: their addresses never move (CUDA graphs).
    model.configure_cache(config.kv_cache_dtype, page_rows=config.block_size, plan=v4_pool_plan(groups),
                          attention_backend=config.attention_backend, prefill_backend=config.prefill_attention_backend)
    logger.info("row pools: %d bytes (the plan's groups: %d bytes)", model.cache_pools().num_bytes(),
                sum(g.num_bytes for g in groups))
    runner = V4FamilyRunner(model, config, num_blocks, device, specs)
    runner.decode_graphs = maybe_capture_v4(model, config, max_model_len)
    return RunnerSetup(model, runner, num_blocks, max_model_len)
