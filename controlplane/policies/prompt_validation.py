"""Validation items for any edge/cloud LM pair from a team's own prompts: what ``tierline policies calibrate
--data PROMPTS`` runs before calibrating (the zoo's items come from ``tierline bench cascade --export-validation``).

A prompts file is JSON Lines, one item a line:

    {"prompt": "The capital of France is", "reference": "Paris"}
    {"messages": [{"role": "user", "content": "2 + 2 = ?"}], "reference": "4"}
    {"prompt": "def add(a, b):"}

``prompt`` is completion text (encoded as ``/v1/completions`` encodes it); ``messages`` is a chat, rendered with
each model's own chat template (a model without one refuses it). Both tiers answer greedily, up to
``max_new_tokens`` or their EOS. An answer is right when, normalised (case, spaces, surrounding punctuation), it is
the reference or starts with it followed by a word boundary; without a ``reference`` the cloud's answer is the
reference (the cloud is right by definition, the edge when it gives the cloud's answer). The edge's signals are
the device's: ``lm_signals`` of its generated tokens' logits and ``copy_signals``.

Each model runs from its registry files: an edge LM artifact (ONNX INT8, then ONNX) on the device runtime where
the version has one, else its Hugging Face checkpoint on transformers (the numerics' oracle).
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from sqlmodel import Session, select

from controlplane.storage.tables import ModelArtifact
from shared.errors import ConfigurationError, NotFoundError, ValidationError

DEFAULT_MAX_NEW_TOKENS = 32
MAX_PROMPTS = 10_000
EDGE_FORMATS = ("onnx-int8", "onnx")  # an edge LM artifact the device runtime loads, preferred in this order
CHECKPOINT_FORMAT = "hf-safetensors"


@dataclass(frozen=True, slots=True)
class PromptItem:
    """One validation prompt: completion text or chat messages, and the right answer when the file gives one."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    reference: str | None


