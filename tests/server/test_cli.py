"""The ``mlaserve`` CLI: vLLM's flags and spellings, one EngineConfig, sub-command registry."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

import server.api
from server.cli import (
    SERVE, Subcommand, bundled_model_dir, discover_subcommands, main, normalize_argv, parse_args,
    parse_serve_args,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED_LAUNCH_LINE = (
    "--dtype auto --kv-cache-dtype fp8 --tensor-parallel-size 8 --swap-space 16 --max-num-seqs 1024 "
    "--trust-remote-code --max-model-len 10240 --gpu-memory-utilization 0.95 --max-num-batched-tokens 16384 "
    "--async-scheduling --max-cudagraph-capture-size 1024 --compilation_config.cudagraph_mode FULL_DECODE_ONLY"
)


def parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_serve_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_seed_launch_line_parses_verbatim():
    args = parse_serve_args(SEED_LAUNCH_LINE.split())
    c = args.engine_config
    assert (c.dtype, c.kv_cache_dtype, c.tensor_parallel_size, c.swap_space) == ("auto", "fp8", 8, 16.0)
    assert (c.max_num_seqs, c.max_model_len, c.max_num_batched_tokens) == (1024, 10240, 16384)
    assert c.trust_remote_code and c.async_scheduling and c.use_fp8_kv_cache
    assert (c.gpu_memory_utilization, c.max_cudagraph_capture_size, c.cudagraph_mode) == \
        (0.95, 1024, "FULL_DECODE_ONLY")
    assert c.model == bundled_model_dir() and c.model.endswith(os.path.join("configs", "arith"))
    notes = "\n".join(args.notes)
    assert "--swap-space" in notes and "--trust-remote-code" in notes


@pytest.mark.parametrize("flag", ["--no-such-flag", "--max_modl_len"])
def test_unknown_flag_is_an_error_naming_it(capsys, flag):
    err = parse_error(["--max-model-len", "64", flag, "3"], capsys)
    assert f"unrecognized arguments: {flag}" in err
    if flag == "--max_modl_len":
        assert "did you mean --max-model-len" in err


def test_unknown_flag_through_main(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--bogus-flag"])
    assert exc.value.code == 2 and "--bogus-flag" in capsys.readouterr().err


def test_spellings_underscore_equals_and_short_flags():
    a = parse_serve_args(["--max_model_len=512", "--max-num-seqs", "8", "-tp", "2", "-dp", "4",
                          "--enable_expert_parallel", "--block_size=32"]).engine_config
    assert (a.max_model_len, a.max_num_seqs, a.tensor_parallel_size, a.data_parallel_size) == (512, 8, 2, 4)
    assert a.enable_expert_parallel and a.block_size == 32 and a.world_size == 8


@pytest.mark.parametrize("argv,mode", [
    (["--compilation-config", '{"cudagraph_mode": "NONE"}'], "NONE"),
    (["--compilation_config", '{"cudagraph_mode": "NONE"}'], "NONE"),
    (["--compilation-config.cudagraph_mode", "NONE"], "NONE"),
    (["--compilation_config.cudagraph_mode=NONE"], "NONE"),
    (["--compilation-config.cudagraph-mode", "NONE"], "NONE"),
    (["-O.cudagraph_mode=NONE"], "NONE"),
    (["-O", '{"cudagraph_mode": "NONE"}'], "NONE"),
    (["--compilation-config", '{"cudagraph_mode": "NONE"}', "--compilation-config.cudagraph_mode",
      "FULL_DECODE_ONLY"], "FULL_DECODE_ONLY"),
    (["--compilation-config.cudagraph_mode", "FULL_AND_PIECEWISE"], "FULL_DECODE_ONLY"),
])
def test_compilation_config_forms(argv, mode):
    assert parse_serve_args(argv).engine_config.cudagraph_mode == mode


def test_compilation_config_capture_sizes_and_ignored_keys():
    args = parse_serve_args(["--compilation-config", '{"level": 3, "cudagraph_capture_sizes": [1, 8, 4]}',
                             "--compilation-config.pass_config.enable_fusion", "true", "-O3"])
    c = args.engine_config
    assert c.max_cudagraph_capture_size == 8 and c.cudagraph_capture_sizes == (1, 4, 8)
    assert c.optimization_level == 3 and c.cudagraph_mode == "FULL_DECODE_ONLY"
    notes = "\n".join(args.notes)
    assert "level, pass_config" in notes and "-O3" in notes


@pytest.mark.parametrize("argv,needle", [
    (["--compilation-config.cudagraph_mode", "BOGUS"], "cudagraph_mode"),
    (["--compilation-config.cudagraph_mod", "NONE"], "unknown key(s) cudagraph_mod"),
    (["--compilation-config", "[1, 2]"], "--compilation-config"),
    (["--compilation-config.cudagraph_mode"], "expects a value"),
    (["--max-cudagraph-capture-size", "8", "--compilation-config.max_cudagraph_capture_size", "16"], "contradicts"),
    (["--kv-cache-dtype", "int8"], "--kv-cache-dtype"),
    (["--block-size", "48"], "--block-size"),
    (["--max-model-len", "10x"], "--max-model-len"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["/a/model", "--model", "/b/model"], "disagree"),
])
def test_bad_values_name_the_flag(capsys, argv, needle):
    assert needle in parse_error(argv, capsys)


@pytest.mark.parametrize("text,value", [("10240", 10240), ("10k", 10000), ("8K", 8192), ("1.5k", 1500),
                                        ("2M", 2 * 1024 ** 2)])
def test_human_readable_ints(text, value):
    assert parse_serve_args(["--max-model-len", text]).engine_config.max_model_len == value


def test_boolean_flags_and_their_negations():
    c = parse_serve_args(["--no-enable-prefix-caching", "--async-scheduling", "--no-enable-chunked-prefill",
                          "--enforce-eager"]).engine_config
    assert not c.enable_prefix_caching and c.async_scheduling and not c.enable_chunked_prefill and c.enforce_eager
    c = parse_serve_args(["--no-async-scheduling"]).engine_config
    assert c.enable_prefix_caching and not c.async_scheduling


def test_defaults_come_from_engine_config():
    from server.config import EngineConfig

    got, default = parse_serve_args([]).engine_config, EngineConfig()
    for name in ("max_num_seqs", "block_size", "dtype", "kv_cache_dtype", "cudagraph_mode", "master_port"):
        assert getattr(got, name) == getattr(default, name)


def test_model_positional_or_flag(tmp_path):
    assert parse_serve_args([str(tmp_path)]).engine_config.model == str(tmp_path)
    assert parse_serve_args(["--model", str(tmp_path)]).engine_config.model == str(tmp_path)
    assert parse_serve_args([str(tmp_path), "--model", str(tmp_path)]).engine_config.model == str(tmp_path)


def test_server_flags_served_names_and_distributed():
    args = parse_serve_args(["--host", "127.0.0.1", "--port", "9001", "--served-model-name", "r1", "deepseek",
                             "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                             "--master-port", "4000", "--uvicorn-log-level", "warning", "--disable-log-stats",
                             "--enable-log-requests"])
    c = args.engine_config
    assert (args.host, args.port, args.uvicorn_log_level, args.log_stats, args.log_requests) == \
        ("127.0.0.1", 9001, "warning", False, True)
    assert c.served_model_name == "r1" and c.served_model_names == ("r1", "deepseek")
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port) == (2, 1, "10.0.0.1", 4000)


def test_api_key_flag_and_environment(monkeypatch):
    monkeypatch.delenv("MLASERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert parse_serve_args([]).api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert parse_serve_args([]).api_key == "from-vllm"
    monkeypatch.setenv("MLASERVE_API_KEY", "from-mlaserve")
    assert parse_serve_args([]).api_key == "from-mlaserve"
    assert parse_serve_args(["--api-key", "flag"]).api_key == "flag"


def test_gpu_only_flags_are_noted_on_cpu_not_on_cuda():
    argv = ["--gpu-memory-utilization", "0.5", "--enforce-eager"]
    cpu = "\n".join(parse_serve_args(argv + ["--device", "cpu"]).notes)
    assert "--gpu-memory-utilization, --enforce-eager: do not apply on CPU" in cpu
    assert not parse_serve_args(argv + ["--device", "cuda"]).notes


def test_normalize_argv_leaves_values_alone():
    argv, typed = normalize_argv(["--served_model_name", "my_model", "--model=/x/y_z", "-tp", "2"])
    assert argv == ["--served-model-name", "my_model", "--model=/x/y_z", "-tp", "2"]
    assert typed["--served-model-name"] == "--served_model_name"


def test_help_names_the_bundled_model(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "bundled" in out and "configs/arith" in out


def test_serve_runs_the_server_with_the_parsed_config(monkeypatch, tmp_path, caplog):
    seen = {}

    async def fake_run_server(config, host, port, api_key=None, **kw):
        seen.update(config=config, host=host, port=port, api_key=api_key, **kw)
        return 0

    monkeypatch.setattr(server.api, "run_server", fake_run_server)
    with caplog.at_level(logging.INFO, logger="mlaserve"):
        rc = main(["serve", str(tmp_path), "--port", "8123", "--api-key", "k", "--swap-space", "4"])
    assert rc == 0 and seen["port"] == 8123 and seen["api_key"] == "k" and seen["config"].model == str(tmp_path)
    assert seen["log_stats"] and not seen["log_requests"]
    assert sum("--swap-space" in r.getMessage() for r in caplog.records) == 1


def test_python_dash_m_server(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "server", "serve", str(tmp_path / "missing"), "--port", "0"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "model directory not found" in r.stderr


def test_subcommand_registry(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "fakecli"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cli_make_thing.py").write_text(textwrap.dedent("""
        from server.cli import Subcommand

        def add_arguments(p):
            p.add_argument("--size", type=int, required=True)

        def run(ns):
            print("made", ns.size)
            return 0

        SUBCOMMAND = Subcommand("make-thing", "make a thing", add_arguments, run)
    """))
    (pkg / "cli_broken.py").write_text("import no_such_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    subs = discover_subcommands("fakecli")
    assert [s.name for s in subs] == ["serve", "broken", "make-thing"]
    ns = parse_args(["make-thing", "--size", "3"], subcommands=subs)
    assert ns._run(ns) == 0 and "made 3" in capsys.readouterr().out
    ns = parse_args(["broken"], subcommands=subs)
    assert ns._run(ns) == 1 and "no_such_module_anywhere" in capsys.readouterr().err
    assert isinstance(SERVE, Subcommand) and [s.name for s in discover_subcommands()][0] == "serve"


def test_compilation_config_json_round_trip():
    cc = {"cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 256}
    c = parse_serve_args(["--compilation-config", json.dumps(cc)]).engine_config
    assert c.max_cudagraph_capture_size == 256 and c.cudagraph_mode == "FULL_DECODE_ONLY"


# ----------------------------------------------------------------------------- one flag table


def _options(add) -> dict[str, str]:
    import argparse

    p = argparse.ArgumentParser()
    add(p)
    return {s: a.dest for a in p._actions for s in a.option_strings}


def test_serve_and_bench_throughput_share_the_engine_flag_table():
    from dataclasses import fields

    from server.cli import add_serve_arguments
    from server.cli_bench import add_throughput_arguments
    from server.config import EngineConfig
    from server.engine_args import ENGINE_FLAGS

    serve, bench = _options(add_serve_arguments), _options(add_throughput_arguments)
    config_fields = {f.name for f in fields(EngineConfig)}
    for flag in ENGINE_FLAGS:
        assert flag.dest in config_fields or flag.dest in ("compilation_config", "speculative_config"), flag
        for name in flag.names:
            assert serve[name] == flag.dest
            if not flag.serve_only:
                assert bench[name] == flag.dest, f"{name} missing from bench throughput"
    assert {"--max-model-len", "-tp", "--cuda-graph-sizes", "--compilation-config", "--kv-cache-dtype"} <= set(bench)
    assert "--seed" in bench and bench["--seed"] == "seed"  # bench's own: prompts and engine


def test_a_flag_added_to_the_table_appears_in_both(monkeypatch):
    import server.engine_args as ea
    from server.cli import add_serve_arguments
    from server.cli_bench import add_throughput_arguments

    new = ea.Flag(("--brand-new-knob",), "brand_new_knob", "execution", type=int, help="test")
    monkeypatch.setattr(ea, "ENGINE_FLAGS", ea.ENGINE_FLAGS + (new,))
    for add, serve in ((add_serve_arguments, True), (add_throughput_arguments, False)):
        import argparse

        p = argparse.ArgumentParser()
        add(p)
        ns = p.parse_args(["--brand-new-knob", "7"])
        kw, _ = ea.engine_kwargs_from_namespace(ns, serve=serve)
        assert kw["brand_new_knob"] == 7


@pytest.mark.parametrize("dtype", ["fp16", "float16", "half"])
def test_fp16_spellings_are_accepted_by_serve_bench_and_the_loader(dtype):
    import argparse

    import torch

    from model.config import load_model_config
    from model.loader import resolve_dtype
    from server.cli_bench import add_throughput_arguments

    assert parse_serve_args(["--dtype", dtype]).engine_config.dtype == dtype
    p = argparse.ArgumentParser()
    add_throughput_arguments(p)
    assert p.parse_args(["--dtype", dtype]).dtype == dtype
    config = load_model_config(bundled_model_dir())
    assert resolve_dtype(dtype, config, torch.device("cpu")) == torch.float16


def test_bench_throughput_rejects_unknown_flags_by_name(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "throughput", "--max_modl_len", "3"])
    assert exc.value.code == 2 and "--max_modl_len" in capsys.readouterr().err


def test_speculative_config_is_accepted_and_noted():
    args = parse_serve_args(["--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 1}'])
    assert any("speculative decoding is not supported" in n for n in args.notes)
    args = parse_serve_args(["--speculative-config.num_speculative_tokens", "1"])
    assert any("--speculative-config" in n for n in args.notes)
