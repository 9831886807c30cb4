"""Tokenizer, chat template and incremental detokenizer of a checkpoint (``tokenizer.json`` and its side files).

Prompts are transformers' own: ``encode(text)`` is ``AutoTokenizer.from_pretrained(dir)(text)`` (the special
tokens of tokenizer.json's post-processor, e.g. a BOS, not added twice when a rendered chat already starts with
them), and a chat is rendered with the checkpoint's template (``shared.tokenizer_files``) in the sandbox and with
the globals transformers gives templates, so ``encode_chat(apply_chat_template(...))`` is
``apply_chat_template(..., tokenize=True)``. A checkpoint without a template refuses chat with a 400: no prompt
format is guessed for it.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from tokenizers import Tokenizer

from shared.errors import ConfigurationError, ValidationError
from shared.tokenizer_files import (
    GenerationDefaults,
    choose_template,
    read_chat_templates,
    read_generation_defaults,
    read_json,
    read_special_tokens,
)

NO_TEMPLATE_MESSAGE = (
    "{name} has no chat template; use /v1/completions or push a tokenizer with one "
    "(chat_template.jinja, or chat_template in tokenizer_config.json)"
)

_PIECE_CHARS = 1 << 15
_SHORT_CHARS = 1 << 12  # encoded on the calling thread, GIL held: well under a millisecond


def _pieces(text: str, size: int) -> list[str]:
    """``text`` in pieces of at most ``size`` characters, each cut just before a space where there is one."""
    pieces, start = [], 0
    while len(text) - start > size:
        cut = text.rfind(" ", start + 1, start + size)
        cut = cut if cut > start else start + size
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' filter: Jinja's own escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)  # local time, as transformers gives templates


class _TemplateNamespace(Namespace):
    """``namespace()`` without underscore attributes (no way to CPython internals), as transformers'."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise TemplateError(f"chat templates cannot set underscore attributes on a namespace ({name!r})")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env


