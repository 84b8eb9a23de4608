"""The test-checkpoint tokenizer: exact size, determinism, and agreement with transformers."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from model.tokenizer_builder import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    MIN_VOCAB_SIZE,
    USER_TOKEN,
    build_test_tokenizer,
    synthetic_corpus,
)
from server.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SENTENCES = [
    "Hello world! The answer is 12345 + 678 = 13023.",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Café naïve Zürich — déjà vu…",
    "日本語のテキストと中文句子，还有한국어.",
    "emoji 😀🚀 👍🏽 family 👨‍👩‍👧 flag 🇯🇵 done",
    "def f(x):\n    return x ** 2  # comment",
    "<think>reasoning</think> then <｜User｜> literal",
]


def file_digest(directory: str) -> str:
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(directory, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tok1000"))
    build_test_tokenizer(1000, path)
    return path


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 300, 1000, 5000])
def test_exact_vocab_size_and_special_ids(tmp_path, vocab_size):
    build_test_tokenizer(vocab_size, str(tmp_path))
    tok = Tokenizer.from_pretrained(str(tmp_path))
    assert tok.vocab_size == vocab_size
    assert tok.token_to_id(BOS_TOKEN) == 0 and tok.token_to_id(EOS_TOKEN) == 1
    assert tok.token_to_id(USER_TOKEN) is not None and tok.token_to_id(ASSISTANT_TOKEN) is not None
    with open(tmp_path / "tokenizer.json", encoding="utf-8") as f:
        data = json.load(f)
    ids = set(data["model"]["vocab"].values()) | {t["id"] for t in data["added_tokens"]}
    assert ids == set(range(vocab_size))  # dense ids, nothing past vocab_size
    text = "round trip 你好 😀"
    assert tok.decode(tok.encode(text)) == text


def test_too_small_vocab_is_refused(tmp_path):
    with pytest.raises(ValueError, match=f">= {MIN_VOCAB_SIZE}"):
        build_test_tokenizer(MIN_VOCAB_SIZE - 1, str(tmp_path))
    with pytest.raises(ValueError):
        build_test_tokenizer("300", str(tmp_path))


def test_larger_vocab_learns_more_merges(tmp_path):
    build_test_tokenizer(300, str(tmp_path / "small"))
    build_test_tokenizer(3000, str(tmp_path / "large"))
    small = Tokenizer.from_pretrained(str(tmp_path / "small"))
    large = Tokenizer.from_pretrained(str(tmp_path / "large"))
    text = " ".join(synthetic_corpus(200, seed=1))
    assert len(large.encode(text)) < 0.7 * len(small.encode(text))


def test_deterministic_bytes(built, tmp_path):
    build_test_tokenizer(1000, str(tmp_path / "again"))
    assert file_digest(str(tmp_path / "again")) == file_digest(built)
    # Also in a fresh interpreter (hash seeds, thread scheduling of the trainer differ).
    out = str(tmp_path / "subprocess")
    code = f"from model.tokenizer_builder import build_test_tokenizer; build_test_tokenizer(1000, {out!r})"
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, timeout=120)
    assert file_digest(out) == file_digest(built)


def test_config_fields_and_custom_template(built, tmp_path):
    with open(os.path.join(built, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert cfg["bos_token"] == BOS_TOKEN and cfg["eos_token"] == EOS_TOKEN
    assert cfg["add_bos_token"] is True and cfg["model_max_length"] > 0
    assert "<｜User｜>" in cfg["chat_template"] and "add_generation_prompt" in cfg["chat_template"]
    build_test_tokenizer(300, str(tmp_path), chat_template="{{ messages[0]['content'] }}!")
    tok = Tokenizer.from_pretrained(str(tmp_path))
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"


def test_agrees_with_transformers(built):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(built)
    ours = Tokenizer.from_pretrained(built)
    assert len(hf) == ours.vocab_size
    assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)
    for text in SENTENCES:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert hf.encode(text, add_special_tokens=special) == ids, (text, special)
        ids = ours.encode(text)
        assert ids[0] == ours.bos_token_id
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text.replace(USER_TOKEN, "")
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False) == \
            BOS_TOKEN + text
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "和 3+3?"},
    ]
    for gen in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == \
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
