"""Export of a Hugging Face causal-LM checkpoint to GGUF, the format llama.cpp runs.

Preferred: llama.cpp's own converter, ``convert_hf_to_gguf.py`` with its ``gguf-py``, as vendored in
llama-cpp-python's source distribution (the version ``constraints.txt`` pins, so the files match the llama.cpp
that runs them). ``make gguf-converter`` extracts them into :func:`default_converter_dir`; a setting may point
elsewhere. It converts every family llama.cpp knows (Llama, Mistral, Qwen2 with its biases, Qwen3 with its q/k
norms, Gemma 3...), in a subprocess of its own. Its BPE pre-tokenizer check knows published tokenizers by the
hash of their output; a byte-level BPE tokenizer with GPT-2's plain pre-tokenization (the zoo's) is not among
them, so it is declared ``gpt-2`` here, which is what it is; any other unknown tokenizer is still refused.

Fallback when the converter is absent: a writer of this module for the Llama layout only (tied embeddings,
grouped-query attention, RoPE, a byte-level BPE tokenizer), written with the ``gguf`` package's writer. llama.cpp's
Llama applies RoPE to interleaved pairs of a head's dimensions, where Hugging Face rotates its two halves; the
query and key projections are permuted here, as llama.cpp's converter does, so both compute the same.

Two files per LM:

- ``model-f32.gguf``: every tensor in float32, so llama.cpp's greedy outputs match the checkpoint's;
- ``model-q8_0.gguf``: the 2-D weights in Q8_0 (blocks of 32 int8 with a float16 scale, llama.cpp's usual
  8-bit format); 1-D weights, and a matrix whose rows are not a multiple of 32 long, stay float32.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

GGUF_F32 = "model-f32.gguf"
GGUF_Q8_0 = "model-q8_0.gguf"
GGUF_FILES = {"f32": GGUF_F32, "q8_0": GGUF_Q8_0}
# llama.cpp's token types (llama_token_type): a normal vocabulary token, a special one, unused padding.
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5
Q8_0_BLOCK = 32  # values per Q8_0 block: a row must be a multiple of it
CONVERTER_SCRIPT = "convert_hf_to_gguf.py"
CONVERTER_VERSION = "llama-cpp-python-0.3.36"  # the sdist the converter comes from (constraints.txt's pin)
CONVERT_TIMEOUT_S = 1800.0

# Runs llama.cpp's converter with its own gguf-py first on the path, declaring a GPT-2-style byte-level BPE
# tokenizer (the only kind declared here) as ``gpt-2`` where the converter's table of known hashes has no entry.
_BOOTSTRAP = """
import json, runpy, sys
from pathlib import Path
conv, model = Path(sys.argv[1]), Path(sys.argv[2])
sys.path[:0] = [str(conv), str(conv / "gguf-py")]
from conversion import base
known = base.TextModel.get_vocab_base_pre
pre = {}
if (model / "tokenizer.json").is_file():
    pre = json.loads((model / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
def declared(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
            return "gpt-2"
        raise
base.TextModel.get_vocab_base_pre = declared
sys.argv = [str(conv / "convert_hf_to_gguf.py"), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class GgufExportError(RuntimeError):
    """The GGUF export failed; the message is one line saying why."""


def default_converter_dir() -> Path:
    """Where ``make gguf-converter`` extracts llama.cpp's converter."""
    return Path.home() / ".cache" / "tierline" / f"{CONVERTER_VERSION}-convert"


def find_converter(configured: Path | None = None) -> Path | None:
    """The directory holding ``convert_hf_to_gguf.py`` (``configured``, else the default), or None."""
    folder = configured or default_converter_dir()
    return folder if (folder / CONVERTER_SCRIPT).is_file() else None


def export_gguf(model_dir: Path, out_path: Path, kind: str = "f32", converter: Path | None = None) -> dict[str, Any]:
    """Write ``model_dir`` to one GGUF file; ``kind`` is ``f32`` or ``q8_0``. With ``converter`` (a directory
    from :func:`find_converter`) llama.cpp's converter writes it, else this module's Llama writer. Returns what
    was written: the file's name and size and what wrote it. Raises :class:`GgufExportError` (one line)."""
    if kind not in GGUF_FILES:
        raise ValueError(f"GGUF kind {kind!r}: choose one of {', '.join(GGUF_FILES)}")
    if converter is not None:
        return convert_with_llama_cpp(converter, model_dir, out_path, kind)
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    if model_type != "llama":
        raise GgufExportError(
            f"GGUF of a {model_type} checkpoint needs llama.cpp's converter ({CONVERTER_SCRIPT}), not found: "
            "run `make gguf-converter` or set TIERLINE_REGISTRY_GGUF_CONVERTER"
        )
    return write_llama_gguf(model_dir, out_path, kind)


def convert_with_llama_cpp(converter: Path, model_dir: Path, out_path: Path, kind: str) -> dict[str, Any]:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` (in ``converter``) on ``model_dir``, writing ``out_path``."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", _BOOTSTRAP, str(converter), str(model_dir), "--outtype", kind]
    cmd += ["--outfile", str(out_path)]
    # Its own gguf-py, the one the script was written against (NO_LOCAL_GGUF would pick the installed one).
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CONVERT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise GgufExportError(f"llama.cpp's converter ran past {CONVERT_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0 or not out_path.is_file():
        logger.warning("llama.cpp's converter failed on %s:\n%s", model_dir, done.stderr[-4000:])
        raise GgufExportError(f"llama.cpp's converter: {_last_error(done.stderr)}")
    return {"file": out_path.name, "size_bytes": out_path.stat().st_size, "converter": CONVERTER_VERSION}


def _last_error(stderr: str) -> str:
    """The exception line a Python traceback ends with (or the last line)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        if not line.startswith(("File ", "^", "~", "INFO:", "WARNING:", "DEBUG:")) and ":" in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def _permute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows of a q/k projection from rotate-half order to llama.cpp's interleaved pairs (its converter's permute)."""
    out_dim = w.shape[0]
    return w.reshape(num_heads, 2, out_dim // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_map(config: dict[str, Any], state: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """(GGUF tensor name, float32 array in the Hugging Face [out, in] layout), in llama.cpp's order."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    out: list[tuple[str, np.ndarray]] = [("token_embd.weight", state["model.embed_tokens.weight"])]
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(int(config["num_hidden_layers"])):
        for hf, gg in names.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                w = _permute_rope(w, heads)
            elif gg == "attn_k":
                w = _permute_rope(w, kv_heads)
            out.append((f"blk.{i}.{gg}.weight", w))
    out.append(("output_norm.weight", state["model.norm.weight"]))
    lm_head = state.get("lm_head.weight")
    if lm_head is not None and not config.get("tie_word_embeddings", True):
        out.append(("output.weight", lm_head))
    return out


def _vocab(model_dir: Path, vocab_size: int) -> tuple[list[str], list[int], list[str], set[int]]:
    """(tokens by id, their llama.cpp types, BPE merges as "a b", special token ids) from ``tokenizer.json``."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{model_dir}: GGUF export handles byte-level BPE tokenizers, not {model.get('type')}")
    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    special: set[int] = set()
    for added in tok.get("added_tokens", []):
        by_id[int(added["id"])] = added["content"]
        if added.get("special"):
            special.add(int(added["id"]))
    if max(by_id) >= vocab_size:
        raise ValueError(f"{model_dir}: tokenizer has ids up to {max(by_id)}, the model only {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(TOKEN_CONTROL if i in special else TOKEN_NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges, special


def _token_id(model_dir: Path, content: str | None) -> int | None:
    if not content:
        return None
    for added in json.loads((model_dir / "tokenizer.json").read_text()).get("added_tokens", []):
        if added["content"] == content:
            return int(added["id"])
    return None


def write_llama_gguf(model_dir: Path, out_path: Path, kind: str = "f32") -> dict[str, Any]:
    """Write ``model_dir`` (the zoo's HF Llama layout) to one GGUF file with this module's writer; ``kind`` is
    ``f32`` or ``q8_0``. Returns what was written: the tensor types used and the file's size."""
    import gguf
    from safetensors.numpy import load_file

    if kind not in GGUF_FILES:
        raise ValueError(f"GGUF kind {kind!r}: choose one of {', '.join(GGUF_FILES)}")
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{model_dir}: GGUF export handles Llama checkpoints, not {config.get('model_type')!r}")
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    state: dict[str, np.ndarray] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        state.update({k: v.astype(np.float32) for k, v in load_file(str(shard)).items()})

    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    theta = float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    vocab_size = int(config["vocab_size"])

    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out_path), arch="llama")
    writer.add_name(model_dir.name)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_vocab_size(vocab_size)
    file_type = gguf.LlamaFileType.ALL_F32 if kind == "f32" else gguf.LlamaFileType.MOSTLY_Q8_0
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tokens, types, merges, _ = _vocab(model_dir, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for content, add in (
        (tok_config.get("bos_token"), writer.add_bos_token_id),
        (tok_config.get("eos_token"), writer.add_eos_token_id),
        (tok_config.get("pad_token"), writer.add_pad_token_id),
    ):
        token_id = _token_id(model_dir, content)
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    writer.add_add_eos_token(False)
    if tok_config.get("chat_template"):
        writer.add_chat_template(str(tok_config["chat_template"]))

    qtypes: dict[str, int] = {}
    for name, w in _tensor_map(config, state):
        data = np.ascontiguousarray(w, dtype=np.float32)
        qtype = gguf.GGMLQuantizationType.F32
        if kind == "q8_0" and data.ndim == 2 and data.shape[-1] % Q8_0_BLOCK == 0:
            qtype = gguf.GGMLQuantizationType.Q8_0
            data = gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        qtypes[qtype.name] = qtypes.get(qtype.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {
        "file": out_path.name,
        "tensor_types": qtypes,
        "size_bytes": out_path.stat().st_size,
        "converter": "tierline llama writer",
    }
