"""``tierline zoo train``: tokenizer and both LMs of a preset, from the standard-library corpus."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from shared.zoo.corpus import SourceFile, iter_stdlib_files, split_corpus
from shared.zoo.presets import LM_ROLES, Preset
from shared.zoo.tokenizer import save_tokenizer, train_tokenizer
from shared.zoo.train_lm import ProgressFn, distill_lm, encode_documents, save_lm, train_lm

logger = logging.getLogger(__name__)

TRAINING_REPORT = "training.json"
ROLES = LM_ROLES
# role -> offset of its seed from the preset's
SEED_OFFSETS = {"edge": 1, "cloud": 2, "draft": 3, "micro": 4}


def _corpus(preset: Preset) -> tuple[list[SourceFile], list[SourceFile]]:
    return split_corpus(iter_stdlib_files(include_tests=preset.include_test_tree), preset.max_train_files)


def _streams(preset: Preset, tokenizer: Tokenizer) -> tuple[list[SourceFile], list[SourceFile], np.ndarray, np.ndarray]:
    """The corpus split, and each side as one token stream."""
    train_files, held_out = _corpus(preset)
    return (
        train_files,
        held_out,
        encode_documents(tokenizer, [f.text for f in train_files]),
        encode_documents(tokenizer, [f.text for f in held_out]),
    )


def train_tokenizer_for(preset: Preset, out_dir: Path) -> Path:
    """Train the preset's tokenizer once; both LMs share it (speculative decoding needs one vocabulary)."""
    train_files, _ = _corpus(preset)
    tok_dir = out_dir / "tokenizer"
    save_tokenizer(
        train_tokenizer((f.text for f in train_files), preset.vocab_size), tok_dir, preset.max_position_embeddings
    )
    return tok_dir


def train_role(
    preset: Preset, role: str, out_dir: Path, dtype: torch.dtype = torch.float32, progress: ProgressFn | None = None
) -> dict[str, Any]:
    """Train the ``edge``, ``cloud`` or ``micro`` LM with the tokenizer in ``out_dir/tokenizer``, or distill the
    ``draft`` from the first two; save ``out_dir/lm-<role>``."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}")
    if role == "draft":
        return _distill_draft(preset, out_dir, dtype, progress)
    shape, cfg = {
        "edge": (preset.edge, preset.edge_training),
        "cloud": (preset.cloud, preset.cloud_training),
        "micro": (preset.micro, preset.micro_training),
    }[role]
    tok_dir = out_dir / "tokenizer"
    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    train_files, held_out, train_stream, held_out_stream = _streams(preset, tokenizer)
    model, result = train_lm(
        preset,
        shape,
        cfg,
        tokenizer,
        train_stream,
        held_out_stream,
        preset.seed + SEED_OFFSETS[role],
        progress=progress,
    )
    save_lm(model, tok_dir, out_dir / f"lm-{role}", dtype)
    report = {
        "held_out_loss": round(result.held_out_loss, 4),
        "final_train_loss_ema": round(result.train_loss, 4),
        "num_params": result.num_params,
        "flops_per_token": shape.flops_per_token(preset.vocab_size),
        "num_tokens_seen": result.num_tokens_seen,
        "train_seconds": round(result.seconds, 1),
        "torch_threads": torch.get_num_threads(),
        "num_train_files": len(train_files),
        "num_held_out_files": len(held_out),
        "num_train_tokens": len(train_stream),
        "num_held_out_tokens": len(held_out_stream),
        "bytes_per_token": round(sum(len(f.text.encode()) for f in train_files) / max(1, len(train_stream)), 3),
    }
    (out_dir / f"training-{role}.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _distill_draft(preset: Preset, out_dir: Path, dtype: torch.dtype, progress: ProgressFn | None) -> dict[str, Any]:
    """The cloud LM's draft for speculative decoding: the edge LM, trained further on the cloud LM's
    next-token distribution, so that the cloud LM accepts more of what it proposes."""
    from transformers import LlamaForCausalLM

    for role in ("edge", "cloud"):
        if not (out_dir / f"lm-{role}" / "config.json").is_file():
            raise FileNotFoundError(f"{out_dir / f'lm-{role}'}: train the {role} LM before distilling the draft")
    tok_dir = out_dir / "tokenizer"
    _, _, train_stream, held_out_stream = _streams(preset, Tokenizer.from_file(str(tok_dir / "tokenizer.json")))
    student = LlamaForCausalLM.from_pretrained(out_dir / "lm-edge", dtype=torch.float32)
    teacher = LlamaForCausalLM.from_pretrained(out_dir / "lm-cloud", dtype=torch.float32)
    model, result = distill_lm(
        preset,
        student,
        teacher,
        preset.draft_training,
        train_stream,
        held_out_stream,
        preset.seed + SEED_OFFSETS["draft"],
        progress,
    )
    save_lm(model, tok_dir, out_dir / "lm-draft", dtype)
    report = {
        "distilled_from": "lm-cloud",
        "initialised_from": "lm-edge",
        "held_out_loss": round(result.held_out_loss, 4),
        "top1_agreement_with_cloud_before": round(result.agreement_before, 4),
        "top1_agreement_with_cloud": round(result.agreement_after, 4),
        "final_train_kl_ema": round(result.train_kl, 4),
        "num_params": sum(p.numel() for p in model.parameters()),
        "num_tokens_seen": result.num_tokens_seen,
        "train_seconds": round(result.seconds, 1),
        "torch_threads": torch.get_num_threads(),
    }
    (out_dir / "training-draft.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def write_training_report(preset: Preset, out_dir: Path) -> dict[str, Any]:
    """Merge the per-role reports into ``training.json``."""
    report: dict[str, Any] = {"preset": preset.name, "seed": preset.seed}
    for role in ROLES:
        report[role] = json.loads((out_dir / f"training-{role}.json").read_text())
    cloud = preset.cloud.flops_per_token(preset.vocab_size)
    report["cloud_to_edge_compute_ratio"] = round(cloud / preset.edge.flops_per_token(preset.vocab_size), 2)
    report["cloud_to_micro_compute_ratio"] = round(cloud / preset.micro.flops_per_token(preset.vocab_size), 2)
    (out_dir / TRAINING_REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


def train_preset(
    preset: Preset,
    out_dir: Path,
    dtype: torch.dtype = torch.float32,
    progress: dict[str, ProgressFn] | None = None,
) -> dict[str, Any]:
    """Tokenizer, the edge, cloud and micro LMs and the draft in one go; deterministic for a given preset and
    thread count."""
    started = time.monotonic()
    train_tokenizer_for(preset, out_dir)
    for role in ROLES:
        train_role(preset, role, out_dir, dtype, (progress or {}).get(role))
    report = write_training_report(preset, out_dir)
    report["seconds"] = round(time.monotonic() - started, 1)
    return report