def _special_affixes(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids tokenizer.json's post-processor puts before and after a text's own (e.g. ``[bos]``, ``[]``)."""
    plain: list[int] = tokenizer.encode("hello world", add_special_tokens=False).ids
    full: list[int] = tokenizer.encode("hello world", add_special_tokens=True).ids
    if not plain:
        return [], []
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []


class RenderedChat(str):
    """A chat as the template rendered it: it carries its own special tokens, so it is encoded without the ones the
    tokenizer adds to plain text (transformers' ``apply_chat_template(tokenize=True)``: ``add_special_tokens=False``).
    """

    __slots__ = ()


class ChatTokenizer:
    """Encode/decode with the ``tokenizers`` library; render chats with the checkpoint's Jinja template
    in a sandbox (templates come with model files and are not trusted).

    Attributes:
        chat_templates: the checkpoint's templates by name (``default``, ``tool_use``...); empty when it has none.
        chat_template: the default one (``""`` when there is none).
        generation: ``generation_config.json``'s EOS ids and sampling defaults.
    """

    def __init__(self, model_dir: Path, name: str | None = None) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            hint = (
                " (only a SentencePiece tokenizer.model: convert it at push)"
                if (model_dir / "tokenizer.model").is_file()
                else ""
            )
            raise ConfigurationError(f"{model_dir}: no tokenizer.json{hint}")
        self.name = name  # for messages: a served model's id (its directory is no name a client knows)
        self.tokenizer = Tokenizer.from_file(str(path))
        cfg = read_json(model_dir / "tokenizer_config.json")
        self.special_tokens = read_special_tokens(model_dir, cfg)
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self._prefix, self._suffix = _special_affixes(self.tokenizer)
        self.add_bos = bool(self._prefix)
        self.chat_templates = read_chat_templates(model_dir, cfg)
        self.chat_template: str = self.template_for(has_tools=False)
        self.generation: GenerationDefaults = read_generation_defaults(model_dir)
        env = _environment()
        self._compiled: dict[str, Template] = {}
        for template_name, source in self.chat_templates.items():
            try:
                self._compiled[template_name] = env.from_string(source)
            except TemplateError as exc:
                raise ConfigurationError(
                    f"{model_dir}: chat template {template_name!r} does not parse: {exc}"
                ) from None
        self.vocab_size = self.tokenizer.get_vocab_size()

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_templates)

    def template_for(self, has_tools: bool) -> str:
        """The template text a request renders with (``""`` when the checkpoint has none)."""
        name = choose_template(self.chat_templates, has_tools)
        return "" if name is None else self.chat_templates[name]

    def token_id(self, text: str | None) -> int | None:
        return self.tokenizer.token_to_id(text) if text else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """generation_config.json's EOS ids, else the tokenizer's eos token."""
        if self.generation.eos_token_ids:
            return self.generation.eos_token_ids
        eos = self.token_id(self.eos_token)
        return () if eos is None else (eos,)

    def _with_specials(self, ids: list[int]) -> list[int]:
        prefix = [] if ids[: len(self._prefix)] == self._prefix else self._prefix
        return [*prefix, *ids, *self._suffix]

    def encode(self, text: str) -> list[int]:
        """``text``'s ids with the special tokens the tokenizer adds (transformers' ``tokenizer(text)``); a leading
        BOS the text already has is not added again. A ``RenderedChat`` gets none added (``encode_chat``)."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids if isinstance(text, RenderedChat) else self._with_specials(ids)

    def encode_chat(self, prompt: str) -> list[int]:
        """A rendered chat's ids, no special tokens added (transformers' ``apply_chat_template(tokenize=True)``)."""
        ids: list[int] = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        return ids

    def encode_counted(self, text: str, max_ids: int) -> tuple[list[int], int]:
        """``encode`` for a text of any size, in a worker thread: its ids (none above ``max_ids``) and their number.

        ``encode`` holds the GIL for the whole text (seconds for megabytes); the batch call of ``tokenizers``
        releases it. A long text goes in pieces cut before a space (where the usual pre-tokenizers split anyway),
        each freed on its own, and its ids are only listed when they fit ``max_ids``: building, truncating or
        freeing the encoding of a million tokens holds the GIL too, and the event loop with it.
        """
        if len(text) <= _SHORT_CHARS:  # one plain encode: the batch call's thread pool costs more than it frees
            short = self.encode(text)
            return (short if len(short) <= max_ids else []), len(short)
        specials = not isinstance(text, RenderedChat)
        encodings = self.tokenizer.encode_batch(_pieces(text, _PIECE_CHARS), add_special_tokens=False)
        first: list[int] = encodings[0].ids[: len(self._prefix)]
        count = 0
        while encodings:
            count += len(encodings.pop())
        if specials:
            count += (0 if first == self._prefix else len(self._prefix)) + len(self._suffix)
        if count > max_ids:
            return [], count
        (encoding,) = self.tokenizer.encode_batch([str(text)], add_special_tokens=False)  # exact, and short
        ids = self._with_specials(encoding.ids) if specials else list(encoding.ids)
        return ids, len(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render messages (``role`` + ``content``, and ``tool_calls`` / ``tool_call_id`` where they have them) to
        the prompt text; ``tools`` (OpenAI's tool objects) go to the template as ``tools``, where one renders them.
        Keys whose value is None are dropped, as transformers drops them.

        Raises:
            ValidationError: the checkpoint has no chat template, a message lacks a string role or content, or the
                template rejects the messages (its ``raise_exception``).
        """
        template = choose_template(self.chat_templates, has_tools=tools is not None)
        if template is None:  # no template, or several with no default and no tool_use (transformers refuses too)
            raise ValidationError(
                NO_TEMPLATE_MESSAGE.format(name=f"model {self.name}" if self.name else "this model"), param="messages"
            )
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValidationError(f"messages[{i}] needs a string 'role' and 'content'", param=f"messages.{i}")
        try:
            text = self._compiled[template].render(
                messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except TemplateError as exc:
            raise ValidationError(
                f"messages: the model's chat template rejected them: {exc}", param="messages"
            ) from None
        return RenderedChat(text)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into UTF-8-safe text deltas, and finds stop strings.

    Only a short window is decoded per update (vLLM's prefix/read offsets): the text of
    ``ids[prefix:read]`` is compared with that of ``ids[prefix:]`` so tokenizers that treat the first token
    of a decode specially still produce the right delta. A trailing U+FFFD means a multi-byte character is
    split across tokens; it is held back until the next token completes it. With stop strings, the last
    ``len(stop) - 1`` characters are held back so a stop string is never partly emitted.
    """

    def __init__(self, tokenizer: ChatTokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""
        self.num_emitted_chars = 0
        self.num_emitted_tokens = 0
        self._prefix_offset = 0
        self._read_offset = 0
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._stopped = False

    def _advance(self, ids: list[int]) -> None:
        while self._read_offset < len(ids):
            prefix = self.tokenizer.decode(ids[self._prefix_offset : self._read_offset])
            end = self._read_offset + 1
            # Extend the window until the new tokens form whole characters (or the ids run out).
            while True:
                full = self.tokenizer.decode(ids[self._prefix_offset : end])
                if not full.endswith("\ufffd") or end >= len(ids):
                    break
                end += 1
            if full.endswith("\ufffd"):
                return  # an incomplete character at the very end: wait for the next token
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = end

    def update(self, output_ids: list[int], is_final: bool) -> tuple[str, bool]:
        """Returns (new text to emit, stopped by a stop string). Text after a stop string is never emitted."""
        if self._stopped:
            return "", True
        searched_from = max(0, self.num_emitted_chars - self._hold)
        self._advance(output_ids)
        stopped = False
        for s in self.stop:
            pos = self.text.find(s, searched_from)
            if pos != -1:
                self.text = self.text[:pos]
                stopped = self._stopped = True
        safe_end = len(self.text) if (stopped or is_final) else len(self.text) - self._hold
        if safe_end <= self.num_emitted_chars:
            return "", stopped
        delta = self.text[self.num_emitted_chars : safe_end]
        self.num_emitted_chars = safe_end
        return delta, stopped
