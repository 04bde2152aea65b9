"""Tokenizer and chat template from a checkpoint's tokenizer files.

Uses the `tokenizers` library on tokenizer.json and renders the Jinja chat
template the way transformers does (sandboxed environment, same filters and
globals, special tokens passed in), so token ids and prompts match transformers
without importing it. Templates are untrusted text: they run in Jinja's immutable
sandbox and cannot reach Python. It also says where each token's text breaks lines
(`line_flags`), which the selectors that recompute whole lines or paragraphs read.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from ..errors import RarecacheError

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
# how a token's text sits in lines (`line_flags`): it holds a line break; a blank line; only blanks before its
# first break (a blank line may end here, begun by the token before); only blanks after its last break
LINE, BLANK, LEADING_BREAK, TRAILING_BREAK = 1, 2, 4, 8
_BLANK = re.compile(r"\n[^\S\n]*\n")  # ([^\S\n]: spaces, tabs and carriage returns, not a line break)
_LEADING, _TRAILING = re.compile(r"[^\S\n]*\n"), re.compile(r"\n[^\S\n]*$")


def line_flags(text: str) -> int:
    """LINE | BLANK | LEADING_BREAK | TRAILING_BREAK as they hold for `text`."""
    return (LINE * ("\n" in text) | BLANK * bool(_BLANK.search(text)) | LEADING_BREAK * bool(_LEADING.match(text))
            | TRAILING_BREAK * bool(_TRAILING.search(text)))


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any], chat_template: str | None,
                 extra_eos: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.special = {k: _token_text(config.get(k)) for k in _SPECIAL if config.get(k) is not None}
        self.chat_template = chat_template
        self._template = _compile(chat_template) if chat_template else None
        eos = self.special.get("eos_token")
        ids = [tokenizer.token_to_id(eos)] if eos else []
        self.eos_token_ids = tuple(dict.fromkeys(i for i in [*ids, *extra_eos] if i is not None))

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos: tuple[int, ...] = ()) -> "Tokenizer":
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise RarecacheError(f"no tokenizer.json in {path}")
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise RarecacheError(f"cannot read {file}: {e}") from None
        config = _read_json(path / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(tok, config, template, extra_eos)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def break_flags(self, size: int) -> list[int]:
        """Per token id below `size`, how its text sits in lines (`line_flags`): what the selectors that pick
        whole lines or paragraphs read (transfer/selectors.py; `Runner.learn_lines`); ids past the vocabulary
        get 0."""
        texts = self.tokenizer.decode_batch([[i] for i in range(min(size, self.vocab_size))],
                                            skip_special_tokens=False)
        return [line_flags(t) for t in texts] + [0] * (size - min(size, self.vocab_size))

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs) -> str:
        """The chat template applied to messages, as text."""
        if self._template is None:
            raise RarecacheError("this tokenizer has no chat template")
        _check_messages(messages)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                documents=None, **{**self.special, **kwargs},
            )
        except jinja2.TemplateError as e:
            raise RarecacheError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # the template writes its own special tokens, so none are added on top (as transformers does)
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise RarecacheError(f"chat template does not parse: {e}") from None


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RarecacheError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RarecacheError(f"each message needs a string 'role' and 'content', got {m!r}")


def _token_text(value: Any) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise RarecacheError(f"{file} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}
