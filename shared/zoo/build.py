"""``tierline zoo build``: train or take the LMs, derive the edge artifacts, sign every manifest, verify.

Layout of ``<zoo_dir>/<preset>/``::

    zoo.json                     what was built, with the measured numbers
    artifacts/<name>/...         one directory per artifact
    manifests/<name>.json        its signed manifest
    data/digits-held-out.npz     the fixed held-out split of the digits data (also an artifact)

A build is cached: when ``zoo.json`` exists with the same fingerprint the call returns at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.artifacts import build_manifest, write_signed_manifest
from shared.errors import ArtifactVerificationError
from shared.zoo.presets import LM_ROLES, Preset
from shared.zoo.registry import ARTIFACTS_DIR, MANIFESTS_DIR, ZOO_REPORT, ZooLayout, verify_zoo

logger = logging.getLogger(__name__)

StepFn = Callable[[str], None]
# Messages a full build sends to ``step`` (weights, edge export, INT8 check, TFLite check, the micro LM's INT8
# check, GGUF, digits, signing, done), so a caller can draw a progress bar.
NUM_BUILD_STEPS = 9
BUILD_FORMAT = 1
COMMITTED_WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
PINNED_HASHES = "SHA256SUMS"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def fingerprint(preset: Preset) -> str:
    """Changes when the preset or the zoo's code changes, so a cached build is never stale."""
    code = hashlib.sha256()
    for src in sorted(Path(__file__).resolve().parent.glob("*.py")):
        code.update(src.read_bytes())
    data = json.dumps(
        {"preset": asdict(preset), "format": BUILD_FORMAT, "code": code.hexdigest()}, sort_keys=True, default=str
    )
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def is_built(layout: ZooLayout, preset: Preset) -> bool:
    try:
        report = json.loads(layout.report_path.read_text())
    except (OSError, ValueError):
        return False
    return bool(report.get("fingerprint") == fingerprint(preset))


def committed_weights(preset: Preset) -> Path:
    return COMMITTED_WEIGHTS_DIR / preset.name


def check_pinned_hashes(weights_dir: Path) -> None:
    """The committed weights must hash to what the repository pins (``SHA256SUMS``)."""
    from shared.artifacts import sha256_file

    sums = weights_dir / PINNED_HASHES
    if not sums.is_file():
        raise ArtifactVerificationError(f"{sums}: missing; run `tierline zoo train --preset demo` to create it")
    for line in sums.read_text().splitlines():
        digest, _, rel = line.partition("  ")
        path = weights_dir / rel
        if not path.is_file() or sha256_file(path) != digest:
            raise ArtifactVerificationError(f"{path}: does not match the sha256 pinned in {sums}")


def write_pinned_hashes(weights_dir: Path) -> None:
    from shared.artifacts import sha256_file

    files = sorted(p for p in weights_dir.rglob("*") if p.is_file() and p.name != PINNED_HASHES)
    lines = [f"{sha256_file(p)}  {p.relative_to(weights_dir).as_posix()}" for p in files]
    (weights_dir / PINNED_HASHES).write_text("\n".join(lines) + "\n")


def build_zoo(
    preset: Preset,
    zoo_dir: Path,
    signing_key: Ed25519PrivateKey,
    *,
    retrain: bool = False,
    force: bool = False,
    step: StepFn | None = None,
) -> dict[str, Any]:
    """Build (or return the cached) zoo of ``preset`` under ``zoo_dir/<preset>``; return its report."""
    layout = ZooLayout(zoo_dir / preset.name)
    if is_built(layout, preset) and not (force or retrain):
        return dict(json.loads(layout.report_path.read_text()))
    say = step or (lambda msg: logger.info("%s", msg))
    started = time.monotonic()
    work = layout.root.with_name(layout.root.name + ".building")
    shutil.rmtree(work, ignore_errors=True)
    (work / ARTIFACTS_DIR).mkdir(parents=True)
    arts = work / ARTIFACTS_DIR
    report: dict[str, Any] = {"preset": preset.name, "fingerprint": fingerprint(preset)}

    from shared.zoo.derive import derive_digits_artifacts, derive_edge_lm_artifacts, derive_gguf_artifacts

    if preset.is_committed and not retrain:
        say(f"taking the committed {preset.name} weights (pinned sha256)")
        src = committed_weights(preset)
        check_pinned_hashes(src)
        for role in LM_ROLES:
            shutil.copytree(src / f"lm-{role}", arts / f"lm-{role}")
        training = json.loads((src / "training.json").read_text())
    else:
        from shared.zoo.train import train_preset

        say(f"training the {preset.name} tokenizer and LMs")
        train_dir = work / "train"
        training = train_preset(preset, train_dir)
        for role in LM_ROLES:
            shutil.move(str(train_dir / f"lm-{role}"), arts / f"lm-{role}")
        shutil.rmtree(train_dir)
    report["training"] = training

    say("deriving edge LM artifacts: ONNX fp32 with KV cache, ONNX INT8, TFLite (lm-micro: ONNX only)")
    report["edge_lm"] = derive_edge_lm_artifacts(arts / "lm-edge", arts, say)
    # The micro LM is not served by the agent; its INT8 export is the edge side of the bench's LM pair with a
    # real gap (``lm-micro-next8``), run by the same device runtime.
    report["micro_lm"] = derive_edge_lm_artifacts(arts / "lm-micro", arts, say, name="lm-micro", tflite=False)
    say("exporting the cloud and edge LMs to GGUF (f32, Q8_0) for llama.cpp")
    report["gguf"] = derive_gguf_artifacts(arts)
    say("training and exporting the digits classifiers")
    report["digits"] = derive_digits_artifacts(preset, arts, work / "data")

    say("signing and verifying manifests")
    manifests = work / MANIFESTS_DIR
    artifact_meta = _artifact_metadata(report)
    digests: dict[str, str] = {}
    for name in _parents_first(artifact_meta):
        meta = dict(artifact_meta[name])
        parent = meta.pop("derived_from", None)
        derived = {"name": parent, "sha256": digests[parent]} if parent else None
        manifest = build_manifest(
            ZooLayout(work).artifact_dir(name),
            name=name,
            version=f"{preset.name}-1",
            kind=meta.pop("kind"),
            format=meta.pop("format"),
            derived_from=derived,
            metadata=meta,
        )
        write_signed_manifest(manifest, signing_key, manifests / f"{name}.json")
        digests[name] = manifest.sha256
    report["artifacts"] = {n: {"sha256": d, **artifact_meta[n]} for n, d in sorted(digests.items())}
    failures = [f"{path}: {err}" for path, err in verify_zoo(work, [signing_key.public_key()]) if err]
    if failures:
        raise ArtifactVerificationError(f"freshly built zoo does not verify: {failures[0]}")
    report["seconds"] = round(time.monotonic() - started, 1)
    (work / ZOO_REPORT).write_text(json.dumps(report, indent=2) + "\n")

    shutil.rmtree(layout.root, ignore_errors=True)
    work.rename(layout.root)
    say(f"zoo {preset.name} ready at {layout.root} in {report['seconds']}s")
    return report


