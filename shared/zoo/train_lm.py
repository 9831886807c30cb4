"""Training of the zoo's Llama-family causal LMs (torch + transformers; build-time only)."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from tokenizers import Tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from shared.zoo.presets import LMShape, LMTraining, Preset
from shared.zoo.tokenizer import BOS_EOS_TOKEN, IM_END, PAD_TOKEN

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int, int, float], None]


@dataclass(slots=True)
class TrainResult:
    held_out_loss: float
    train_loss: float
    num_params: int
    num_tokens_seen: int
    seconds: float


@dataclass(slots=True)
class DistillResult:
    held_out_loss: float
    agreement_before: float
    agreement_after: float
    train_kl: float
    num_tokens_seen: int
    seconds: float


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream: each document is preceded by <|endoftext|>."""
    eot = tokenizer.token_to_id(BOS_EOS_TOKEN)
    if eot is None:
        raise ValueError(f"tokenizer has no {BOS_EOS_TOKEN} token")
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.append(eot)
        ids.extend(enc.ids)
    return np.asarray(ids, dtype=np.int32)


def llama_config(preset: Preset, shape: LMShape, tokenizer: Tokenizer) -> LlamaConfig:
    rope: dict[str, Any] = {"rope_theta": 10000.0}
    return LlamaConfig(
        **rope,
        vocab_size=preset.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(BOS_EOS_TOKEN),
        eos_token_id=tokenizer.token_to_id(BOS_EOS_TOKEN),
        pad_token_id=tokenizer.token_to_id(PAD_TOKEN),
    )


