"""What serves a pushed checkpoint (decided from its config.json), and which registry model an edge release
came from: the registry's pure rules."""

from __future__ import annotations

import pytest

from cloud.serving.registry_models import is_enabled, parse_names
from controlplane.registry.service import check_checkpoint, read_checkpoint_config, release_model
from shared.architectures import ENGINE_ARCHITECTURES, support_for, supported_list
from shared.errors import ValidationError


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma2", "mistral", "phi3"])
def test_an_engine_architecture_is_served_by_the_engine_with_its_edge_formats(model_type: str) -> None:
    found = check_checkpoint({"model_type": model_type}, has_serving=False)
    assert found.servable_by[0] == "engine"
    assert found.summary() == f"{model_type}: served by the engine; edge formats onnx, onnx-int8, tflite, gguf"


@pytest.mark.parametrize("model_type", sorted(ENGINE_ARCHITECTURES))
def test_the_edge_formats_are_those_the_architecture_table_lists(model_type: str) -> None:
    runtimes = support_for({"model_type": model_type}).runtimes
    expected = [
        f
        for r, fs in (("onnx", ("onnx", "onnx-int8")), ("tflite", ("tflite",)), ("gguf", ("gguf",)))
        for f in fs
        if r in runtimes
    ]
    assert check_checkpoint({"model_type": model_type}, has_serving=False).edge_formats == tuple(expected)


@pytest.mark.parametrize("config", [{"model_type": "gpt_neox"}, {"model_type": "bert"}, {"architectures": ["X"]}])
def test_an_architecture_the_engine_does_not_run_is_refused_naming_the_supported_ones(config: dict[str, str]) -> None:
    with pytest.raises(ValidationError) as refused:
        check_checkpoint(config, has_serving=False)
    assert supported_list("engine") in refused.value.message
    assert refused.value.param == "config.json"
    if "model_type" in config:
        assert f"architecture {config['model_type']} is not supported" in refused.value.message
    else:
        assert refused.value.message.startswith("config.json has no model_type")


def test_with_a_serving_spec_an_upstream_serves_what_the_engine_cannot() -> None:
    found = check_checkpoint({"model_type": "gpt_neox"}, has_serving=True)
    assert found.servable_by == ("upstream",)
    assert found.summary() == "gpt_neox: served by its upstream only; edge formats none"


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_a_config_that_is_not_a_json_object_is_refused(text: str) -> None:
    with pytest.raises(ValidationError, match=r"config\.json is not"):
        read_checkpoint_config(text)


def test_a_release_maps_to_the_registry_model_it_was_published_from() -> None:
    names = {"acme-edge", "acme-edge-onnx", "lm-edge", "digits-small"}
    assert release_model("acme-edge", names) == "acme-edge"
    assert release_model("acme-edge-onnx", names) == "acme-edge-onnx"  # a model of that very name wins
    assert release_model("acme-edge-onnx-int8", names) == "acme-edge"
    assert release_model("lm-edge-onnx-int8", names) == "lm-edge"
    assert release_model("lm-edge-tflite", names) == "lm-edge"
    assert release_model("lm-edge-gguf", names) == "lm-edge"
    assert release_model("digits-small", names) == "digits-small"
    assert release_model("digits-micro", names) is None
    assert release_model("other-onnx", names) is None


@pytest.mark.parametrize(
    ("value", "names"),
    [(None, None), ("*", None), ("all", None), ("a, b", frozenset({"a", "b"})), ("", frozenset())],
)
def test_registry_models_setting_unset_means_every_model(value: str | None, names: frozenset[str] | None) -> None:
    assert parse_names(value) == names
    assert is_enabled(value) == (value != "")
