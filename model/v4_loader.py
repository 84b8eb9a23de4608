"""Stream a DeepSeek-V4 / V4.1 checkpoint into whatever tensors a model asks for.

The loader knows checkpoints, not models: the caller passes the model's expected
``{hf_name: (shape, dtype)}`` (e.g. from ``model.state_dict()``) and gets tensors for exactly
those names. Checkpoint keys may be DeepSeek's released names, transformers 5.24's saved names
(V4 hybrid), HF names, or a mix; single-file or sharded (``model.safetensors.index.json``).

API
---
``plan_v4_checkpoint(model_dir, expected, shard)`` reads only the safetensors headers and
checks every name and shape; a missing, unexpected or mis-shaped tensor is ONE
:class:`~model.loader.CheckpointError` line naming it (and expected vs found shape).
``iter_v4_weights(model_dir, expected, keep_quantized=False, shard=None, device="cpu")`` then
yields ``(hf_name, value)`` one tensor at a time from memory-mapped files:

* ``keep_quantized=False``: FP8 / MXFP4 weights are dequantized to the expected dtype.
* ``keep_quantized=True``: they come as :class:`kernels.weight_formats.QuantizedWeight`
  records (``data``, ``scale``, ``format`` in ``fp8_block``/``mxfp4``, ``block``) in stored
  form, already cut to this rank (V4 experts stacked to [E, 2I, K/2] / [E, D, I/2]).
* ``keep_quantized=predicate``: only the model tensors whose name it accepts (V4.1's routed
  experts held as stacked MXFP4, model/v41/moe.py).
* A weight whose scale the model lists as a tensor of its own (V4.1 engram tables:
  ``engram.embed.weight`` + ``engram.embed.scale``) gets its values and its scale separately,
  unmultiplied: cast to the model dtype (the scale decoded from E8M0), or with
  ``keep_quantized`` in stored form (e4m3 values, E8M0 scale bytes).

A model that keeps FP8 linears as stored lists each one's ``.scale`` as a tensor of its own
(V4.1's MXFP8 linears, model/v41/fp8_linear.py) and so gets e4m3 values and E8M0 scales as
stored, each cut by its weight's rule; :func:`stored_fp8_blocks` tells from the headers
whether a checkpoint holds its linears that way.

``shard=ShardSpec(rank, world_size)`` cuts tensors by :mod:`model.v4_sharding`'s table;
vocab-parallel rows (embed, head, engram tables) are read from disk only for this rank.
MTP (V4 ``mtp.*``), DSpark (V4.1 ``mtp.*``) and vision tensors (``vision.*``, ``aligner.*``)
are skipped with one log line each. ``load_v4_weights`` collects the stream into a dict;
``load_v4_into_module`` copies it into a module's parameters and buffers.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from kernels.weight_formats import (
    E8M0_DTYPE,
    FP8_BLOCK,
    FP8_DTYPE,
    MXFP4,
    QuantizedWeight,
    e8m0_to_float,
)
from model.loader import CheckpointError, CheckpointFiles
from model.v4_layout import LayoutError, architecture, quantization_block
from model.v4_names import (
    V4,
    V41,
    HFRef,
    UnknownTensorName,
    is_mtp_name,
    is_vision_name,
    released_to_hf,
    to_released,
    v4_hf_to_released,
    v4_released_to_hf,
)
from model.v4_sharding import (
    VOCAB_ROWS,
    ShardingError,
    pad_rows,
    shard,
    sharding_rule,
    vocab_rows_range,
)

logger = logging.getLogger(__name__)

_DTYPES = {
    "F8_E4M3": FP8_DTYPE, "F8_E8M0": E8M0_DTYPE, "I8": torch.int8, "U8": torch.uint8, "BF16": torch.bfloat16,
    "F16": torch.float16, "F32": torch.float32, "I64": torch.int64, "I32": torch.int32, "BOOL": torch.bool,
}


@dataclass(frozen=True)
class ShardSpec:
    """This rank's place in the tensor-parallel group (``rank``/``world_size``: heads, output
    groups, vocab rows, shared experts) and in the routed experts' group (``expert_rank``/
    ``expert_world``, default the same): under data parallelism the routed experts are cut over
    every DP × TP rank while attention is cut over one TP group."""

    rank: int = 0
    world_size: int = 1
    expert_rank: int | None = None
    expert_world: int | None = None

    @property
    def experts(self) -> tuple[int, int]:
        """(rank, world) the routed experts are cut over."""
        if self.expert_world is None:
            return self.rank, self.world_size
        return self.expert_rank or 0, self.expert_world

    def for_tensor(self, hf_name: str) -> tuple[int, int]:
        """(rank, world) that cuts ``hf_name``: the experts' pair for routed experts, else TP."""
        return self.experts if ".experts." in hf_name else (self.rank, self.world_size)