def _lr_at(step: int, cfg: LMTraining) -> float:
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.num_steps - cfg.warmup_steps)
    return cfg.learning_rate * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _windows(stream: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    batch = np.stack([stream[s : s + seq_len] for s in starts]).astype(np.int64)
    return torch.from_numpy(batch)


@torch.no_grad()
def evaluate_loss(model: LlamaForCausalLM, stream: np.ndarray, seq_len: int, num_windows: int) -> float:
    """Mean next-token loss over evenly spaced windows of a held-out token stream."""
    model.eval()
    last = len(stream) - seq_len - 1
    if last <= 0:
        raise ValueError("held-out stream is shorter than one window")
    starts = np.linspace(0, last, num_windows).astype(np.int64)
    losses = []
    for chunk in np.array_split(starts, max(1, num_windows // 16)):
        ids = _windows(stream, chunk, seq_len)
        losses.append(float(model(input_ids=ids, labels=ids).loss) * len(chunk))
    return sum(losses) / num_windows


def _optimizer(model: torch.nn.Module, cfg: LMTraining) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.learning_rate,
        betas=(0.9, 0.95),
    )


def _fit(
    model: torch.nn.Module,
    cfg: LMTraining,
    train_stream: np.ndarray,
    rng: np.random.Generator,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    progress: ProgressFn | None,
) -> tuple[float, float]:
    """``cfg.num_steps`` AdamW steps on random windows of ``train_stream`` (cosine schedule, clipped
    gradients); returns the loss's moving average at the end and the seconds taken."""
    model.train()
    optimizer = _optimizer(model, cfg)
    started = time.monotonic()
    max_start = len(train_stream) - cfg.seq_len - 1
    ema = float("nan")
    for step in range(cfg.num_steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, cfg)
        loss = loss_of(_windows(train_stream, rng.integers(0, max_start, cfg.batch_size), cfg.seq_len))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        value = float(loss.detach())
        ema = value if math.isnan(ema) else 0.95 * ema + 0.05 * value
        if progress is not None:
            progress(step + 1, cfg.num_steps, ema)
    return ema, time.monotonic() - started


@torch.no_grad()
def top1_agreement(
    student: LlamaForCausalLM, teacher: LlamaForCausalLM, stream: np.ndarray, seq_len: int, num_windows: int
) -> float:
    """Share of held-out positions where both models' most likely next token is the same (teacher forcing):
    about the rate at which the target accepts a greedy draft's proposals."""
    student.eval()
    starts = np.linspace(0, len(stream) - seq_len - 1, num_windows).astype(np.int64)
    same = total = 0
    for chunk in np.array_split(starts, max(1, num_windows // 16)):
        ids = _windows(stream, chunk, seq_len)
        a, b = student(input_ids=ids).logits.argmax(-1), teacher(input_ids=ids).logits.argmax(-1)
        same += int((a == b).sum())
        total += a.numel()
    return same / total


def distill_lm(
    preset: Preset,
    student: LlamaForCausalLM,
    teacher: LlamaForCausalLM,
    cfg: LMTraining,
    train_stream: np.ndarray,
    held_out_stream: np.ndarray,
    seed: int,
    progress: ProgressFn | None = None,
) -> tuple[LlamaForCausalLM, DistillResult]:
    """Train ``student`` towards ``teacher``'s next-token distribution (forward KL on its logits, every
    position of corpus windows) for a fixed number of steps: a draft whose guesses the teacher accepts more
    often (speculative decoding). Deterministic for a given seed and thread count."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    teacher.eval()
    before = top1_agreement(student, teacher, held_out_stream, cfg.seq_len, preset.num_eval_windows)

    def kl_to_teacher(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                target = F.log_softmax(teacher(input_ids=ids).logits.float(), dim=-1)
            guess = F.log_softmax(student(input_ids=ids).logits.float(), dim=-1)
        return F.kl_div(guess, target, log_target=True, reduction="sum") / ids.numel()

    ema, seconds = _fit(student, cfg, train_stream, rng, kl_to_teacher, progress)
    result = DistillResult(
        held_out_loss=evaluate_loss(student, held_out_stream, cfg.seq_len, preset.num_eval_windows),
        agreement_before=before,
        agreement_after=top1_agreement(student, teacher, held_out_stream, cfg.seq_len, preset.num_eval_windows),
        train_kl=ema,
        num_tokens_seen=cfg.num_steps * cfg.batch_size * cfg.seq_len,
        seconds=seconds,
    )
    logger.info("distilled draft: top-1 agreement %.3f -> %.3f", result.agreement_before, result.agreement_after)
    return student, result


def train_lm(
    preset: Preset,
    shape: LMShape,
    cfg: LMTraining,
    tokenizer: Tokenizer,
    train_stream: np.ndarray,
    held_out_stream: np.ndarray,
    seed: int,
    progress: ProgressFn | None = None,
) -> tuple[LlamaForCausalLM, TrainResult]:
    """Train one LM for a fixed number of steps; deterministic for a given seed and thread count."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    config = llama_config(preset, shape, tokenizer)
    model = LlamaForCausalLM(config)

    def next_token_loss(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return cast(torch.Tensor, model(input_ids=ids, labels=ids).loss)

    ema_loss, seconds = _fit(model, cfg, train_stream, rng, next_token_loss, progress)
    held_out = evaluate_loss(model, held_out_stream, cfg.seq_len, preset.num_eval_windows)
    result = TrainResult(
        held_out_loss=held_out,
        train_loss=ema_loss,
        num_params=sum(p.numel() for p in model.parameters()),
        num_tokens_seen=cfg.num_steps * cfg.batch_size * cfg.seq_len,
        seconds=seconds,
    )
    logger.info("trained %s-layer LM: held-out loss %.3f in %.0fs", shape.num_layers, held_out, seconds)
    return model, result


def save_lm(model: LlamaForCausalLM, tokenizer_dir: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """Save in the Hugging Face layout, tokenizer files and generation config included."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = cast(LlamaForCausalLM, torch.nn.Module.to(model, dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out_dir / name).write_bytes((tokenizer_dir / name).read_bytes())
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = [tok.token_to_id(BOS_EOS_TOKEN), tok.token_to_id(IM_END)]
    GenerationConfig(
        bos_token_id=tok.token_to_id(BOS_EOS_TOKEN), eos_token_id=eos, pad_token_id=tok.token_to_id(PAD_TOKEN)
    ).save_pretrained(out_dir)
    # Drop keys that differ between transformers versions so committed weights stay byte-stable.
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("transformers_version", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
