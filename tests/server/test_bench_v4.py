"""``bench throughput`` on DeepSeek-V4 / V4.1 presets: --num-layers cuts them as valid models,
--load-format dummy runs them through the engine, and the report carries the KV cache's bytes
per token and the decode step's HBM roofline."""

from __future__ import annotations

import json
import logging
import re

import pytest

from model.checkpoint import load_config_dict
from model.config import parse_model_config
from model.v41.engram import EngramHasher, synthetic_compressed_token_map
from server.bench.throughput import PRESET_ENGRAM_ROWS, ModelSpecError, v4_preset_config
from server.cli import main


@pytest.mark.parametrize("preset", ["tiny-v41", "tiny-v4"])
def test_bench_throughput_runs_a_cut_v4_preset_with_random_weights(preset, tmp_path, capsys):
    out_json = tmp_path / "r.json"
    rc = main(["bench", "throughput", "--model", preset, "--num-layers", "2", "--load-format", "dummy",
               "--num-prompts", "3", "--input-len", "12", "--output-len", "3", "--device", "cpu",
               "--step-profile", "--disable-tqdm", "--output-json", str(out_json)])
    assert rc == 0
    out = capsys.readouterr().out
    assert re.search(r"^Total num output tokens:  9$", out, re.M)
    assert re.search(r"^KV cache: [\d.]+ bytes per token of context, \d+ fixed bytes per request$", out, re.M), out
    assert re.search(r"^Decode HBM roofline: .* ms at 4\.8 TB/s; measured .* ms per decode step", out, re.M), out
    result = json.loads(out_json.read_text())
    kv = result["kv_cache"]
    assert kv["bytes_per_token"] > 0 and kv["fixed_bytes_per_request"] > 0 and kv["max_concurrency"] >= 1
    r = result["decode_roofline"]
    decode = result["step_profile"]["kinds"]["decode-eager"]
    assert r["mean_decode_batch"] == pytest.approx(decode["mean_batch"])
    assert r["measured_mean_ms"] == pytest.approx(decode["mean_ms"])
    assert r["mean_context_tokens"] == pytest.approx(12 + 1.5)
    assert r["kv_bytes_per_request"] == pytest.approx(kv["bytes_per_token"] * 13.5 + kv["fixed_bytes_per_request"])
    assert r["weights"]["moe_layers"] == 2 and r["total_bytes"] > r["dense_bytes"] > 0


def test_bench_throughput_without_step_profile_reports_kv_sizes_only(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    assert main(["bench", "throughput", "--model", "tiny-v41", "--num-layers", "2", "--num-prompts", "1",
                 "--input-len", "4", "--output-len", "2", "--device", "cpu", "--disable-tqdm",
                 "--output-json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert "kv_cache" in result and "decode_roofline" not in result


def test_the_4_layer_v41_flash_cut_is_a_valid_model(caplog):
    with caplog.at_level(logging.INFO, logger="mlaserve.bench"):
        d = v4_preset_config(load_config_dict("deepseek-v41-flash"), 4)
    assert f"engram tables capped at {PRESET_ENGRAM_ROWS} rows" in caplog.text
    c = parse_model_config(d)
    assert c.num_hidden_layers == 4 and c.compress_ratios == (0, 0, 2, 2)
    assert (c.kv_source_layer_ids, c.index_source_layer_ids, c.candidate_source_layer_id) == ((2,), (2,), -1)
    assert [c.kv_source_of(i) for i in range(4)] == [None, None, 2, 2]
    assert c.index_source_of(3) == 2
    assert c.engram_layer_ids == (1,) and 1_000_000 < c.engram_num_embeddings[0] <= PRESET_ENGRAM_ROWS
    assert c.num_nextn_predict_layers == 0 and d["text_config"]["dspark_target_layer_ids"] == []
    # The hash addresses exactly the capped table (its primes start at the smaller engram_vocab_size).
    import torch

    hasher = EngramHasher(c, synthetic_compressed_token_map(c.vocab_size, c.engram_compressed_vocab_size))
    ids, _ = hasher(torch.randint(0, c.vocab_size, (4096,), generator=torch.Generator().manual_seed(0)), [])
    assert ids.max() < c.engram_num_embeddings[0] and ids.max() > 0.9 * c.engram_num_embeddings[0]


def test_the_4_layer_v4_flash_cut_is_a_valid_model():
    c = parse_model_config(v4_preset_config(load_config_dict("deepseek-v4-flash"), 4))
    assert c.layer_kinds == ("sliding", "sliding", "csa", "hca") and c.compress_ratios == (0, 0, 4, 128)
    assert c.hash_layers == (True, True, True, False) and c.num_nextn_predict_layers == 0


def test_full_v41_preset_is_capped_and_keeps_its_schedule():
    c = parse_model_config(v4_preset_config(load_config_dict("deepseek-v41-flash"), None))
    assert c.num_hidden_layers == 40 and c.candidate_source_layer_id == 20
    assert max(c.engram_num_embeddings) <= PRESET_ENGRAM_ROWS


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny-v41", "--num-layers", "9"], "--num-layers must be between 1 and 8, got 9"),
    (["--model", "deepseek-v4-flash", "--num-layers", "0"], "--num-layers: must be at least 1"),
    (["--model", "deepseek-v41-flash", "--num-layers", "2"],
     "--num-layers 2: the cut has sliding-window layers only, and the V4-family engine sizes its KV cache from "
     "the compressed layers; use at least 3"),
])
def test_bad_num_layers_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "throughput", "--device", "cpu", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_cut_that_is_no_valid_model_is_one_line():
    cfg = load_config_dict("tiny-v41")
    cfg["text_config"]["kv_source_layer_ids"] = [4]  # layers 1-3 compress but have no KV source
    cfg["text_config"]["index_source_layer_ids"] = [4]
    with pytest.raises(ModelSpecError, match=r"^--num-layers 5: the cut preset is not a valid model: layer 1 "):
        v4_preset_config(cfg, 5)
