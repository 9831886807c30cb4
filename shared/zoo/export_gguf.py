"""Export of the zoo's Hugging Face Llama checkpoints to GGUF, the format llama.cpp runs.

Written with the ``gguf`` package's writer (the one llama.cpp's own converter uses), for the zoo's layout only:
a Llama with tied embeddings, grouped-query attention, RoPE and a byte-level BPE tokenizer (GPT-2
pre-tokenization). Two files per LM:

- ``model-f32.gguf``: every tensor in float32, so llama.cpp's greedy outputs match this project's engine
  token for token;
- ``model-q8_0.gguf``: the 2-D weights in Q8_0 (blocks of 32 int8 with a float16 scale, llama.cpp's usual
  8-bit format); 1-D norm weights, and a matrix whose rows are not a multiple of 32 long, stay float32.

llama.cpp's Llama applies RoPE to interleaved pairs of a head's dimensions, where Hugging Face rotates its two
halves; the query and key projections are permuted here, as llama.cpp's converter does, so both compute the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

GGUF_F32 = "model-f32.gguf"
GGUF_Q8_0 = "model-q8_0.gguf"
GGUF_FILES = {"f32": GGUF_F32, "q8_0": GGUF_Q8_0}
# llama.cpp's token types (llama_token_type): a normal vocabulary token, a special one, unused padding.
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5
Q8_0_BLOCK = 32  # values per Q8_0 block: a row must be a multiple of it


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


def export_gguf(model_dir: Path, out_path: Path, kind: str = "f32") -> dict[str, Any]:
    """Write ``model_dir`` (the zoo's HF Llama layout) to one GGUF file; ``kind`` is ``f32`` or ``q8_0``.
    Returns what was written: the tensor types used and the file's size."""
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
    return {"file": out_path.name, "tensor_types": qtypes, "size_bytes": out_path.stat().st_size}
