"""The registry's pure rules: names, status moves, what an upload's file names say, the INT8 guard."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.registry import artifacts as registry_artifacts
from controlplane.registry import service as registry
from controlplane.registry.edge_derive import int8_verdict
from shared.errors import ValidationError


@pytest.mark.parametrize(
    ("current", "allowed"),
    [
        ("registered", {"validated", "retired"}),
        ("validated", {"active", "retired"}),
        ("active", {"retired"}),
        ("retired", set()),
    ],
)
def test_status_moves_forward_only(current: str, allowed: set[str]) -> None:
    assert {s for s in registry.STATUSES if registry.can_move_status(current, s)} == allowed


@pytest.mark.parametrize(
    ("paths", "expected"),
    [
        (["config.json", "model.safetensors", "tokenizer.json"], ("cloud", "hf-safetensors")),
        (["sub/config.json", "sub/model-00001-of-00002.safetensors"], ("cloud", "hf-safetensors")),
        (["model.onnx"], ("cloud", "onnx")),
        (["model.tflite", "tokenizer.json"], ("edge", "tflite")),
        (["model.plan"], ("cloud", "tensorrt-plan")),
    ],
)
def test_the_format_is_told_by_file_names(paths: list[str], expected: tuple[str, str]) -> None:
    assert registry.infer_format(paths) == expected


def test_unknown_files_ask_for_a_format() -> None:
    with pytest.raises(ValidationError) as caught:
        registry.infer_format(["weights.bin", "notes.txt"])
    assert caught.value.param == "format"


@pytest.mark.parametrize("path", ["", "/etc/passwd", "../x", "a/../../b", "a//b", "a\\b", "./a", "a\x00b"])
def test_unsafe_paths_are_refused(path: str) -> None:
    assert not registry.is_safe_relpath(path)


@pytest.mark.parametrize("path", ["model.onnx", "sub/dir/config.json", "model-00001-of-00002.safetensors"])
def test_safe_paths_pass(path: str) -> None:
    assert registry.is_safe_relpath(path)


@pytest.mark.parametrize(
    ("check", "value", "param"),
    [
        (registry.check_name, "has space", "name"),
        (registry.check_name, "a/b", "name"),
        (registry.check_name, "x" * 129, "name"),
        (registry.check_kind, "vision", "kind"),
        (registry.check_alias, "-stable", "alias"),
        (registry.check_label, "", "label"),
    ],
)
def test_bad_names_name_their_field(check: object, value: str, param: str) -> None:
    assert callable(check)
    with pytest.raises(ValidationError) as caught:
        check(value)
    assert caught.value.param == param and repr(value)[:20] in caught.value.message


def test_tags_are_checked_deduplicated_and_capped() -> None:
    assert registry.check_tags(["a", "b", "a", "env=prod"]) == ["a", "b", "env=prod"]
    with pytest.raises(ValidationError, match="tag 'no spaces'"):
        registry.check_tags(["no spaces"])
    with pytest.raises(ValidationError, match="at most 32"):
        registry.check_tags([f"t{i}" for i in range(33)])


def test_target_and_format_must_agree() -> None:
    registry.check_target_format("edge", "onnx-int8")
    with pytest.raises(ValidationError) as caught:
        registry.check_target_format("cloud", "onnx-int8")
    assert caught.value.param == "format"
    with pytest.raises(ValidationError) as caught:
        registry.check_target_format("phone", "onnx")
    assert caught.value.param == "target"


def test_the_int8_guard_rejects_below_the_bound() -> None:
    assert int8_verdict(0.95, 0.9) == "ready"
    assert int8_verdict(0.9, 0.9) == "ready"
    assert int8_verdict(0.899, 0.9) == "rejected"


def test_paths_are_recognised(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"\x00")
    assert (registry_artifacts.inspect_path(ckpt).target, registry_artifacts.inspect_path(ckpt).format) == (
        "cloud",
        "hf-safetensors",
    )
    edge = tmp_path / "edge"
    edge.mkdir()
    (edge / "model.onnx").write_bytes(b"\x00")
    (edge / "edge_model.json").write_text('{"format": "onnx-int8"}')
    found = registry_artifacts.inspect_path(edge)
    assert (found.target, found.format, found.kind) == ("edge", "onnx-int8", "causal-lm")
    onnx = tmp_path / "digits.onnx"
    onnx.write_bytes(b"\x00")
    found = registry_artifacts.inspect_path(onnx)
    assert (found.target, found.format, found.kind, [r for r, _ in found.files]) == (
        "cloud",
        "onnx",
        "tensor",
        ["digits.onnx"],
    )
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.txt").write_text("a")
    (tmp_path / "junk" / "b.txt").write_text("b")
    with pytest.raises(ValidationError, match="not an HF checkpoint"):
        registry_artifacts.inspect_path(tmp_path / "junk")
