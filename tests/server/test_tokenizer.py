"""Tokenizer loading, chat templates and the incremental detokenizer (on a built test tokenizer)."""

from __future__ import annotations

import json
import os
import random

import pytest

from model.tokenizer_builder import ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, USER_TOKEN, build_test_tokenizer
from server.errors import InvalidRequestError
from server.tokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer, Tokenizer, TokenizerLoadError

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tok"))
    build_test_tokenizer(600, path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tok_dir)


def copy_dir(src: str, dst: str, edit_tokenizer=None, edit_config=None) -> str:
    os.makedirs(dst, exist_ok=True)
    for name, edit in (("tokenizer.json", edit_tokenizer), ("tokenizer_config.json", edit_config)):
        with open(os.path.join(src, name), encoding="utf-8") as f:
            data = json.load(f)
        if edit:
            edit(data)
        with open(os.path.join(dst, name), "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False)
    return dst


# -- loading -----------------------------------------------------------------------------------

def test_load_errors_name_the_missing_file(tmp_path, tok_dir):
    with pytest.raises(TokenizerLoadError, match="not found"):
        Tokenizer.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        Tokenizer.from_pretrained(str(tmp_path))
    d = copy_dir(tok_dir, str(tmp_path / "only_json"))
    os.remove(os.path.join(d, "tokenizer_config.json"))
    with pytest.raises(TokenizerLoadError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(d)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    (tmp_path / "bad" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerLoadError, match="cannot load"):
        Tokenizer.from_pretrained(str(tmp_path / "bad"))


def test_special_tokens_and_sizes(tok):
    assert tok.vocab_size == len(tok) == 600
    assert (tok.bos_token, tok.bos_token_id) == (BOS_TOKEN, 0)
    assert (tok.eos_token, tok.eos_token_id) == (EOS_TOKEN, 1)
    user, assistant = tok.token_to_id(USER_TOKEN), tok.token_to_id(ASSISTANT_TOKEN)
    assert {0, 1, user, assistant} <= tok.special_token_ids
    assert tok.token_to_id("<think>") not in tok.special_token_ids
    assert tok.model_max_length == 16384
    assert tok.convert_ids_to_tokens([0, user]) == [BOS_TOKEN, USER_TOKEN]


def test_encode_adds_bos_once(tok, tmp_path, tok_dir):
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.encode("Hello world", add_special_tokens=False) == ids[1:]
    # Without a BOS-adding post-processor, tokenizer_config's add_bos_token decides.
    def no_post_processor(data):
        data["post_processor"] = None
    d = copy_dir(tok_dir, str(tmp_path / "nopp"), edit_tokenizer=no_post_processor)
    assert Tokenizer.from_pretrained(d).encode("Hello world") == ids
    def no_add_bos(data):
        data["add_bos_token"] = False
    d = copy_dir(tok_dir, str(tmp_path / "nobos"), edit_tokenizer=no_post_processor, edit_config=no_add_bos)
    assert Tokenizer.from_pretrained(d).encode("Hello world") == ids[1:]


def test_decode_and_special_tokens(tok):
    text = "Héllo 世界 🙂 done"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == BOS_TOKEN + text
    think = tok.encode("<think>x</think>", add_special_tokens=False)
    assert tok.decode(think) == "<think>x</think>"  # ordinary added tokens are never skipped


def test_token_to_text(tok):
    ids = tok.encode("the 世", add_special_tokens=False)
    pieces = [tok.token_to_text(i) for i in ids]
    assert "".join(pieces).startswith("the ")  # ASCII tokens show their own text
    assert FFFD in pieces  # a byte token of a CJK character alone is not a character
    assert tok.token_to_text(tok.eos_token_id) == EOS_TOKEN


# -- chat template -----------------------------------------------------------------------------

def test_chat_template_renders_deepseek_layout(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
    ]
    assert tok.apply_chat_template(messages) == (
        f"{BOS_TOKEN}Be brief.{USER_TOKEN}Hi{ASSISTANT_TOKEN}Hello{EOS_TOKEN}{USER_TOKEN}2+2?{ASSISTANT_TOKEN}")
    assert tok.apply_chat_template(messages[:2], add_generation_prompt=False) == f"{BOS_TOKEN}Be brief.{USER_TOKEN}Hi"


def test_chat_template_errors_and_overrides(tok, tmp_path, tok_dir):
    with pytest.raises(InvalidRequestError, match="Unsupported message role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    custom = "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ extra }}]{% endfor %}{{ messages | tojson }}"
    assert tok.apply_chat_template([{"role": "user", "content": "é"}], chat_template=custom, extra=7) == \
        '[user|é|7][{"role": "user", "content": "é"}]'
    with pytest.raises(InvalidRequestError, match="syntax"):
        tok.apply_chat_template([], chat_template="{% if %}")
    # The sandbox refuses attribute walks to Python internals.
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")

    def drop_template(data):
        data.pop("chat_template")
    d = copy_dir(tok_dir, str(tmp_path / "notemplate"), edit_config=drop_template)
    plain = Tokenizer.from_pretrained(d)
    assert plain.chat_template is None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "x"}])
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("J{{ messages[0].content }}")
    assert Tokenizer.from_pretrained(d).apply_chat_template([{"role": "user", "content": "x"}]) == "Jx"

    def named_templates(data):
        data["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    d = copy_dir(tok_dir, str(tmp_path / "named"), edit_config=named_templates)
    assert Tokenizer.from_pretrained(d).apply_chat_template([]) == "D"


# -- incremental detokenizer -------------------------------------------------------------------

ALPHABET = (list("abcdefghij klmnop,.!?\n0123456789") + list("éüñçøßÅ") + list("世界你好日本語東京한국")
            + ["😀", "🚀", "👍🏽", "👨‍👩‍👧", "🇯🇵", "∑", "€", "\u0301"])


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None):
    """Feed ``ids`` in chunks; return (deltas, stop string hit)."""
    deltas, hit, pos = [], None, 0
    for size in chunks or [1] * len(ids):
        delta, hit = detok.add_tokens(ids[pos:pos + size])
        pos += size
        deltas.append(delta)
        if hit is not None:
            break
    return deltas, hit