@dataclass
class _Source:
    key: str  # checkpoint key
    released: str
    shape: tuple[int, ...]  # stored shape
    dtype: torch.dtype
    expert: int | None = None
    half: int = 0
    scale_key: str | None = None

    @property
    def quantized(self) -> bool:
        return self.dtype in (FP8_DTYPE, torch.int8) and self.scale_key is not None


@dataclass
class _Target:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sources: list[_Source] = field(default_factory=list)
    raw: bool = False  # the model takes the scale as its own tensor


@dataclass
class V4CheckpointPlan:
    """What :func:`iter_v4_weights` will read, checked against the model's names and shapes."""

    model_dir: str
    arch: str
    block: tuple[int, int]
    targets: list[_Target]
    headers: dict[str, tuple[tuple[int, ...], str]]  # checkpoint key -> (stored shape, safetensors dtype)
    shard: ShardSpec
    skipped: dict[str, tuple[int, int]]  # category -> (count, bytes)


def _expected_map(expected: Mapping) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    for name, v in expected.items():
        if isinstance(v, torch.Tensor):
            out[name] = (tuple(v.shape), v.dtype)
        else:
            shape, dtype = v
            out[name] = (tuple(shape), dtype)
    return out


def read_config_json(model_dir: str) -> dict:
    """``config.json`` as a dict; a missing or broken file is one :class:`CheckpointError` line."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"no config.json in {model_dir!r}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None


def _hf_ref(key: str, arch: str, expected: Mapping) -> HFRef | None:
    """Where checkpoint ``key`` goes, or None for a name this architecture does not have."""
    if key in expected:
        return HFRef(key)
    released = to_released(key, arch)
    try:
        return released_to_hf(released, arch)
    except UnknownTensorName:
        pass
    if arch == V4:  # a plain HF name (not the 5.24 save hybrid)
        weight = key[: -len("_scale_inv")] if key.endswith(".weight_scale_inv") else key
        try:
            names = v4_hf_to_released(weight)
        except (UnknownTensorName, ValueError):
            return None
        ref = v4_released_to_hf(names[0][: -len(".weight")] + ".scale" if weight != key else names[0])
        return ref
    return None


def _weight_key_of_scale(key: str) -> str:
    if key.endswith(".weight_scale_inv"):
        return key[: -len("_scale_inv")]
    return key[: -len(".scale")] + ".weight"


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def _logical_shape(src: _Source) -> tuple[int, ...]:
    if src.dtype == torch.int8 and src.scale_key is not None:  # MXFP4: two values per byte
        return (*src.shape[:-1], src.shape[-1] * 2)
    return src.shape


def _target_full_shape(t: _Target) -> tuple[int, ...]:
    if t.sources[0].expert is None:
        return _logical_shape(t.sources[0])
    per = _logical_shape(t.sources[0])
    experts = 1 + max(s.expert for s in t.sources)
    halves = 1 + max(s.half for s in t.sources)
    return (experts, per[0] * halves, per[1])


def plan_v4_checkpoint(model_dir: str, expected: Mapping, shard_spec: ShardSpec | None = None) -> V4CheckpointPlan:
    """Match the checkpoint's headers to the model's ``expected`` tensors; raises one-line errors."""
    spec = shard_spec or ShardSpec()
    cfg = read_config_json(model_dir)
    try:
        arch = architecture(cfg)
        block = quantization_block(cfg)
    except LayoutError as exc:
        raise CheckpointError(str(exc)) from None
    exp = _expected_map(expected)
    files = CheckpointFiles(model_dir)
    try:
        headers = {k: (tuple(files.slice(k).get_shape()), files.slice(k).get_dtype()) for k in files.files}
    finally:
        files.close()
    targets = {name: _Target(name, shape, dtype) for name, (shape, dtype) in exp.items()}
    skipped = {"MTP/DSpark": [0, 0], "vision": [0, 0]}
    sources: dict[str, _Source] = {}
    scales: dict[str, str] = {}
    unknown: list[str] = []
    foreign_experts: set[str] = set()
    for key, (shape, dtype_name) in headers.items():
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise CheckpointError(f"tensor {key!r} has unsupported dtype {dtype_name}")
        released = to_released(key, arch)
        category = "MTP/DSpark" if is_mtp_name(released) else "vision" if is_vision_name(released) else None
        if category:
            skipped[category][0] += 1
            skipped[category][1] += _nbytes(shape, dtype)
            continue
        ref = _hf_ref(key, arch, exp)
        if ref is None:
            unknown.append(key)
            continue
        if ref.is_scale and (ref.expert is not None or ref.name not in exp):
            scales[_weight_key_of_scale(key)] = key
            continue
        if ref.name not in targets:
            if spec.experts[1] > 1 and sharding_rule(ref.name) is not None and ".experts." in ref.name:
                foreign_experts.add(key)  # another rank's expert (EP)
            else:
                unknown.append(key)
            continue
        src = _Source(key, released, shape, dtype, ref.expert, ref.half)
        sources[key] = src
        targets[ref.name].sources.append(src)
    for wkey, skey in scales.items():
        if wkey in sources:
            sources[wkey].scale_key = skey
        elif wkey not in foreign_experts:
            unknown.append(skey)
    for t in targets.values():  # the model takes this weight's scale as a tensor of its own
        scale_names = ((t.name[: -len(".weight")] + ".scale", t.name + "_scale_inv")
                       if t.name.endswith(".weight") else ())
        scale_target = next((targets[n] for n in scale_names if n in exp), None)
        if scale_target is not None and t.sources:
            t.raw = True
            if scale_target.sources:
                t.sources[0].scale_key = scale_target.sources[0].key
    _check_complete(targets, arch, spec)
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise CheckpointError(f"checkpoint has unexpected tensor {unknown[0]!r}{more}: the model has no such weight")
    for t in targets.values():
        _check_target(t, spec)
    return V4CheckpointPlan(model_dir, arch, block, list(targets.values()), headers, spec,
                            {k: (v[0], v[1]) for k, v in skipped.items()})


def _check_complete(targets: dict[str, _Target], arch: str, spec: ShardSpec) -> None:
    missing: list[str] = []
    for t in targets.values():
        if not t.sources:
            released = _released_name(t, arch)
            missing.append(f"{released!r}" + (f" (model tensor {t.name!r})" if released != t.name else ""))
            continue
        if t.sources[0].expert is None:
            if len(t.sources) > 1:
                raise CheckpointError(
                    f"model tensor {t.name!r} is stored twice: {t.sources[0].key!r} and {t.sources[1].key!r}")
            src = t.sources[0]
            if src.dtype in (FP8_DTYPE, torch.int8) and src.scale_key is None and not t.raw:
                raise CheckpointError(f"quantized tensor {src.key!r} ({'FP8' if src.dtype == FP8_DTYPE else 'MXFP4'}) "
                                      f"has no scale tensor")
            continue
        halves = 2 if t.name.endswith("gate_up_proj") else 1
        have = {(s.expert, s.half) for s in t.sources}
        experts = 1 + max(s.expert for s in t.sources)
        if spec.experts[1] == 1 and len(t.shape) == 3:
            experts = max(experts, t.shape[0])  # a missing last expert is missing, not a shape error
        for e in range(experts):
            for h in range(halves):
                if (e, h) not in have:
                    part = ("w1", "w3")[h] if halves == 2 else "w2"
                    layer = t.name.split(".")[2]
                    missing.append(f"'layers.{layer}.ffn.experts.{e}.{part}.weight' (model tensor {t.name!r})")
        for s in t.sources:
            if s.dtype in (FP8_DTYPE, torch.int8) and s.scale_key is None:
                raise CheckpointError(f"quantized tensor {s.key!r} has no scale tensor")
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]}{more}")


def _released_name(t: _Target, arch: str) -> str:
    """The released name of (the first piece of) a model tensor, for error messages."""
    if arch != V4:
        return to_released(t.name, arch)
    try:
        return v4_hf_to_released(t.name, t.shape[0] if len(t.shape) == 3 else None)[0]
    except (UnknownTensorName, ValueError):
        return t.name


def _check_target(t: _Target, spec: ShardSpec) -> None:
    full = _target_full_shape(t)
    if t.sources[0].expert is not None:
        per = {_logical_shape(s) for s in t.sources}
        if len(per) > 1:
            raise CheckpointError(f"experts of model tensor {t.name!r} have different shapes: {sorted(per)}")
    try:
        shard(torch.empty(full, device="meta"), t.name, t.shape, *spec.for_tensor(t.name))
    except ShardingError as exc:
        where = t.sources[0].key if len(t.sources) == 1 else f"{len(t.sources)} expert tensors"
        raise CheckpointError(f"{exc} (checkpoint: {where})") from None


# ---- streaming --------------------------------------------------------------------------------
def _fp8_block(data_shape, scale_shape, config_block: tuple[int, int], key: str) -> tuple[int, int]:
    block = []
    for n, s, b in zip(data_shape[-2:], scale_shape[-2:], config_block):
        if -(-n // b) == s:
            block.append(b)
        elif s == n:
            block.append(1)
        elif s and n % s == 0:
            block.append(n // s)
        else:
            raise CheckpointError(
                f"scale of {key!r} has shape {list(scale_shape)}, which fits no block of {list(data_shape)}")
    return block[0], block[1]


def _read(files: CheckpointFiles, key: str, rows: tuple[int, int] | None) -> torch.Tensor:
    if rows is None:
        return files.get(key)
    return files.slice(key)[rows[0]:rows[1]]


def _read_source(plan: V4CheckpointPlan, files: CheckpointFiles, src: _Source, rows) -> torch.Tensor | QuantizedWeight:
    """One stored tensor, as a plain tensor or (quantized) a QuantizedWeight."""
    if not src.quantized:
        return _read(files, src.key, rows)
    scale_shape = plan.headers[src.scale_key][0]
    if src.dtype == torch.int8:
        group = 2 * src.shape[-1] // scale_shape[-1]
        fmt, block = MXFP4, (1, group)
    else:
        fmt, block = FP8_BLOCK, _fp8_block(src.shape, scale_shape, plan.block, src.key)
    scale_rows = rows if block[0] == 1 else None  # _rows_for only cuts per-row scales
    return QuantizedWeight(_read(files, src.key, rows), _read(files, src.scale_key, scale_rows), fmt, block)


def _rows_for(plan: V4CheckpointPlan, t: _Target) -> tuple[int, int] | None:
    """The rows of a vocab-parallel tensor this rank reads from disk (None: all of them)."""
    spec, src = plan.shard, t.sources[0]
    if spec.world_size == 1 or sharding_rule(t.name) != VOCAB_ROWS or src.expert is not None:
        return None
    full = _target_full_shape(t)
    if tuple(full) == tuple(t.shape):
        return None
    if src.quantized and plan.headers[src.scale_key][0][0] != src.shape[0]:
        return None  # scales cover row blocks: read all, cut after
    start, stop, _ = vocab_rows_range(full[0], spec.rank, spec.world_size)
    return start, stop


def stored_mxfp4_experts(model_dir: str) -> bool:
    """Whether a V4.1 checkpoint stores its routed experts as MXFP4 (int8 bytes with a scale),
    from the header of its first per-expert ``w1`` (no data read)."""
    files = CheckpointFiles(model_dir)
    try:
        for key in files.files:
            if ".experts." in key and key.endswith(".w1.weight"):
                return files.slice(key).get_dtype() == "I8"
    finally:
        files.close()
    return False


def stored_fp8_blocks(model_dir: str, weights: re.Pattern, block: tuple[int, int]) -> bool:
    """Whether every checkpoint tensor whose released name ``weights`` matches is stored as e4m3
    with a ``.scale`` of one scale per ``block`` (and there is at least one), from the headers."""
    files = CheckpointFiles(model_dir)
    try:
        found = False
        for key in files.files:
            if not weights.search(to_released(key, V41)):
                continue
            scale = key[: -len("weight")] + "scale"
            if files.slice(key).get_dtype() != "F8_E4M3" or scale not in files.files:
                return False
            n, k = files.slice(key).get_shape()
            if tuple(files.slice(scale).get_shape()) != (-(-n // block[0]), -(-k // block[1])):
                return False
            found = True
        return found
    finally:
        files.close()


def _materialize(plan: V4CheckpointPlan, files: CheckpointFiles, t: _Target, keep_quantized: bool):
    """Read the target's stored tensor(s); returns (value, whether it still needs cutting)."""
    spec = plan.shard
    if t.sources[0].expert is None:
        rows = _rows_for(plan, t)
        value = _read_source(plan, files, t.sources[0], rows)
        if rows is None:
            return _finish(t, value, keep_quantized), True
        return _finish(t, pad_rows(value, t.shape[0]), keep_quantized), False  # already this rank's rows
    full = _target_full_shape(t)
    experts = range(full[0])
    rank, world = spec.experts
    if world > 1 and t.shape[0] != full[0]:  # EP: read only this rank's experts
        n = full[0] // world
        experts = range(rank * n, (rank + 1) * n)
    by_key = {(s.expert, s.half): s for s in t.sources}
    halves = 1 + max(s.half for s in t.sources)
    stacked = []
    for e in experts:
        parts = [_read_source(plan, files, by_key[(e, h)], None) for h in range(halves)]
        if not keep_quantized:
            parts = [p.dequantize(t.dtype) if isinstance(p, QuantizedWeight) else p.to(t.dtype) for p in parts]
        stacked.append(_cat_parts(parts, 0))
    return _finish(t, _stack(stacked), keep_quantized), len(experts) == full[0]


