"""Derived zoo artifacts: edge LM exports (ONNX fp32/INT8, TFLite), GGUF exports of the LMs for llama.cpp, and
the digits classifiers."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.zoo.presets import Preset

if TYPE_CHECKING:
    from shared.zoo.digits import DigitsSplit

logger = logging.getLogger(__name__)

LM_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
EDGE_MODEL_FILE = "edge_model.json"
NUM_CHECK_WINDOWS = 4
CHECK_WINDOW = 64


def _copy_side_files(src: Path, dst: Path) -> None:
    for name in LM_SIDE_FILES:
        shutil.copy2(src / name, dst / name)


def _check_windows(lm_dir: Path) -> np.ndarray:
    """Token windows from held-out standard-library files, for export checks: int64 [N, CHECK_WINDOW]."""
    from tokenizers import Tokenizer

    from shared.zoo.corpus import held_out_files

    tok = Tokenizer.from_file(str(lm_dir / "tokenizer.json"))
    ids: list[int] = []
    for f in held_out_files():
        ids.extend(tok.encode(f.text).ids)
        if len(ids) >= NUM_CHECK_WINDOWS * CHECK_WINDOW:
            break
    return np.asarray(ids[: NUM_CHECK_WINDOWS * CHECK_WINDOW], dtype=np.int64).reshape(NUM_CHECK_WINDOWS, -1)


def _onnx_logits(model_path: Path, windows: np.ndarray, meta: dict[str, Any]) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    empty = np.zeros((meta["num_layers"], len(windows), meta["num_kv_heads"], 0, meta["head_dim"]), np.float32)
    logits: np.ndarray = sess.run(["logits"], {"input_ids": windows, "past_keys": empty, "past_values": empty})[0]
    return logits


def derive_edge_lm_artifacts(
    lm_dir: Path, arts: Path, say: Callable[[str], None], *, name: str = "lm-edge", tflite: bool = True
) -> dict[str, Any]:
    """Write ``<name>-onnx``, ``<name>-onnx-int8`` and (with ``tflite``, when litert-torch is installed)
    ``<name>-tflite`` from the LM in ``lm_dir``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from shared.zoo.export_lm import export_onnx, export_tflite, quiet_root_logger

    config = json.loads((lm_dir / "config.json").read_text())
    meta = {
        "num_layers": config["num_hidden_layers"],
        "num_kv_heads": config["num_key_value_heads"],
        "head_dim": config["hidden_size"] // config["num_attention_heads"],
        "vocab_size": config["vocab_size"],
        "max_context": config["max_position_embeddings"],
    }
    fp32_dir, int8_dir = arts / f"{name}-onnx", arts / f"{name}-onnx-int8"
    fp32_dir.mkdir()
    int8_dir.mkdir()
    export_onnx(lm_dir, fp32_dir / "model.onnx")
    with quiet_root_logger():
        quantize_dynamic(fp32_dir / "model.onnx", int8_dir / "model.onnx", weight_type=QuantType.QInt8)
    for d, fmt in ((fp32_dir, "onnx"), (int8_dir, "onnx-int8")):
        _copy_side_files(lm_dir, d)
        (d / EDGE_MODEL_FILE).write_text(json.dumps({"format": fmt, "io": "growing-kv-cache/v1", **meta}, indent=2))

    windows = _check_windows(lm_dir)
    fp32 = _onnx_logits(fp32_dir / "model.onnx", windows, meta)
    int8 = _onnx_logits(int8_dir / "model.onnx", windows, meta)
    agreement = float((fp32.argmax(-1) == int8.argmax(-1)).mean())
    result: dict[str, Any] = {"int8_top1_agreement": round(agreement, 4), "tflite": None}
    say(f"{name} INT8 agrees with fp32 on {agreement:.1%} of next-token choices")

    if not tflite:
        return result
    if importlib.util.find_spec("litert_torch") is None:
        result["tflite_skipped"] = "litert-torch is not installed (pip install 'tierline[convert]')"
        logger.warning("skipping TFLite: %s", result["tflite_skipped"])
        return result
    tfl_dir = arts / f"{name}-tflite"
    tfl_dir.mkdir()
    io = export_tflite(lm_dir, tfl_dir / "model.tflite")
    _copy_side_files(lm_dir, tfl_dir)
    (tfl_dir / EDGE_MODEL_FILE).write_text(json.dumps({"format": "tflite", **meta, **io}, indent=2))
    diff = _tflite_max_abs_diff(tfl_dir / "model.tflite", windows[0], fp32[0], io["prefill_chunk"])
    result["tflite"] = {"max_abs_diff_vs_onnx": float(f"{diff:.3g}"), **io}
    say(f"TFLite prefill logits within {diff:.2g} of ONNX fp32")
    return result


