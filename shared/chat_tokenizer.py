"""Tokenizer, chat template and incremental detokenizer of a checkpoint (``tokenizer.json`` + config)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from shared.errors import ConfigurationError, ValidationError

# ChatML: what most small open models use when a checkpoint carries no template.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


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


class ChatTokenizer:
    """Encode/decode with the ``tokenizers`` library; render chats with the checkpoint's Jinja template
    in a sandbox (templates come with model files and are not trusted)."""

    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ConfigurationError(f"{model_dir}: no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str = template or DEFAULT_CHAT_TEMPLATE
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        try:
            self._template = env.from_string(self.chat_template)
        except TemplateError as exc:
            raise ConfigurationError(f"{cfg_path}: chat_template does not parse: {exc}") from None
        self.vocab_size = self.tokenizer.get_vocab_size()

    def token_id(self, text: str | None) -> int | None:
        return self.tokenizer.token_to_id(text) if text else None

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.token_id(self.bos_token)
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
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
        encodings = self.tokenizer.encode_batch(_pieces(text, _PIECE_CHARS), add_special_tokens=False)
        first: list[int] = encodings[0].ids[:1]
        count = 0
        while encodings:
            count += len(encodings.pop())
        bos = self.token_id(self.bos_token)
        needs_bos = self.add_bos and bos is not None and first[:1] != [bos]
        if count + needs_bos > max_ids:
            return [], count + needs_bos
        (encoding,) = self.tokenizer.encode_batch([text], add_special_tokens=False)  # exact, and short
        ids: list[int] = encoding.ids
        if needs_bos and bos is not None:
            ids.insert(0, bos)
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
        the prompt text; ``tools`` (OpenAI's tool objects) go to the template as ``tools``, where one renders them."""
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValidationError(f"messages[{i}] needs a string 'role' and 'content'", param=f"messages.{i}")
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise ValidationError(
                f"messages: the model's chat template rejected them: {exc}", param="messages"
            ) from None


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


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
