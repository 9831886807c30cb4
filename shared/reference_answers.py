"""The source checkpoint's own answers, carried by every LM artifact derived from it.

Derive runs the source checkpoint (transformers, fp32, greedy) on a fixed set of prompts, one of them near the
model's context length, and writes what it answered into ``reference.json`` beside the export's files, so the
file is hashed and signed with the artifact's manifest. Every check after that compares with *these* tokens:
derive's verdict on each export (exact greedy for fp32, a stated agreement for quantized formats), and the
device's runtime guard before it serves a runtime. An export is never checked against another export.

Pure data (no torch, no numpy): devices read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REFERENCE_FILE = "reference.json"
SCHEMA = "tierline-reference-answers/v1"


@dataclass(frozen=True, slots=True)
class ReferencePrompt:
    """One prompt (token ids, the tokenizer's own encoding with any BOS it adds) and the source's greedy
    continuation of it (``greedy``: the token ids it generated, in order, EOS included if it stopped there)."""

    name: str
    token_ids: list[int]
    greedy: list[int]

    @property
    def is_long(self) -> bool:
        return self.name.startswith("long")


@dataclass(frozen=True, slots=True)
class ReferenceAnswers:
    """What the source checkpoint answered: ``produced_by`` says with what (e.g. ``transformers 5.24.0 fp32``)."""

    source: dict[str, str]  # {"name": "<model>@<version>", "sha256": "<the checkpoint artifact's sha256>"}
    produced_by: str
    max_context: int
    prompts: list[ReferencePrompt] = field(default_factory=list)

    def to_json(self) -> str:
        data = {
            "schema": SCHEMA,
            "source": self.source,
            "produced_by": self.produced_by,
            "max_context": self.max_context,
            "prompts": [{"name": p.name, "token_ids": p.token_ids, "greedy": p.greedy} for p in self.prompts],
        }
        return json.dumps(data, separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ReferenceAnswers:
        """Parse and check the shape; ValueError names what is wrong."""
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{REFERENCE_FILE}: invalid JSON ({exc.msg})") from None
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ValueError(f"{REFERENCE_FILE}: not a {SCHEMA} document")
        prompts = []
        for i, raw in enumerate(data.get("prompts") or []):
            ok = (
                isinstance(raw, dict)
                and isinstance(raw.get("name"), str)
                and _ids(raw.get("token_ids"))
                and _ids(raw.get("greedy"))
                and raw["token_ids"]
            )
            if not ok:
                raise ValueError(f"{REFERENCE_FILE}: prompt {i} needs a name and non-empty token_ids and greedy ids")
            prompts.append(ReferencePrompt(raw["name"], list(raw["token_ids"]), list(raw["greedy"])))
        if not prompts:
            raise ValueError(f"{REFERENCE_FILE}: no prompts")
        source = data.get("source")
        if not isinstance(source, dict):
            raise ValueError(f"{REFERENCE_FILE}: source must be an object")
        return cls(
            source={str(k): str(v) for k, v in source.items()},
            produced_by=str(data.get("produced_by", "")),
            max_context=int(data.get("max_context", 0)),
            prompts=prompts,
        )

    @classmethod
    def read(cls, directory: Path) -> ReferenceAnswers | None:
        """The artifact's reference answers, or None when it carries none (an artifact derived before them)."""
        path = directory / REFERENCE_FILE
        return cls.from_json(path.read_text()) if path.is_file() else None


def _ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def greedy_agreement(reference: list[int], predicted: list[int]) -> float:
    """Teacher-forced agreement: the share of positions where ``predicted`` (the candidate's most likely next token
    after the reference's prefix) is the reference's token. 1.0 means the same greedy output."""
    if not reference:
        return 1.0
    same = sum(1 for a, b in zip(reference, predicted, strict=False) if a == b)
    return same / len(reference)


def first_divergence(reference: list[int], generated: list[int]) -> int | None:
    """The first position where a free-running greedy generation leaves the reference, or None when it never
    does (over the reference's length)."""
    for i, token in enumerate(reference):
        if i >= len(generated) or generated[i] != token:
            return i
    return None
