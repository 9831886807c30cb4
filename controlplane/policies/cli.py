"""``tierline policies``: escalation policies as registry objects (calibrate, move the operating point, list,
show). Every change is a new signed version, audited."""

from __future__ import annotations

import json
from pathlib import Path

import click

TARGET_HELP = "device selector term (repeatable): ring=beta, site!=lab, device.arch=x86_64, device.memory_mb>=2048"


def _echo(row: object) -> None:
    from controlplane.policies.service import policy_json
    from controlplane.storage.tables import EscalationPolicy
    from shared.targeting import describe

    assert isinstance(row, EscalationPolicy)
    p = policy_json(row)
    share = f"{p['edge_share']:.1%}" if isinstance(p["edge_share"], float) else "?"
    click.echo(
        f"{p['model']} v{p['version']}: {p['signal']} < {p['threshold']:.6g} escalates; max quality loss "
        f"{p['max_quality_loss']:g}, {share} answered locally on its {p['data_items']} validation items; "
        f"for {describe(p['target'])}"
    )


@click.group()
def policies() -> None:
    """Escalation policies per edge model: versioned, signed, delivered to devices at sync."""


@policies.command("calibrate")
@click.option(
    "--model",
    required=True,
    help="the edge model, e.g. tierline/digits-small (or digits-small), or a registry model such as acme-edge",
)
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
    default=None,
    help="validation items or prompts (JSON Lines, below); the items are kept as the model's set. "
    "Default: the set given before",
)
@click.option("--target", "target", multiple=True, help=TARGET_HELP)
@click.option(
    "--cloud-model",
    default=None,
    help="with a prompts file: the registry cloud model the edge is graded against [default: MODEL's pairing, "
    "tierline models pair]",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(1, 512),
    default=32,
    show_default=True,
    help="with a prompts file: the longest answer either tier gives",
)
def calibrate_command(
    model: str,
    max_quality_loss: float,
    data_file: Path | None,
    target: tuple[str, ...],
    cloud_model: str | None,
    max_new_tokens: int,
) -> None:
    """Calibrate MODEL's policy in the control plane on its validation set; store it as a new signed version.

    \b
    --data is either validation items (`tierline edge calibrate --help`) or a team's own prompts, JSON Lines:
      {"prompt": "The capital of France is", "reference": "Paris"}
      {"messages": [{"role": "user", "content": "2 + 2 = ?"}], "reference": "4"}
      {"prompt": "def add(a, b):"}
    With prompts, MODEL and its cloud model (--cloud-model, else the pairing) are registry models: both answer
    every prompt greedily here (up to --max-new-tokens), an answer is right when it gives the reference (without
    one: the cloud's answer), and the rows become MODEL's validation set. At least 10 prompts."""
    from controlplane.policies import service
    from controlplane.policies.prompt_validation import is_prompts_file
    from controlplane.registry.artifacts import platform_signing_key
    from controlplane.storage.audit import cli_actor
    from controlplane.storage.session import session_scope
    from shared.errors import ConfigurationError

    try:
        with session_scope() as session:
            terms = list(target) if target else None
            if data_file is not None and is_prompts_file(data_file):
                row = service.calibrate_from_prompts(
                    session,
                    model,
                    prompts=data_file,
                    cloud_model=cloud_model,
                    max_new_tokens=max_new_tokens,
                    max_quality_loss=max_quality_loss,
                    target=terms,
                    actor=cli_actor(),
                    key=platform_signing_key(),
                )
            else:
                if cloud_model is not None:
                    raise click.UsageError("--cloud-model goes with a prompts file (--data); the rows name no prompts")
                row = service.calibrate(
                    session,
                    model,
                    max_quality_loss=max_quality_loss,
                    data=data_file,
                    target=terms,
                    actor=cli_actor(),
                    key=platform_signing_key(),
                )
            _echo(row)
    except ConfigurationError as exc:
        raise click.ClickException(exc.message) from exc


