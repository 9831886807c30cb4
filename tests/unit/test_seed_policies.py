"""``tierline up`` calibrates a policy only for the edge models its agent serves: the validation data of
``bench cascade --export-validation`` also holds pairs the agent does not run (``digits-micro``; a graded task
such as ``lm-micro-next8`` exports no rows, but a file from elsewhere might carry them)."""

from __future__ import annotations

import json
from pathlib import Path

from tierline.seed import EDGE_MODELS, _policy_models


def test_only_served_edge_models_get_a_policy(tmp_path: Path) -> None:
    models = ["tierline/digits-micro", "tierline/lm-edge", "tierline/lm-micro", "tierline/digits-small"]
    rows = [{"model": m, "signals": {}} for m in models * 2]
    validation = tmp_path / "validation-demo.jsonl"
    validation.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert _policy_models(validation) == ["tierline/lm-edge", "tierline/digits-small"]
    assert "tierline/lm-micro" not in EDGE_MODELS and "tierline/digits-micro" not in EDGE_MODELS