def _parents_first(meta: dict[str, dict[str, Any]]) -> list[str]:
    """Artifact names ordered so each comes after the one it is derived from (its manifest names its hash)."""
    order: list[str] = []
    pending = sorted(meta)
    while pending:
        ready = [n for n in pending if meta[n].get("derived_from") in (None, *order)]
        if not ready:
            raise ValueError(f"artifacts derive from each other in a cycle or from unknown ones: {pending}")
        order.extend(ready)
        pending = [n for n in pending if n not in ready]
    return order


def _artifact_metadata(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """name -> manifest fields (kind, format, derived_from, and metadata)."""
    training = report["training"]
    meta: dict[str, dict[str, Any]] = {
        "lm-edge": {
            "kind": "causal-lm",
            "format": "hf-safetensors",
            "role": "edge",
            "held_out_loss": training["edge"]["held_out_loss"],
        },
        "lm-cloud": {
            "kind": "causal-lm",
            "format": "hf-safetensors",
            "role": "cloud",
            "held_out_loss": training["cloud"]["held_out_loss"],
        },
        "lm-draft": {
            "kind": "causal-lm",
            "format": "hf-safetensors",
            "role": "draft",
            "derived_from": "lm-edge",
            "distilled_from": "lm-cloud",
            "held_out_loss": training["draft"]["held_out_loss"],
            "top1_agreement_with_cloud": training["draft"]["top1_agreement_with_cloud"],
        },
        "lm-micro": {
            "kind": "causal-lm",
            "format": "hf-safetensors",
            "role": "edge",
            "held_out_loss": training["micro"]["held_out_loss"],
            "num_params": training["micro"]["num_params"],
        },
        "lm-micro-onnx": {"kind": "causal-lm", "format": "onnx", "role": "edge", "derived_from": "lm-micro"},
        "lm-micro-onnx-int8": {
            "kind": "causal-lm",
            "format": "onnx-int8",
            "role": "edge",
            "derived_from": "lm-micro-onnx",
            "agreement_with_fp32": report["micro_lm"]["int8_top1_agreement"],
        },
        "lm-edge-onnx": {"kind": "causal-lm", "format": "onnx", "role": "edge", "derived_from": "lm-edge"},
        "lm-edge-onnx-int8": {
            "kind": "causal-lm",
            "format": "onnx-int8",
            "role": "edge",
            "derived_from": "lm-edge-onnx",
            "agreement_with_fp32": report["edge_lm"]["int8_top1_agreement"],
        },
        "digits-small": {
            "kind": "tensor",
            "format": "onnx",
            "role": "edge",
            "held_out_accuracy": report["digits"]["small_accuracy"],
        },
        "digits-large": {
            "kind": "tensor",
            "format": "onnx",
            "role": "cloud",
            "held_out_accuracy": report["digits"]["large_accuracy"],
        },
        "digits-micro": {
            "kind": "tensor",
            "format": "onnx-int8",
            "role": "edge",
            "held_out_accuracy": report["digits"]["micro_accuracy"],
            "num_params": report["digits"]["micro_num_params"],
            "size_bytes": report["digits"]["micro_model_bytes"],
        },
        "digits-held-out": {"kind": "dataset", "format": "npz"},
    }
    for lm, files in report.get("gguf", {}).items():
        meta[f"{lm}-gguf"] = {
            "kind": "causal-lm",
            "format": "gguf",
            "role": meta[lm]["role"],
            "derived_from": lm,
            "runtime": "llama.cpp",
            "files": {kind: f["file"] for kind, f in files.items()},
        }
    if report["edge_lm"].get("tflite"):
        meta["lm-edge-tflite"] = {
            "kind": "causal-lm",
            "format": "tflite",
            "role": "edge",
            "derived_from": "lm-edge",
            **report["edge_lm"]["tflite"],
        }
    return meta