@policies.command("set-operating-point")
@click.option("--model", required=True, help="the edge model")
@click.option("--max-quality-loss", type=click.FloatRange(0.0, 1.0), required=True, help="the new bound")
@click.option("--target", "target", multiple=True, help=TARGET_HELP + " (default: the latest version's)")
def set_operating_point(model: str, max_quality_loss: float, target: tuple[str, ...]) -> None:
    """A new version at another point of the latest version's curve, without recalibrating."""
    from controlplane.policies import service
    from controlplane.registry.artifacts import platform_signing_key
    from controlplane.storage.audit import cli_actor
    from controlplane.storage.session import session_scope
    from shared.errors import ConfigurationError

    try:
        with session_scope() as session:
            row = service.move_operating_point(
                session,
                model,
                max_quality_loss=max_quality_loss,
                target=list(target) if target else None,
                actor=cli_actor(),
                key=platform_signing_key(),
            )
            _echo(row)
    except ConfigurationError as exc:
        raise click.ClickException(exc.message) from exc


@policies.command("list")
@click.option("--model", default=None, help="only this model's versions")
@click.option("--json", "as_json", is_flag=True)
def list_command(model: str | None, as_json: bool) -> None:
    """Policy versions, newest first per model; under each model's newest version, its promise beside the live
    rate: the edge share of the requests the policy decided over the last 15 minutes, and every escalation reason
    (from the usage the devices synced; ``controlplane.policies.live``)."""
    from controlplane.policies import live, service
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        names = [service.resolve_model(session, model)] if model else service.models(session)
        out = []
        for name in names:
            rows = service.versions_of(session, name)
            rate = live.live_rate(session, name, policy=rows[0]) if rows else None
            for i, row in enumerate(rows):
                if as_json:
                    out.append({**service.policy_json(row), **({"live": rate.to_json()} if i == 0 and rate else {})})
                    continue
                _echo(row)
                if i == 0 and rate is not None:
                    click.echo(f"  {rate.line()}")
        if as_json:
            click.echo(json.dumps(out, indent=2))
            return
        if not names or not any(service.versions_of(session, n) for n in names):
            click.echo("no escalation policies (tierline policies calibrate --model X --data FILE)")


@policies.command("show")
@click.option("--model", required=True)
@click.option("--version", type=int, default=None, help="default: the newest")
def show_command(model: str, version: int | None) -> None:
    """One version with its curve, as JSON."""
    from controlplane.policies import service
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        click.echo(
            json.dumps(service.policy_json(service.get_version(session, model, version), with_curve=True), indent=2)
        )


@policies.command("alerts")
@click.option("--model", default=None, help="only this model's alerts")
@click.option("--all", "show_all", is_flag=True, help="resolved alerts too (default: open ones)")
@click.option("--json", "as_json", is_flag=True)
def alerts_command(model: str | None, show_all: bool, as_json: bool) -> None:
    """The live quality monitor's alerts: agreement with the cloud below what a version's calibration promised."""
    from controlplane.policies import monitor, service
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        name = service.resolve_model(session, model) if model else None
        rows = [monitor.alert_json(a) for a in monitor.alerts(session, name, only_open=not show_all)]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no quality alerts")
    for a in rows:
        group = f" group {a['device_group']}" if a["device_group"] else ""
        click.echo(
            f"alert {a['id']} ({a['status']}): {a['model']} v{a['policy_version']}{group}: agreement "
            f"{a['agreement']:.1%} on {a['num_samples']} shadow samples, promised {a['promised']:.1%}; "
            f"proposed threshold {a['proposed_threshold']:.6g}"
        )


@policies.command("accept-alert")
@click.argument("alert_id", type=int)
def accept_alert_command(alert_id: int) -> None:
    """Make the alert's proposed threshold the model's next signed policy version."""
    from controlplane.policies import monitor
    from controlplane.registry.artifacts import platform_signing_key
    from controlplane.storage.audit import cli_actor
    from controlplane.storage.session import session_scope
    from shared.errors import ApplicationError

    try:
        with session_scope() as session:
            _echo(monitor.accept(session, alert_id, actor=cli_actor(), key=platform_signing_key()))
    except ApplicationError as exc:
        raise click.ClickException(exc.message) from exc


@policies.command("dismiss-alert")
@click.argument("alert_id", type=int)
def dismiss_alert_command(alert_id: int) -> None:
    """Close the alert without a new version."""
    from controlplane.policies import monitor
    from controlplane.storage.audit import cli_actor
    from controlplane.storage.session import session_scope
    from shared.errors import ApplicationError

    try:
        with session_scope() as session:
            monitor.dismiss(session, alert_id, actor=cli_actor())
    except ApplicationError as exc:
        raise click.ClickException(exc.message) from exc
    click.echo(f"alert {alert_id} dismissed")