def is_prompts_file(path: Path) -> bool:
    """Whether ``path`` holds prompts (this module's format) rather than validation rows with ``signals``."""
    try:
        with path.open(encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        row = json.loads(first) if first else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # read_validation names the problem
    return isinstance(row, dict) and "signals" not in row and ("prompt" in row or "messages" in row)


def _item(row: Any, where: str) -> PromptItem:
    if not isinstance(row, dict):
        raise ValidationError(f"{where}: expected a JSON object", param="data")
    prompt, messages, reference = row.get("prompt"), row.get("messages"), row.get("reference")
    if (prompt is None) == (messages is None):
        raise ValidationError(f"{where}: give exactly one of 'prompt' (text) and 'messages' (a chat)", param="data")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValidationError(f"{where}: 'prompt' must be a non-empty string", param="data")
    if messages is not None and (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ValidationError(f"{where}: 'messages' must be a list of {{'role', 'content'}} strings", param="data")
    if reference is not None and (not isinstance(reference, str) or not normalize_answer(reference)):
        raise ValidationError(f"{where}: 'reference' must be a non-blank string or absent", param="data")
    return PromptItem(prompt=prompt, messages=messages, reference=reference)


def read_prompts(path: Path) -> list[PromptItem]:
    """The prompts of ``path``; a ``ValidationError`` naming the line on anything malformed."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationError(f"cannot read {path}: {exc}", param="data") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"{path}:{n}: not JSON ({exc.msg})", param="data") from None
        items.append(_item(row, f"{path}:{n}"))
    if len(items) > MAX_PROMPTS:
        raise ValidationError(f"{path}: {len(items)} prompts; at most {MAX_PROMPTS}", param="data")
    return items


def normalize_answer(text: str) -> str:
    """Case-folded, NFKC, whitespace collapsed, punctuation stripped from both ends."""
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return text.strip(" .,;:!?\"'`()[]{}")


def is_match(answer: str, reference: str) -> bool:
    """Whether ``answer`` gives ``reference``: the same once normalised, or it and then more after a word
    boundary (a greedy answer runs on past the answer until EOS or its token limit)."""
    a, r = normalize_answer(answer), normalize_answer(reference)
    if not r:
        return not a
    return a == r or (a.startswith(r) and not a[len(r)].isalnum())


class StepRuntime(Protocol):
    """What both tiers run on: the device runtime's interface (``edge_agent.runtime.CausalLMRuntime``)."""

    max_context: int

    def reset(self) -> None: ...
    def prefill(self, ids: list[int]) -> np.ndarray: ...
    def decode(self, token: int) -> np.ndarray: ...


class TransformersRuntime:
    """A Hugging Face checkpoint on transformers, greedy step by step with its KV cache (CPU, float32)."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # a loading bar per model would bury the command's one line
        self._torch = torch
        try:
            self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigurationError(f"{model_dir}: transformers cannot load the checkpoint: {exc}") from None
        self.model.eval()
        config = self.model.config
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        self.max_context = int(positions or 2048)
        self._past: Any = None

    def reset(self) -> None:
        self._past = None

    def _run(self, ids: list[int]) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), cache=self._past, use_cache=True, logits_to_keep=1)
        self._past = out.cache
        logits: np.ndarray = out.logits[0, -1].float().numpy()
        return logits

    def prefill(self, ids: list[int]) -> np.ndarray:
        self.reset()
        return self._run(ids)

    def decode(self, token: int) -> np.ndarray:
        return self._run([token])


class OnnxStepRuntime:
    """An edge LM's ONNX export (fp32 or INT8: ``growing-kv-cache/v1``) under ONNX Runtime, as on the device."""

    def __init__(self, model_dir: Path, meta: dict[str, Any]) -> None:
        from shared.zoo.verify import OnnxRunner

        self._runner = OnnxRunner(model_dir / "model.onnx", meta)
        self.max_context = self._runner.max_tokens

    def reset(self) -> None:
        self._runner.reset()

    def prefill(self, ids: list[int]) -> np.ndarray:
        self._runner.reset()
        return self._runner.prefill(ids)

    def decode(self, token: int) -> np.ndarray:
        return self._runner.decode(token)


def load_step_runtime(model_dir: Path) -> StepRuntime:
    """The ONNX export of an edge LM artifact directory (``edge_model.json``), else transformers."""
    edge = model_dir / "edge_model.json"
    if edge.is_file():
        meta = json.loads(edge.read_text())
        if str(meta.get("format", "")).startswith("onnx"):
            return OnnxStepRuntime(model_dir, meta)
    return TransformersRuntime(model_dir)


@dataclass(slots=True)
class Answer:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    logits: np.ndarray | None  # [T, V], the generated tokens' logits


class PromptRunner:
    """One model answering prompts greedily: its runtime, tokenizer and EOS ids."""

    def __init__(self, name: str, model_dir: Path) -> None:
        from shared.chat_tokenizer import ChatTokenizer

        self.name = name
        self.tokenizer = ChatTokenizer(model_dir, name=name)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        self.runtime = load_step_runtime(model_dir)

    def prompt_ids(self, item: PromptItem) -> list[int]:
        if item.messages is not None:
            text = self.tokenizer.apply_chat_template(item.messages, add_generation_prompt=True)
            ids = self.tokenizer.encode_chat(text)
        else:
            ids = self.tokenizer.encode(item.prompt or "")
        if not ids:
            raise ValidationError(f"a prompt encodes to no tokens for {self.name}", param="data")
        return ids

    def answer(self, item: PromptItem, max_new_tokens: int, where: str = "a prompt") -> Answer:
        ids = self.prompt_ids(item)
        if len(ids) + max_new_tokens > self.runtime.max_context:
            raise ValidationError(
                f"{where}: {len(ids)} prompt tokens and --max-new-tokens {max_new_tokens} exceed {self.name}'s "
                f"context of {self.runtime.max_context} tokens",
                param="data",
            )
        self.runtime.reset()
        logits = self.runtime.prefill(ids)
        out: list[int] = []
        rows: list[np.ndarray] = []
        while len(out) < max_new_tokens:
            token = int(np.argmax(logits))
            if token in self.eos_token_ids:
                break
            rows.append(np.asarray(logits, dtype=np.float32))
            out.append(token)
            if len(out) < max_new_tokens:
                logits = self.runtime.decode(token)
        return Answer(ids, out, self.tokenizer.decode(out), np.stack(rows) if rows else None)


def validation_rows(
    edge: PromptRunner, cloud: PromptRunner, items: list[PromptItem], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
) -> list[dict[str, Any]]:
    """The ``tierline edge calibrate --data`` rows of ``edge`` against ``cloud`` on ``items`` (see the module)."""
    from shared.calibration import validation_row
    from shared.escalation import copy_signals, lm_signals, step_signals

    rows = []
    for n, item in enumerate(items, 1):
        mine = edge.answer(item, max_new_tokens, f"prompt {n}")
        theirs = cloud.answer(item, max_new_tokens, f"prompt {n}")
        signals = lm_signals(step_signals(mine.logits, mine.token_ids) if mine.logits is not None else [])
        signals |= copy_signals(mine.prompt_ids, mine.token_ids)
        agrees = is_match(mine.text, theirs.text)
        reference = item.reference
        rows.append(
            validation_row(
                edge.name,
                signals,
                len(mine.prompt_ids),
                edge_good=agrees if reference is None else is_match(mine.text, reference),
                cloud_good=True if reference is None else is_match(theirs.text, reference),
                agrees_with_cloud=agrees,
            )
        )
    return rows


def write_rows(rows: list[dict[str, Any]], path: Path) -> Path:
    """``rows`` as JSON Lines at ``path`` (atomically: a temporary file renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)
    return path


_FORMAT_ORDER = {f: i for i, f in enumerate((*EDGE_FORMATS, CHECKPOINT_FORMAT))}


def find_artifact(session: Session, name: str, *, edge: bool) -> ModelArtifact:
    """The artifact of registry model ``name`` that a tier runs, from its ``stable`` version else its newest with
    one: for the edge an edge LM export (what devices run; the stable version is often the checkpoint it was
    derived from) wherever one is ready, else the checkpoint; for the cloud the checkpoint."""
    from controlplane.registry import service as registry
    from controlplane.storage.tables import Model

    model = session.exec(select(Model).where(Model.name == name)).first()
    if model is None:
        raise NotFoundError(f"no registry model named {name!r} (tierline models push DIR --name {name})", param="model")
    formats = (*EDGE_FORMATS, CHECKPOINT_FORMAT) if edge else (CHECKPOINT_FORMAT,)
    stable = registry.aliases_of(session, model).get(registry.STABLE)
    versions = sorted(registry.list_versions(session, model), key=lambda v: (v.number != stable, -v.number))
    artifacts = registry.artifacts_of(session, [v.id for v in versions if v.id is not None])
    for wanted in (EDGE_FORMATS, (CHECKPOINT_FORMAT,)) if edge else ((CHECKPOINT_FORMAT,),):
        for version in versions:
            ready = [a for a in artifacts.get(version.id or 0, []) if a.status == "ready" and a.format in wanted]
            if ready:
                return min(ready, key=lambda a: _FORMAT_ORDER[a.format])
    raise ValidationError(f"registry model {name!r} has no ready {' or '.join(formats)} artifact to run", param="model")


def cloud_model_of(session: Session, edge_model: str, given: str | None) -> str:
    """The cloud model ``edge_model`` is calibrated against: ``given``, else its registry pairing
    (``tierline models pair``)."""
    if given:
        return given
    from controlplane.storage.tables import Model

    model = session.exec(select(Model).where(Model.name == edge_model)).first()
    paired = getattr(model, "cloud_model", None) if model is not None else None
    if not paired:
        raise ValidationError(
            f"no cloud model to grade {edge_model!r} against: give --cloud-model NAME or pair it "
            f"(tierline models pair {edge_model} NAME)",
            param="cloud_model",
        )
    return str(paired)


@contextmanager
def materialized(artifact: ModelArtifact) -> Iterator[Path]:
    """``artifact``'s files, checked against their hashes, in a scratch directory removed afterwards."""
    from controlplane.registry.artifacts import materialize
    from controlplane.registry.store import scratch_dir, store_from_settings

    store = store_from_settings()
    with scratch_dir(store, "calibrate-") as scratch:
        yield materialize(store, artifact, scratch / "model")


def pair_rows(
    session: Session,
    edge_model: str,
    cloud_model: str | None,
    items: list[PromptItem],
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> list[dict[str, Any]]:
    """Validation rows of registry model ``edge_model`` against its cloud model (``cloud_model``, else its pairing)
    on ``items``: both fetched from the artifact store and run here."""
    cloud_name = cloud_model_of(session, edge_model, cloud_model)
    cloud_name = cloud_name.removeprefix("tierline/")  # a zoo id names the registry model of that name, if pushed
    edge_artifact = find_artifact(session, edge_model, edge=True)
    cloud_artifact = find_artifact(session, cloud_name, edge=False)
    with materialized(edge_artifact) as edge_dir, materialized(cloud_artifact) as cloud_dir:
        edge = PromptRunner(edge_model, edge_dir)
        cloud = PromptRunner(cloud_name, cloud_dir)
        return validation_rows(edge, cloud, items, max_new_tokens)
