"""``tierline edge calibrate``: choose a model's escalation signal and threshold from validation data, on the
device (the calibration itself is ``shared.calibration``; ``tierline policies calibrate`` runs it in the control
plane).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from shared.calibration import MIN_ITEMS, calibrate, read_validation, tied_embedding_projection
from shared.errors import ConfigurationError
from shared.escalation import CLASSIFIER_SIGNALS, LM_SIGNALS, EdgePolicy, load_policy, save_policy

DATA_FORMAT = f"""\b
--data is JSON Lines, one validation item per line, as `tierline bench cascade --export-validation FILE`
writes it (other keys are ignored):
  {{"model": "tierline/lm-edge", "prompt_tokens": 128, "edge_good": false, "cloud_good": true,
   "agrees_with_cloud": false, "signals": {{"mean_logprob": -0.41, "min_margin": 0.12, "norm_entropy": 0.83}}}}
\b
model              the served model id; --model matches it or its last part (lm-edge)
signals            the edge's confidence signals: {", ".join(LM_SIGNALS)} (LMs),
                   {", ".join(CLASSIFIER_SIGNALS)} (classifiers)
prompt_tokens      the prompt's length in tokens, or null (classifiers)
edge_good          whether the edge model's answer was right, or a graded quality from 0.0 to 1.0
cloud_good         whether the cloud model's answer was right, or a graded quality from 0.0 to 1.0
agrees_with_cloud  whether the edge's answer was the cloud's (what the learned router predicts)
probe              optional: {{"input": "pixels" or "mean_logits", "values": [...]}}, the hidden-state
                   probe's input (mean_logits: the mean of the generated tokens' logits; with --model-dir
                   the probe is fitted on the hidden state they come from)
kind               optional: the kind of request (the policy's promise is also given per kind)
\b
Every signal, and a learned router over all of them (plus prompt_tokens), is tried, and the hidden-state probe
(hidden_probe) when every row has a probe; the one that answers
the most items locally within the bound wins. At least {MIN_ITEMS} items of the model are needed.
\b
A team's own prompts (with reference answers, or graded by the cloud model's answers) are turned into such items
where both models run: `tierline policies calibrate --model EDGE --data PROMPTS.jsonl --cloud-model CLOUD`
(`tierline policies calibrate --help`), which ships the policy to devices at sync."""


def _merge(existing: EdgePolicy | None, calibrated: EdgePolicy) -> EdgePolicy:
    """Keep what an operator set (mode, limits) and replace what calibration decides."""
    if existing is None:
        return calibrated
    return dataclasses.replace(
        existing,
        signal=calibrated.signal,
        threshold=calibrated.threshold,
        router=calibrated.router,
        probe=calibrated.probe,
        calibration=calibrated.calibration,
    )


@click.command("calibrate", epilog=DATA_FORMAT)
@click.option("--model", required=True, help="the edge model, e.g. tierline/lm-edge (or lm-edge)")
@click.option(
    "--max-quality-loss",
    type=click.FloatRange(0.0, 1.0),
    default=0.01,
    show_default=True,
    help="largest allowed drop below cloud-only quality (0.01 = one point)",
)
@click.option(
    "--data",
    "data_file",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    required=True,
    help="validation items, JSON Lines (format below)",
)
@click.option(
    "--model-dir",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="the LM's checkpoint (*.safetensors with its output embedding E: lm_head, else the tied embedding; e.g. the "
    "zoo's artifacts/lm-edge): the hidden-state probe on mean_logits is fitted on the hidden state pinv(E) @ logits, "
    "as bench cascade fits it",
)
@click.option(
    "--out-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="where the policy goes (default: the agent's policy_dir)",
)
def calibrate_command(
    model: str, max_quality_loss: float, data_file: Path, model_dir: Path | None, out_dir: Path | None
) -> None:
    """Pick the escalation signal and threshold that answer the most requests locally while quality stays within
    --max-quality-loss of cloud-only on the data; store the model's policy and print a one-line summary."""
    try:
        if out_dir is None:
            from edge_agent.settings import load_edge_settings, policy_dir

            out_dir = policy_dir(load_edge_settings(None))
        data = read_validation(data_file, model)
        projection = None if model_dir is None else tied_embedding_projection(model_dir)
        policy, _ = calibrate(data, max_quality_loss, probe_projection=projection)
        try:
            existing = load_policy(out_dir, policy.model)
        except ConfigurationError as exc:
            click.echo(f"replacing an unreadable policy: {exc.message}", err=True)
            existing = None
        path = save_policy(out_dir, _merge(existing, policy))
    except ConfigurationError as exc:
        raise click.ClickException(exc.message) from exc
    except OSError as exc:
        raise click.ClickException(f"cannot write the policy: {exc}") from exc
    cal = policy.calibration
    if cal["edge_share"] == 0.0:
        decision = "no threshold keeps quality within the bound, so every request escalates"
    else:
        decision = f"{policy.signal} >= {policy.threshold:.4g} answers {cal['edge_share']:.1%} locally"
    click.echo(
        f"{policy.model}: {decision}, quality {cal['quality']:.4f} vs cloud-only {cal['cloud_only_quality']:.4f} "
        f"(bound {max_quality_loss}, n={cal['num_items']}) -> {path}"
    )