GGUF_LMS = ("lm-cloud", "lm-edge")


def derive_gguf_artifacts(arts: Path) -> dict[str, Any]:
    """Write ``<lm>-gguf/model-f32.gguf`` and ``model-q8_0.gguf`` for the cloud and edge LMs (what llama.cpp runs,
    for the project's benchmarks against it and for serving them with llama.cpp's server); return the facts."""
    from shared.zoo.export_gguf import GGUF_FILES, export_gguf

    result: dict[str, Any] = {}
    for lm in GGUF_LMS:
        out = arts / f"{lm}-gguf"
        out.mkdir()
        files = {kind: export_gguf(arts / lm, out / name, kind) for kind, name in GGUF_FILES.items()}
        _copy_side_files(arts / lm, out)
        result[lm] = files
    return result


def _tflite_max_abs_diff(path: Path, window: np.ndarray, reference: np.ndarray, chunk: int) -> float:
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    interp = Interpreter(
        model_path=str(path),
        num_threads=1,
        experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
    )
    prefill = interp.get_signature_runner("prefill")
    shape = tuple(prefill.get_input_details()["k_cache"]["shape"])
    zeros = np.zeros(shape, np.float32)
    out = prefill(
        input_ids=window[None, :chunk].astype(np.int32),
        input_pos=np.arange(chunk, dtype=np.int32),
        k_cache=zeros,
        v_cache=zeros.copy(),
    )
    return float(np.abs(out["logits"][0] - reference[:chunk]).max())


def derive_digits_artifacts(preset: Preset, arts: Path, data_dir: Path) -> dict[str, Any]:
    """Train both classifiers, export them to ONNX, save the held-out split; return held-out accuracies."""
    from shared.zoo.digits import accuracy, export_classifier, load_split, train_classifier

    split = load_split()
    data_dir.mkdir(parents=True, exist_ok=True)
    np.savez(data_dir / "digits-held-out.npz", x=split.x_held_out, y=split.y_held_out)
    result: dict[str, Any] = {"num_train": len(split.y_train), "num_held_out": len(split.y_held_out)}
    for role, hidden, seed in (
        ("small", preset.digits_small_hidden, preset.seed + 11),
        ("large", preset.digits_large_hidden, preset.seed + 12),
    ):
        model = train_classifier(split, hidden, preset.digits_epochs, seed)
        out = arts / f"digits-{role}"
        export_classifier(model, out / "model.onnx")
        (out / "classifier.json").write_text(
            json.dumps(
                {
                    "input": "pixels",
                    "output": "logits",
                    "num_features": 64,
                    "labels": list(range(10)),
                    "hidden": list(hidden),
                },
                indent=2,
            )
        )
        result[f"{role}_accuracy"] = round(accuracy(model, split.x_held_out, split.y_held_out), 4)
        result[f"{role}_num_params"] = sum(p.numel() for p in model.parameters())
    result.update(_derive_digits_micro(split, arts / "digits-micro"))
    return result


def _derive_digits_micro(split: DigitsSplit, out: Path) -> dict[str, Any]:
    """The microcontroller-class edge classifier (``shared.zoo.digits.train_micro``), INT8 ONNX; its held-out
    accuracy is measured on the exported INT8 graph through ONNX Runtime, as the device runs it."""
    import onnxruntime as ort

    from shared.zoo.digits import MICRO_POOL, export_micro, train_micro

    weights, bias = train_micro(split)
    export_micro(weights, bias, split.x_train, out / "model.onnx")
    meta = {"input": "pixels", "output": "logits", "num_features": 64, "labels": list(range(10))}
    meta |= {"hidden": [], "pooling": [MICRO_POOL, MICRO_POOL], "quantization": "int8-qdq"}
    (out / "classifier.json").write_text(json.dumps(meta, indent=2))
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], {"pixels": split.x_held_out})[0]
    return {
        "micro_accuracy": round(float((logits.argmax(-1) == split.y_held_out).mean()), 4),
        "micro_num_params": int(weights.size + bias.size),
        "micro_model_bytes": (out / "model.onnx").stat().st_size,
    }
