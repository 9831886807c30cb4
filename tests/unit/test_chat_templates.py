"""A checkpoint's own chat templates, special tokens and generation defaults, checked token for token against
transformers (``AutoTokenizer.from_pretrained(dir).apply_chat_template(..., tokenize=True)``) on tokenizer-only
checkpoints written here: a small BPE tokenizer.json and realistic templates (Qwen2.5-style with tools, Llama-3-style
with a BOS, Gemma-style without a system role), each saved as chat_template.jinja, in tokenizer_config.json, and as
named templates (``default`` + ``tool_use``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from shared.chat_tokenizer import ChatTokenizer
from shared.errors import ConfigurationError, ValidationError
from shared.tokenizer_files import read_generation_defaults
from shared.zoo.tokenizer_convert import ensure_tokenizer_json

transformers = pytest.importorskip("transformers")

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<pad>",
]

# Qwen2.5-style: ChatML, the tools listed in the system turn, calls as <tool_call> JSON, results as user turns.
QWEN_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> tags.<|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}{{- raise_exception('unknown role ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Llama-3-style: a BOS from the template, header tokens, a dated system turn (strftime_now), namespace, tools.
LLAMA_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(system='', date=strftime_now('%d %b %Y')) %}
{%- if messages[0]['role'] == 'system' %}{%- set ns.system = messages[0]['content'] | trim %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + ns.date + '\\n\\n' }}
{%- if tools is not none %}
{{- 'You have access to the following functions:\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- ns.system + '<|eot_id|>' }}
{%- for message in messages %}
{%- if message['role'] == 'system' %}{% continue %}{% endif %}
{%- if message.tool_calls is defined %}
{%- for tc in message.tool_calls %}{%- if loop.index > 1 %}{% break %}{% endif %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + tc.function.name + '", "parameters": ' }}
{{- tc.function.arguments | tojson }}{{- '}<|eot_id|>' }}
{%- endfor %}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

# Gemma-style: a BOS, no system role (refused), "assistant" is "model", roles must alternate.
GEMMA_TEMPLATE = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}
{{ raise_exception('System role not supported') }}{% endif %}
{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}
{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}
{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}
{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"""

PLAIN_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

STYLES: dict[str, dict[str, Any]] = {
    "qwen": {"template": QWEN_TEMPLATE, "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>"},
    "llama": {"template": LLAMA_TEMPLATE, "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": None},
    "gemma": {"template": GEMMA_TEMPLATE, "bos": "<bos>", "eos": "<eos>", "pad": "<pad>"},
}
LAYOUTS = ("jinja", "config", "named")

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'The weather in a city <today> & "now"',
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the weather in Zürich? Say it in émojis too 🌦"},
]
TOOL_CHAT: list[dict[str, Any]] = [
    *CHAT,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 4, "sky": "rain"}'},
]
GEMMA_CHAT: list[dict[str, Any]] = [
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Tell me a joke about tokenizers."},
]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    texts = [json.dumps(TOOLS), QWEN_TEMPLATE, LLAMA_TEMPLATE, GEMMA_TEMPLATE] + [m["content"] for m in CHAT] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def write_checkpoint(root: Path, tokenizer: Tokenizer, style: str, layout: str) -> Path:
    """A tokenizer-only checkpoint of ``style`` with its template saved the ``layout`` way."""
    spec = STYLES[style]
    out = root / f"{style}-{layout}"
    out.mkdir()
    tok = Tokenizer.from_str(tokenizer.to_str())
    if spec["bos"] is not None:  # as Llama 3 and Gemma do: the post-processor prepends the BOS
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec["bos"],
        "eos_token": spec["eos"],
        "pad_token": spec["pad"],
        "model_max_length": 4096,
    }
    template = spec["template"]
    if layout == "jinja":
        (out / "chat_template.jinja").write_text(template)
    elif layout == "config":
        config["chat_template"] = template
    else:
        config["chat_template"] = [
            {"name": "default", "template": PLAIN_CHATML},
            {"name": "tool_use", "template": template},
        ]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