def test_detokenizer_random_unicode_never_emits_partial_characters(tok):
    rng = random.Random(0)
    for trial in range(60):
        text = random_text(rng, rng.randint(1, 40))
        prompt = tok.encode(random_text(rng, rng.randint(0, 10)))
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt)
        if trial % 2:
            chunks, left = [], len(ids)
            while left:
                chunks.append(min(left, rng.randint(1, 4)))
                left -= chunks[-1]
        else:
            chunks = None
        deltas, hit = stream(detok, ids, chunks)
        assert hit is None
        assert all(FFFD not in d for d in deltas)
        assert "".join(deltas) == detok.text == tok.decode(ids) == text
        assert detok.flush() == ""


def test_rust_stream_and_python_window_give_the_same_deltas(tok):
    """The detokenizer steps tokenizers' DecodeStream; the Python window it falls back to must
    cut the same deltas, on random ids (split characters, special tokens) either way of skipping."""
    rng = random.Random(1)
    for trial in range(40):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))]
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
        skip = bool(trial % 2)
        rust, python = IncrementalDetokenizer(tok, prompt, skip), IncrementalDetokenizer(tok, prompt, skip)
        python._stream = None
        assert (rust._stream is None) == (FFFD in tok.decode(prompt[-PROMPT_CONTEXT_TOKENS:], skip))
        assert [rust.add_tokens([i])[0] for i in ids] == [python.add_tokens([i])[0] for i in ids]
        assert rust.flush() == python.flush() and rust.text == python.text


def test_a_refused_stream_window_falls_back_mid_request(tok):
    class Refusing:
        def __init__(self, after):
            self.inner, self.left = tok.decode_stream([]), after

        def step(self, backend, token_id):
            self.left -= 1
            if self.left < 0:
                raise Exception("prefix mismatch")  # what the Rust library raises
            return self.inner.step(backend, token_id)

    text = "héllo wörld 世界, again"
    ids = tok.encode(text, add_special_tokens=False)
    for after in range(len(ids)):
        detok = IncrementalDetokenizer(tok, [])
        detok._stream = Refusing(after)
        assert "".join(stream(detok, ids)[0]) + detok.flush() == text
        assert detok._stream is None or after >= len(ids)


