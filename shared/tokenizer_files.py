"""A checkpoint's tokenizer side files, read as transformers reads them: chat templates, special tokens, generation
defaults; and the conversion of a SentencePiece-only tokenizer (``tokenizer.model``) to ``tokenizer.json``.

Chat templates, highest precedence first (transformers' ``PreTrainedTokenizerBase.from_pretrained``, then its
processors' legacy file):

1. ``chat_template.jinja`` (the default template) and ``additional_chat_templates/NAME.jinja`` (named ones);
2. ``chat_template.json`` (``{"chat_template": ...}``);
3. ``tokenizer_config.json``'s ``chat_template``: a string, or a list of ``{"name", "template"}``.

A request with tools uses the template named ``tool_use`` where there is one, else ``default`` (as
``get_chat_template``). A checkpoint with no template has none here: chat on it is a 400 (``ChatTokenizer``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import ConfigurationError

DEFAULT_TEMPLATE = "default"
TOOL_USE_TEMPLATE = "tool_use"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
TEMPLATE_JSON = "chat_template.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
TOKENIZER_JSON = "tokenizer.json"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# The sampling fields of generation_config.json a request inherits when it does not set them (vLLM's
# ``--generation-config auto`` takes the same ones; ``do_sample`` is not one: an API request samples unless its
# temperature is 0).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, ``{}`` when absent; a ``ConfigurationError`` naming the file when it is not one."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigurationError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigurationError(f"{path}: expected a JSON object")
    return value


def _named(value: Any, source: str) -> dict[str, str]:
    """A ``chat_template`` value (a string or a list of named templates) as ``{name: template}``."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {DEFAULT_TEMPLATE: value} if value else {}
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise ConfigurationError(f"{source}: chat_template must be a string or a list of {{'name', 'template'}} objects")


def read_chat_templates(model_dir: Path, tokenizer_config: dict[str, Any] | None = None) -> dict[str, str]:
    """The checkpoint's chat templates by name (``default``, ``tool_use``, ...), from the first source that has
    any (see the module's docstring); ``{}`` when it has none."""
    templates: dict[str, str] = {}
    try:
        if (model_dir / TEMPLATE_FILE).is_file():
            templates[DEFAULT_TEMPLATE] = (model_dir / TEMPLATE_FILE).read_text(encoding="utf-8")
        if (model_dir / TEMPLATE_DIR).is_dir():
            for path in sorted((model_dir / TEMPLATE_DIR).glob("*.jinja")):
                templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"{model_dir}: cannot read a chat template ({exc})") from None
    if templates:
        return templates
    from_json = _named(read_json(model_dir / TEMPLATE_JSON).get("chat_template"), str(model_dir / TEMPLATE_JSON))
    if from_json:
        return from_json
    config = read_json(model_dir / TOKENIZER_CONFIG) if tokenizer_config is None else tokenizer_config
    return _named(config.get("chat_template"), str(model_dir / TOKENIZER_CONFIG))


def choose_template(templates: dict[str, str], has_tools: bool) -> str | None:
    """The name of the template a request renders with: ``tool_use`` for one with tools where there is one, else
    ``default``; a lone template whatever its name; None when there is none to choose."""
    if has_tools and TOOL_USE_TEMPLATE in templates:
        return TOOL_USE_TEMPLATE
    if DEFAULT_TEMPLATE in templates:
        return DEFAULT_TEMPLATE
    return next(iter(templates)) if len(templates) == 1 else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken: {"content": "<s>", ...}
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def read_special_tokens(model_dir: Path, tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` (those set) from tokenizer_config.json, else from
    special_tokens_map.json: what a chat template sees under those names."""
    fallback = read_json(model_dir / SPECIAL_TOKENS_MAP)
    tokens: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(tokenizer_config.get(name)) if name in tokenizer_config else _token_text(fallback.get(name))
        if text:
            tokens[name] = text
    return tokens


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What ``generation_config.json`` says about generation: the ids that end it and the sampling a request gets
    for the fields it does not set (``sampling``: only the fields the file sets)."""

    eos_token_ids: tuple[int, ...] = ()
    sampling: tuple[tuple[str, float], ...] = ()

    def sampling_defaults(self) -> dict[str, float]:
        """``{field: value}`` of the file's sampling fields (``temperature``, ``top_p``, ``top_k``, ``min_p``,
        ``repetition_penalty``); ``top_k`` as an integer-valued float."""
        return dict(self.sampling)

    def apply(self, values: dict[str, Any], given: set[str] | frozenset[str]) -> dict[str, Any]:
        """``values`` (a request's sampling fields) with each field the request did not set (not in ``given``,
        e.g. pydantic's ``model_fields_set``) replaced by the checkpoint's default, where it has one."""
        out = dict(values)
        for name, value in self.sampling:
            if name in out and name not in given:
                out[name] = int(value) if name == "top_k" else value
        return out


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_generation_defaults(model_dir: Path, config: dict[str, Any] | None = None) -> GenerationDefaults:
    """The checkpoint's ``GenerationDefaults``: EOS ids from generation_config.json (one id or a list), else from
    config.json's ``eos_token_id`` (``config``: config.json already read). Sampling values outside what the API
    accepts are left out (the request's own default applies)."""
    path = model_dir / GENERATION_CONFIG
    generation = read_json(path)
    model_config = read_json(model_dir / "config.json") if config is None else config
    eos = generation.get("eos_token_id", model_config.get("eos_token_id"))
    eos_list = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos_list):
        raise ConfigurationError(f"{path}: eos_token_id must be a token id or a list of them")
    valid = {
        "temperature": lambda v: 0.0 <= v <= 2.0,
        "top_p": lambda v: 0.0 < v <= 1.0,
        "top_k": lambda v: v >= 0 and float(v).is_integer(),
        "min_p": lambda v: 0.0 <= v <= 1.0,
        "repetition_penalty": lambda v: 0.0 < v <= 10.0,
    }
    sampling = tuple(
        (name, float(generation[name]))
        for name in SAMPLING_FIELDS
        if _is_number(generation.get(name)) and valid[name](generation[name])
    )
    return GenerationDefaults(eos_token_ids=tuple(dict.fromkeys(eos_list)), sampling=sampling)