def _cat_parts(parts, dim):
    if isinstance(parts[0], QuantizedWeight):
        q = parts[0]
        return QuantizedWeight(torch.cat([p.data for p in parts], dim), torch.cat([p.scale for p in parts], dim),
                               q.format, q.block)
    return torch.cat(parts, dim)


def _stack(items):
    if isinstance(items[0], QuantizedWeight):
        q = items[0]
        return QuantizedWeight(torch.stack([i.data for i in items]), torch.stack([i.scale for i in items]),
                               q.format, q.block)
    return torch.stack(items)


def _finish(t: _Target, value, keep_quantized: bool):
    """Dequantize (unless kept quantized) and cast to the model's dtype."""
    if isinstance(value, QuantizedWeight):
        if t.raw:  # values and scale go to separate model tensors
            value = value.data
        elif not keep_quantized:
            value = value.dequantize(t.dtype)
    if isinstance(value, QuantizedWeight) or value.dtype == t.dtype:
        return value
    if keep_quantized and value.dtype in (FP8_DTYPE, E8M0_DTYPE, torch.int8):
        return value  # stored form (a raw engram table or its scales)
    if value.dtype == E8M0_DTYPE:
        value = e8m0_to_float(value)
    return value.to(t.dtype)


def iter_v4_weights(
    model_dir: str,
    expected: Mapping,
    keep_quantized: bool | Callable[[str], bool] = False,
    shard_spec: ShardSpec | None = None,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield ``(hf_name, tensor or QuantizedWeight)`` for every expected tensor, one at a time;
    ``keep_quantized``: for all tensors, or a predicate on the model tensor's name."""
    plan = plan_v4_checkpoint(model_dir, expected, shard_spec)
    for category, (count, nbytes) in plan.skipped.items():
        if count:
            logger.info("skipping %d %s tensors (%.1f MB): not part of the backbone", count, category, nbytes / 1e6)
    files = CheckpointFiles(model_dir)
    targets = plan.targets
    if progress:
        from tqdm import tqdm

        targets = tqdm(targets, desc="Loading weights", unit="tensor", leave=False)
    try:
        for t in targets:
            keep = keep_quantized(t.name) if callable(keep_quantized) else keep_quantized
            value, cut = _materialize(plan, files, t, keep)
            try:
                if cut:
                    value = shard(value, t.name, t.shape, *plan.shard.for_tensor(t.name))
                elif tuple(value.shape) != tuple(t.shape):
                    raise ShardingError(f"tensor {t.name!r}: expected shape {list(t.shape)}, found {list(value.shape)}")
            except ShardingError as exc:
                raise CheckpointError(str(exc)) from None
            yield t.name, value.to(device)
    finally:
        files.close()


def load_v4_weights(model_dir: str, expected: Mapping, **kwargs) -> dict[str, torch.Tensor | QuantizedWeight]:
    """:func:`iter_v4_weights` collected into a dict."""
    return dict(iter_v4_weights(model_dir, expected, **kwargs))


@torch.no_grad()
def load_v4_into_module(module: torch.nn.Module, model_dir: str, **kwargs) -> None:
    """Copy a checkpoint into ``module``'s parameters and buffers (dequantized), one tensor at
    a time; names and shapes are checked against the headers before anything is read."""
    state = module.state_dict(keep_vars=True)
    for name, value in iter_v4_weights(model_dir, {k: v for k, v in state.items()}, **kwargs):
        state[name].copy_(value)


def read_v4_config(model_dir: str, model_types: tuple[str, ...]):
    """``config.json`` parsed by :func:`model.config.parse_model_config`; a checkpoint of another
    model type is one :class:`CheckpointError` line."""
    from model.config import ConfigError, parse_model_config

    raw = read_config_json(model_dir)
    if raw.get("model_type") not in model_types:
        raise CheckpointError(f"{model_dir!r} holds model_type {raw.get('model_type')!r}, "
                              f"expected {' or '.join(model_types)}")
    try:
        return parse_model_config(raw)
    except ConfigError as exc:
        raise CheckpointError(f"{os.path.join(model_dir, 'config.json')}: {exc}") from None
