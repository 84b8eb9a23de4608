"""Tokenizer (HF ``tokenizers`` + tokenizer_config.json), chat templates, incremental detokenizer.

We load ``tokenizer.json`` with the Rust ``tokenizers`` library directly rather than through
transformers: it is what transformers' fast tokenizers wrap, it loads in milliseconds, and
it keeps transformers out of the serving process.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache

from server.errors import InvalidRequestError

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded together with the first output tokens, so that decoders which
# depend on the previous token (leading-space handling) render the first delta correctly.
PROMPT_CONTEXT_TOKENS = 5


class TokenizerLoadError(ValueError):
    """The tokenizer files are missing or unreadable; the message names the file."""


def _token_content(value) -> str | None:
    """tokenizer_config.json stores special tokens as a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerLoadError(f"unrecognized special token entry in tokenizer_config.json: {value!r}")


def _pick_chat_template(value) -> str | None:
    """``chat_template`` is a string, or a list of {"name", "template"} (we use "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    raise TokenizerLoadError(f"unrecognized chat_template in tokenizer_config.json: {type(value).__name__}")


class Tokenizer:
    """A fast tokenizer plus the special-token and chat-template settings of its checkpoint."""

    def __init__(self, backend, *, bos_token: str | None = None, eos_token: str | None = None,
                 add_bos_token: bool = False, chat_template: str | None = None,
                 model_max_length: int | None = None):
        self._tok = backend
        self._tok.no_truncation()
        self._tok.no_padding()
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token is not None else None
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        # If tokenizer.json's post-processor already adds BOS we must not add it twice.
        self._post_processor_adds_bos = (
            self.bos_token_id is not None
            and backend.encode("a", add_special_tokens=True).ids[:1] == [self.bos_token_id]
            and backend.encode("a", add_special_tokens=False).ids[:1] != [self.bos_token_id]
        )
        self._special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        ) | {i for i in (self.bos_token_id, self.eos_token_id) if i is not None}
        self._token_text: dict[int, str] = {}
        self._one_token: dict[tuple[int, bool], str] = {}  # decode([id]), memoized

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        if not os.path.isdir(model_dir):
            raise TokenizerLoadError(f"tokenizer directory not found: {model_dir}")
        tok_path = os.path.join(model_dir, "tokenizer.json")
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        for path in (tok_path, cfg_path):
            if not os.path.isfile(path):
                raise TokenizerLoadError(
                    f"{os.path.basename(path)} not found in {model_dir} (mlaserve needs a fast "
                    "tokenizer: tokenizer.json and tokenizer_config.json)")
        try:
            backend = Backend.from_file(tok_path)
        except Exception as e:  # the Rust library raises a bare Exception on bad JSON
            raise TokenizerLoadError(f"cannot load {tok_path}: {e}") from e
        try:
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise TokenizerLoadError(f"cannot read {cfg_path}: {e}") from e
        chat_template = _pick_chat_template(cfg.get("chat_template"))
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(jinja_path):  # the newer transformers layout keeps it in its own file
            with open(jinja_path, encoding="utf-8") as f:
                chat_template = f.read()
        max_len = cfg.get("model_max_length")
        return cls(
            backend,
            bos_token=_token_content(cfg.get("bos_token")),
            eos_token=_token_content(cfg.get("eos_token")),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            chat_template=chat_template,
            model_max_length=int(max_len) if isinstance(max_len, (int, float)) and max_len < 1e12 else None,
        )

    # -- encoding / decoding ------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos_token and not self._post_processor_adds_bos
                and self.bos_token_id is not None):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) == 1:  # the incremental detokenizer's usual prefix window: one token
            key = (int(ids[0]), skip_special_tokens)
            text = self._one_token.get(key)
            if text is None:
                text = self._one_token[key] = self._tok.decode([key[0]], skip_special_tokens=skip_special_tokens)
            return text
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` underneath."""
        return self._tok

    def decode_stream(self, context_ids: list[int], skip_special_tokens: bool = True):
        """An incremental decoder primed with ``context_ids`` (``tokenizers``' DecodeStream):
        ``step(backend, token_id)`` returns the new text, or None while a character is incomplete.
        None where the installed ``tokenizers`` cannot prime one (before 0.22)."""
        try:
            from tokenizers.decoders import DecodeStream

            return DecodeStream(skip_special_tokens=skip_special_tokens, ids=list(context_ids))
        except (ImportError, TypeError):
            return None

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self._tok.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_to_text(self, token_id: int) -> str:
        """The decoded text of one token, as vLLM shows it in logprobs ("\ufffd" for a token
        that is only part of a character's bytes)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._tok.decode([int(token_id)], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    @property
    def special_token_ids(self) -> set[int]:
        return set(self._special_ids)

    def __len__(self) -> int:
        return self.vocab_size

    # -- chat template ------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs) -> str:
        """Render ``messages`` with the checkpoint's (or the given) Jinja chat template.

        Template errors, including ``raise_exception(...)`` calls in the template, become
        InvalidRequestError so the HTTP layer answers 400.
        """
        import jinja2

        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise InvalidRequestError(
                "The tokenizer has no chat template; pass --chat-template or use the "
                "completions API. (transformers >= 4.44 no longer provides a default one.)")
        context = dict(kwargs)
        context.update(messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        try:
            return _compile_template(source).render(**context)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template error: {e}") from e


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_template(source: str):
    """Compile in a sandbox (templates come from checkpoints and requests: untrusted)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequestError(f"chat template syntax error (line {e.lineno}): {e.message}") from e


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas, applying stop strings.

    Two kinds of text are held back from the deltas:
    - bytes of a character split across tokens (byte-level BPE): the decoded window ends in
      U+FFFD until the character's last byte arrives;
    - a tail of the text that is a proper prefix of a stop string (unless the stop string is
      to be included in the output), so a client never sees text that a later stop removes.
    ``flush()`` releases the held text when the request finishes for another reason.
    Concatenating every delta (and the flush) gives ``text``.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True, stop: list[str] = (),
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        # The same prefix/read-offset scheme in Rust (2-3x faster per token); None where it would
        # differ (a context whose text holds U+FFFD: the stream re-emits some of it) and after it
        # refuses a window (a decoder whose text is not prefix-stable): the Python scheme then.
        self._stream, self._backend = None, tokenizer.backend
        if REPLACEMENT_CHAR not in tokenizer.decode(context, skip_special_tokens):
            self._stream = tokenizer.decode_stream(context, skip_special_tokens)
        self._prefix_offset = 0  # start of the decode window (in self._ids)
        self._read_offset = len(context)  # tokens before this are already in self._full
        self._prefix_text: str | None = None  # decode of ids[prefix:read], cached
        self._full = ""  # with stop strings: all decoded output text (truncated at a stop string)
        self._emitted = 0  # characters of self._full already returned as deltas
        self._deltas: list[str] = []  # without stop strings: the deltas, all of the text at once
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        return self._full[:self._emitted] if self.stop else "".join(self._deltas)

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def add_tokens(self, new_token_ids: list[int]) -> tuple[str, str | None]:
        """Append generated tokens; return (text to emit now, stop string hit or None).

        After a stop string is hit the detokenizer is finished; further tokens are ignored.
        """
        if self.stopped:
            return "", None
        if not self.stop:  # nothing to hold back: every complete character goes out at once
            text = ""
            for token_id in new_token_ids:
                self._ids.append(int(token_id))
                text += self._decode_next()
            if text:
                self._deltas.append(text)
            return text, None
        old_len = len(self._full)
        for token_id in new_token_ids:
            self._ids.append(int(token_id))
            self._full += self._decode_next()
        hit = self._check_stop(old_len)
        return self._emit(final=hit is not None), hit

    def flush(self) -> str:
        """The request ended without a stop string: release everything held back,
        including an incomplete trailing character (decoded as U+FFFD, as ``decode`` does)."""
        if self.stopped:
            return ""
        rest = ""
        if self._read_offset < len(self._ids):
            prefix_text = self._window_prefix_text()
            window = self.tokenizer.decode(self._ids[self._prefix_offset:], self.skip_special_tokens)
            rest = window[len(prefix_text):]
            self._prefix_offset = self._read_offset = len(self._ids)
            self._prefix_text = None
        if not self.stop:
            if rest:
                self._deltas.append(rest)
            return rest
        old_len = len(self._full)
        self._full += rest
        self._check_stop(old_len)
        return self._emit(final=True)

    # -- internals ----------------------------------------------------------------------------

    def _window_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self.tokenizer.decode(
                self._ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        return self._prefix_text

    def _decode_next(self) -> str:
        """New complete text after the last appended token (prefix/read-offset scheme)."""
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, self._ids[-1])
            except Exception:  # the Rust library raises a bare Exception: a window it will not cut
                self._stream = None
            else:
                if text is not None:  # the stream moved its window as the scheme below does
                    self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                    self._prefix_text = None
                return text or ""
        prefix_text = self._window_prefix_text()
        window = self.tokenizer.decode(self._ids[self._prefix_offset:], self.skip_special_tokens)
        if len(window) <= len(prefix_text) or window.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still missing bytes
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return window[len(prefix_text):]

    def _check_stop(self, old_len: int) -> str | None:
        """Find the earliest stop string that ends in the text added since ``old_len``."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            idx = self._full.find(s, max(0, old_len - len(s) + 1))
            if idx >= 0 and (best is None or (idx, -len(s)) < (best[0], best[1])):
                best = (idx, -len(s), s)
        if best is None:
            return None
        idx, _, s = best
        end = idx + len(s) if self.include_stop_str_in_output else idx
        self._full = self._full[:max(end, self._emitted)]
        self.stop_reason = s
        return s

    def _holdback(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        if self.include_stop_str_in_output:
            return 0  # a completed stop string keeps everything before it: nothing to retract
        best = 0
        text = self._full
        if not text:
            return 0
        last = text[-1]
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if s[k - 1] == last and text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _emit(self, final: bool) -> str:
        end = len(self._full) if final else max(self._emitted, len(self._full) - self._holdback())
        delta = self._full[self._emitted:end]
        self._emitted = end
        return delta
