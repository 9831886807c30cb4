"""Which cloud model an edge model escalates to: the cloud's pairings as the sync brings them, kept on disk for a
restart while offline, the device's own settings over them, looked up by the model's id or its plain id."""

from __future__ import annotations

from pathlib import Path

from edge_agent.models import without_suffix
from edge_agent.policies import PairingBook
from edge_agent.serving import LocalModels
from edge_agent.tiering import Tiering
from shared.edge_protocol import ModelPairing, SyncResponse


def _tiering() -> Tiering:
    return Tiering(LocalModels({}, 1), None, {}, lambda served: None)


def test_a_sync_answer_carries_pairings_and_they_survive_a_restart(tmp_path: Path) -> None:
    answer = SyncResponse.model_validate(
        {
            "accepted": 0,
            "duplicates": 0,
            "server_time": 0.0,
            "pairings": [
                {"model": "acme-qwen-edge-onnx", "cloud_model": "acme-qwen", "resend": "text"},
                {"model": "lonely-onnx", "cloud_model": None},
            ],
        }
    )
    tiering = _tiering()
    book = PairingBook(tmp_path / "pairings.json", tiering)
    assert tiering.pairings == {}
    book.apply(answer.pairings)
    assert tiering.cloud_model("acme-qwen-edge-onnx") == "acme-qwen"
    assert tiering.cloud_model("lonely-onnx") is None
    restarted = _tiering()
    PairingBook(tmp_path / "pairings.json", restarted)  # offline: nothing from the cloud yet
    assert restarted.pairings == tiering.pairings
    assert restarted.pairing("acme-qwen-edge-onnx") == ModelPairing(
        model="acme-qwen-edge-onnx", cloud_model="acme-qwen", resend="text"
    )
    book.apply([])  # the cloud no longer pairs them: they answer locally
    assert tiering.pairings == {} and PairingBook(tmp_path / "pairings.json", _tiering()).delivered == []


def test_a_corrupt_saved_file_is_ignored_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "pairings.json").write_text("{not json")
    tiering = _tiering()
    PairingBook(tmp_path / "pairings.json", tiering)
    assert tiering.pairings == {}


def test_the_devices_own_pairings_win_and_a_plain_id_pairs_its_formats(tmp_path: Path) -> None:
    tiering = _tiering()
    tiering.families = {"acme-edge-v2": "acme-edge"}  # grouped by its manifest, not by its name
    book = PairingBook(tmp_path / "pairings.json", tiering, {"tierline/lm-edge": "tierline/lm-cloud"})
    book.apply(
        [
            ModelPairing(model="tierline/lm-edge", cloud_model=None),
            ModelPairing(model="acme-edge", cloud_model="acme-big"),
        ]
    )
    assert tiering.cloud_model("tierline/lm-edge") == "tierline/lm-cloud"
    assert tiering.cloud_model("tierline/lm-edge-onnx-int8") == "tierline/lm-cloud"  # by its format suffix
    assert tiering.cloud_model("acme-edge-v2") == "acme-big"  # by the group the runtime guard serves it in


def test_a_plain_id_escalates_as_the_export_it_serves(tmp_path: Path) -> None:
    tiering = _tiering()
    tiering.aliases = {"acme-qwen-edge": "acme-qwen-edge-onnx"}
    PairingBook(tmp_path / "pairings.json", tiering).apply(
        [ModelPairing(model="acme-qwen-edge-onnx", cloud_model="acme-qwen")]
    )
    assert tiering.cloud_model("acme-qwen-edge") == "acme-qwen"
    assert tiering.cloud_model("not-on-this-device") == "not-on-this-device"  # goes up under its own name


def test_the_zoo_release_name_pairs_the_zoo_id(tmp_path: Path) -> None:
    """The cloud names a release as it was published (``lm-edge-onnx``); the device serves the zoo's in the
    ``tierline/`` namespace."""
    tiering = _tiering()
    PairingBook(tmp_path / "pairings.json", tiering).apply(
        [ModelPairing(model="lm-edge-onnx", cloud_model="tierline/lm-cloud")]
    )
    assert tiering.cloud_model("tierline/lm-edge-onnx") == "tierline/lm-cloud"


def test_format_suffixes() -> None:
    assert without_suffix("acme-qwen-edge-onnx-int8") == "acme-qwen-edge"
    assert without_suffix("acme-qwen-edge-onnx") == "acme-qwen-edge"
    assert without_suffix("tierline/lm-edge-gguf") == "tierline/lm-edge"
    assert without_suffix("acme") == "acme" and without_suffix("-onnx") == "-onnx"