def hf_ids(model_dir: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    out = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return list(ids)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("style", list(STYLES))
def test_prompts_are_transformers_token_for_token(
    tokenizer_json: Tokenizer, tmp_path: Path, style: str, layout: str
) -> None:
    model_dir = write_checkpoint(tmp_path, tokenizer_json, style, layout)
    tok = ChatTokenizer(model_dir)
    cases: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = (
        [(GEMMA_CHAT, None), (GEMMA_CHAT, TOOLS)]
        if style == "gemma"
        else [(CHAT, None), (CHAT, TOOLS), (TOOL_CHAT, TOOLS)]
    )
    for messages, tools in cases:
        expected = hf_ids(model_dir, messages, tools)
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        assert tok.encode_chat(prompt) == expected, (style, layout, tools is not None)
        # The path a served chat takes today (the rendered text through ``encode``): a template's BOS is not doubled
        # by the post-processor's. (A template without one gets the post-processor's there: ``encode_chat`` is exact.)
        if tok.bos_token is None or prompt.startswith(tok.bos_token):
            assert tok.encode(prompt) == expected
    if layout == "named":  # without tools the default (plain ChatML) template, with tools tool_use
        assert "<|im_start|>user\n" in tok.apply_chat_template(CHAT[1:], tools=None)
        assert tok.chat_template == PLAIN_CHATML


@pytest.mark.parametrize("style", list(STYLES))
def test_plain_text_is_encoded_as_transformers_does(tokenizer_json: Tokenizer, tmp_path: Path, style: str) -> None:
    model_dir = write_checkpoint(tmp_path, tokenizer_json, style, "jinja")
    tok = ChatTokenizer(model_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    long_text = " ".join(["weather"] * 6000)  # past _PIECE_CHARS: encode_counted encodes it in pieces
    for text in ["hello world", "What is the weather in Zürich?", " leading space", "x" * 5000 + " y", long_text]:
        assert tok.encode(text) == hf(text)["input_ids"], text
        assert tok.encode_counted(text, 10_000) == (hf(text)["input_ids"], len(hf(text)["input_ids"]))
    assert tok.add_bos == (STYLES[style]["bos"] is not None)
    assert tok.bos_token == STYLES[style]["bos"]


def test_gemma_refuses_a_system_turn_with_a_400(tokenizer_json: Tokenizer, tmp_path: Path) -> None:
    tok = ChatTokenizer(write_checkpoint(tmp_path, tokenizer_json, "gemma", "config"))
    with pytest.raises(ValidationError, match="System role not supported"):
        tok.apply_chat_template(CHAT)


def test_a_checkpoint_without_a_template_refuses_chat(tokenizer_json: Tokenizer, tmp_path: Path) -> None:
    model_dir = write_checkpoint(tmp_path, tokenizer_json, "qwen", "config")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = ChatTokenizer(model_dir, name="acme/base-7b")
    assert not tok.has_chat_template
    with pytest.raises(ValidationError, match=r"model acme/base-7b has no chat template; use /v1/completions") as err:
        tok.apply_chat_template(CHAT)
    assert err.value.status_code == 400
    assert tok.encode("hello") == transformers.AutoTokenizer.from_pretrained(str(model_dir))("hello")["input_ids"]


def test_template_files_take_precedence(tokenizer_json: Tokenizer, tmp_path: Path) -> None:
    """chat_template.jinja over chat_template.json over tokenizer_config.json, as transformers and its processors."""
    model_dir = write_checkpoint(tmp_path, tokenizer_json, "qwen", "config")
    (model_dir / "chat_template.json").write_text(json.dumps({"chat_template": "JSON{{ messages[0].content }}"}))
    assert ChatTokenizer(model_dir).apply_chat_template(CHAT) == "JSONYou answer briefly."
    (model_dir / "chat_template.jinja").write_text("JINJA{{ messages[-1].role }}")
    assert ChatTokenizer(model_dir).apply_chat_template(CHAT) == "JINJAuser"
    (model_dir / "additional_chat_templates").mkdir()
    (model_dir / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS{{ tools | length }}")
    tok = ChatTokenizer(model_dir)
    assert tok.apply_chat_template(CHAT, tools=TOOLS) == "TOOLS1"
    assert tok.apply_chat_template(CHAT) == "JINJAuser"
    # transformers picks the same ones from these files
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert hf.apply_chat_template(CHAT, tools=TOOLS, tokenize=False) == "TOOLS1"


def test_sandbox_refuses_what_a_hostile_template_tries(tokenizer_json: Tokenizer, tmp_path: Path) -> None:
    model_dir = write_checkpoint(tmp_path, tokenizer_json, "qwen", "jinja")
    (model_dir / "chat_template.jinja").write_text("{% set ns = namespace() %}{% set ns._x = 1 %}{{ ''.__class__ }}")
    with pytest.raises(ValidationError, match="rejected"):
        ChatTokenizer(model_dir).apply_chat_template(CHAT)
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigurationError, match="does not parse"):
        ChatTokenizer(model_dir)


def test_generation_defaults(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert read_generation_defaults(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": [151645, 151643],
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 0.8,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "min_p": 7,  # out of range: left out
            }
        )
    )
    defaults = read_generation_defaults(tmp_path)
    assert defaults.eos_token_ids == (151645, 151643)
    assert defaults.sampling_defaults() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20.0, "repetition_penalty": 1.05}
    request = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    applied = defaults.apply(request, given={"temperature"})
    assert applied == {"temperature": 1.0, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    with pytest.raises(ConfigurationError, match="eos_token_id"):
        read_generation_defaults(tmp_path)


def test_sentencepiece_only_checkpoint_is_converted(tmp_path: Path) -> None:
    spm = pytest.importorskip("sentencepiece")
    source = tmp_path / "spm"
    source.mkdir()
    lines = [m["content"] for m in CHAT] + ["The quick brown fox jumps over the lazy dog."] * 5
    lines += [f"line {i}: tokenizers turn text into ids, {i * 7} times" for i in range(200)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"),
        model_prefix=str(source / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        minloglevel=2,
    )
    (source / "tokenizer.vocab").unlink()
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}",
    }
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigurationError, match="convert it at push"):
        ChatTokenizer(source)
    expected = transformers.AutoTokenizer.from_pretrained(str(source))  # transformers on the slow files alone
    converted = tmp_path / "converted"
    shutil.copytree(source, converted)
    staged = tmp_path / "staged"
    assert ensure_tokenizer_json(converted, out_dir=staged) == staged / "tokenizer.json"
    assert not (converted / "tokenizer.json").exists()  # the source checkpoint is left as it was
    assert ensure_tokenizer_json(converted) == converted / "tokenizer.json"
    tok = ChatTokenizer(converted)
    for text in ["The quick brown fox", "Zürich 🌦 émojis", "line 12: tokenizers", "  two spaces"]:
        assert tok.encode(text) == expected(text)["input_ids"], text
        assert tok.decode(tok.encode(text)) == expected.decode(expected(text)["input_ids"], skip_special_tokens=True)
    prompt = tok.apply_chat_template(CHAT)
    assert tok.encode_chat(prompt) == list(expected.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"])
    with pytest.raises(ConfigurationError, match=r"no tokenizer\.json"):
        ensure_tokenizer_json(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    (broken / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(ConfigurationError, match=r"cannot convert tokenizer\.model to tokenizer\.json"):
        ensure_tokenizer_json(broken)