def test_detokenizer_holds_back_split_characters(tok):
    ids = tok.encode("世", add_special_tokens=False)
    assert len(ids) > 1  # a CJK character is several byte tokens in a 600-token vocab
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id])
    assert [detok.add_tokens([i])[0] for i in ids] == [""] * (len(ids) - 1) + ["世"]


def test_flush_releases_an_incomplete_character(tok):
    ids = tok.encode("a世", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(stream(detok, ids)[0]) == "a"
    assert detok.flush().endswith(FFFD)
    assert detok.text == tok.decode(ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tok, include):
    text = "the answer is 42 and then more text follows"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    stop = "42 and th"
    start = text.index(stop)
    # The stop string begins inside or at one token and ends several tokens later.
    ends = [sum(len(p) for p in pieces[:j + 1]) for j in range(len(pieces))]
    assert sum(start < e < start + len(stop) for e in ends) >= 2
    detok = IncrementalDetokenizer(tok, tok.encode("Q:"), stop=["zzz", stop], include_stop_str_in_output=include)
    deltas, hit = stream(detok, ids)
    assert hit == stop and detok.stop_reason == stop
    expected = text[:start + len(stop)] if include else text[:start]
    assert "".join(deltas) == detok.text == expected
    assert detok.add_tokens(tok.encode(" more", add_special_tokens=False)) == ("", None)
    assert detok.flush() == "" and detok.text == expected


def test_stop_prefix_is_held_then_released(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["abcX"])
    deltas = [detok.add_tokens([i])[0] for i in tok.encode("xyabc", add_special_tokens=False)]
    assert "".join(deltas) == "xy"  # "abc" could still become "abcX"
    delta, hit = detok.add_tokens(tok.encode("d", add_special_tokens=False))
    assert (delta, hit) == ("abcd", None)
    assert detok.text == "xyabcd"


def test_flush_releases_a_held_stop_prefix(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["\n\n"])
    deltas, hit = stream(detok, tok.encode("one\n", add_special_tokens=False))
    assert "".join(deltas) == "one" and hit is None
    assert detok.flush() == "\n" and detok.text == "one\n"


def test_earliest_stop_string_wins(tok):
    text = "alpha beta gamma"
    detok = IncrementalDetokenizer(tok, [], stop=["gamma", "beta", "ta g"])
    deltas, hit = detok.add_tokens(tok.encode(text, add_special_tokens=False))
    assert hit == "beta" and deltas == detok.text == "alpha "


def test_stop_string_of_split_characters(tok):
    text = "abc 你好世界 tail"
    detok = IncrementalDetokenizer(tok, [], stop=["好世"])
    deltas, hit = stream(detok, tok.encode(text, add_special_tokens=False))
    assert hit == "好世" and "".join(deltas) == "abc 你"
    assert all(FFFD not in d for d in deltas)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi there", add_special_tokens=False) + [tok.eos_token_id]
    user = tok.token_to_id(USER_TOKEN)
    ids = [user] + ids
    skip = IncrementalDetokenizer(tok, [tok.bos_token_id])
    assert "".join(stream(skip, ids)[0]) == "hi there"
    keep = IncrementalDetokenizer(tok, [tok.bos_token_id], skip_special_tokens=False)
    assert "".join(stream(keep, ids)[0]) == f"{USER_TOKEN}hi there{EOS_TOKEN}" == keep.text


def test_included_stop_string_needs_no_holdback(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["abcX"], include_stop_str_in_output=True)
    deltas = [detok.add_tokens([i])[0] for i in tok.encode("xyabc", add_special_tokens=False)]
    assert "".join(deltas) == "xyabc"  # whatever follows, this text stays in the output
    delta, hit = detok.add_tokens(tok.encode("X tail", add_special_tokens=False))
    assert hit == "abcX" and delta == "X" and detok.text == "xyabcX"
