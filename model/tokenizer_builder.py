"""Build a small DeepSeek-style byte-level BPE tokenizer for test checkpoints.

Test checkpoints (``mlaserve make-checkpoint``) need a real tokenizer with the same shape
as DeepSeek's: byte-level BPE, ``<｜begin▁of▁sentence｜>``/``<｜end▁of▁sentence｜>`` at ids 0
and 1, chat tokens, BOS added by the post-processor, and a chat template. The tokenizer is
trained on a synthetic corpus generated in code, so nothing is downloaded and the same
``vocab_size`` always yields the same file bytes.
"""

from __future__ import annotations

import json
import os
import random

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
# Trained-in special tokens, in id order (BOS = 0, EOS = 1).
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)
# Added after training as ordinary (non-special) tokens, as DeepSeek-R1 does.
THINK_TOKENS = ("<think>", "</think>")
NUM_BYTE_TOKENS = 256
MIN_VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS) + len(THINK_TOKENS)
MODEL_MAX_LENGTH = 16384
PLACEHOLDER_TOKEN = "<｜place▁holder▁no▁{}｜>"
CORPUS_SEED = 20240101
CORPUS_SENTENCES = 12000

# A DeepSeek-style conversation layout: BOS, the system prompt(s), then <｜User｜> and
# <｜Assistant｜> turns; finished assistant turns end with EOS. Content may be a string or
# a list of OpenAI content parts (only text parts are rendered).
DEFAULT_CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ render(message['content']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "<｜User｜>{{ render(message['content']) }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "<｜Assistant｜>{{ render(message['content']) }}<｜end▁of▁sentence｜>"
    "{%- elif message['role'] != 'system' -%}"
    "{{ raise_exception('Unsupported message role: ' ~ message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<｜Assistant｜>{%- endif -%}"
)

_WORDS = (
    "the of and to in a is that for it as was with be by on not he I this are or his from "
    "at which but have an had they you were their one all we can her has there been if more "
    "when will would who so no time people year way day man thing woman life child world "
    "school state family student group country problem hand part place case week company "
    "system program question work government number night point home water room mother "
    "area money story fact month lot right study book eye job word business issue side kind "
    "head house service friend father power hour game line end member law car city name "
    "model token answer server request result value small large good new first last long "
    "great little own other old big high different early young important few public bad "
    "same able make know take see come think look want give use find tell ask seem feel try "
    "leave call keep let begin show hear play run move live believe hold bring happen write "
    "provide sit stand lose pay meet include continue set learn change lead understand watch"
).split()
_UNICODE_WORDS = (
    "café naïve über façade jalapeño Zürich résumé señor crème déjà "
    "日本語 你好 世界 東京 中文 한국어 안녕 Привет мир Ελλάδα שלום مرحبا "
    "😀 🚀 👍 🎉 ❤️ ✨ 🙂 ∑ π ≈ ° € £ ¥"
).split()
_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "z", "br", "ch", "cr", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "rt", "st", "x")
_PUNCT = (".", ".", ".", "!", "?", ",", ";", ":")


def synthetic_corpus(num_sentences: int = CORPUS_SENTENCES, seed: int = CORPUS_SEED) -> list[str]:
    """English-ish sentences with numbers, arithmetic and a sprinkle of non-ASCII text."""
    rng = random.Random(seed)

    def pseudo_word() -> str:
        return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                       for _ in range(rng.randint(1, 3)))

    def word() -> str:
        r = rng.random()
        if r < 0.62:
            return rng.choice(_WORDS)
        if r < 0.85:
            return pseudo_word()
        if r < 0.95:
            return str(rng.randint(0, 10 ** rng.randint(1, 6)))
        return rng.choice(_UNICODE_WORDS)

    lines = []
    for _ in range(num_sentences):
        kind = rng.random()
        if kind < 0.1:
            a, b = rng.randint(0, 9999), rng.randint(0, 9999)
            lines.append(f"{a} + {b} = {a + b}")
        elif kind < 0.15:
            lines.append(f"def {pseudo_word()}(x):\n    return x * {rng.randint(2, 99)}\n")
        else:
            words = [word() for _ in range(rng.randint(3, 14))]
            words[0] = words[0].capitalize()
            lines.append(" ".join(words) + rng.choice(_PUNCT))
    return lines


def _train(vocab_size: int):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # Digits in groups of at most three (as DeepSeek does), then GPT-2 style byte-level words.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK_TOKENS),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    # A small corpus may run out of merges: pad with reserved tokens, as DeepSeek's vocab has.
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([AddedToken(PLACEHOLDER_TOKEN.format(i), special=True, normalized=False)
                                for i in range(missing)])
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def build_test_tokenizer(vocab_size: int, out_dir: str, chat_template: str | None = None) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for a ``vocab_size`` vocabulary.

    The result loads with both ``server.tokenizer.Tokenizer`` and
    ``transformers.AutoTokenizer``; ``chat_template`` replaces the default DeepSeek-style one.
    """
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be an integer >= {MIN_VOCAB_SIZE} ({NUM_BYTE_TOKENS} byte tokens + "
            f"{len(SPECIAL_TOKENS) + len(THINK_TOKENS)} special/chat tokens), got {vocab_size!r}")
    tok = _train(vocab_size)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:  # the trainer never overshoots; this guards future library changes
        raise RuntimeError(f"built a tokenizer of {got} tokens, expected {vocab_size}")
    os.makedirs(out_dir, exist_ok=True)
    tokenizer_json = json.loads(tok.to_str())
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_json, f, ensure_ascii=False, indent=1, sort_keys=False)
        f.write("\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": DEFAULT_CHAT_TEMPLATE if chat_template is None else chat_template,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
