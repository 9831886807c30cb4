"""``tierline models`` and ``tierline rollouts`` (straight to the database, like ``tierline tenants``)."""

from __future__ import annotations

import getpass
import json
from typing import Any

import click

from shared.planned import planned


@click.group()
def models() -> None:
    """The model registry: models, versions, artifacts."""


@models.command("list")
def models_list() -> None:
    """List registered models."""
    from sqlmodel import select

    from shared.storage.models import Model
    from shared.storage.session import session_scope

    with session_scope() as session:
        rows = list(session.exec(select(Model).order_by(Model.name)))
    if not rows:
        click.echo("no models registered", err=True)
    for m in rows:
        click.echo(f"{m.id}\t{m.name}\t{m.kind}\t{m.description}")


models.add_command(planned("push", "Register a model version from PATH.", issue=7))


@click.group()
def rollouts() -> None:
    """Canary rollouts of model versions to cloud traffic and device fleets."""


def _actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no passwd entry (containers)
        return "cli"


def _labels(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not K=V")
        labels[key] = value
    return labels


def _steps(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[float] | None:
    if value is None:
        return None
    try:
        return [float(part) for part in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of percentages") from None


def _checks(_ctx: click.Context, _param: click.Parameter, value: str | None) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc.msg}") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter("a JSON object, e.g. '{\"p95_latency_ms\": null}'")
    return parsed


def _summary(r: Any) -> str:
    step = f"step {r.step_index + 1}/{len(r.steps)}" if r.status not in ("pending",) else "not started"
    return (
        f"{r.id}\t{r.status}\t{r.model}\t{r.baseline_version} -> {r.candidate_version}\t{r.scope}\t"
        f"{step}\tcandidate {r.weight:g}%"
    )


@rollouts.command("create")
@click.option("--model", required=True, help="cloud model name, or the edge artifact name (e.g. lm-edge-onnx-int8)")
@click.option("--baseline", required=True, help="the version serving now")
@click.option("--candidate", required=True, help="the version to roll out")
@click.option("--scope", type=click.Choice(["cloud", "edge", "both"]), default="cloud", show_default=True)
@click.option("--label", "labels", multiple=True, callback=_labels, help="device label K=V the fleet must carry")
@click.option("--steps", callback=_steps, default=None, help="candidate weights in percent [default: 5,25,50,100]")
@click.option("--min-step-s", type=float, default=300.0, show_default=True, help="least seconds per step")
@click.option("--min-samples", type=int, default=100, show_default=True, help="least requests per arm per step")
@click.option(
    "--checks", callback=_checks, default=None, help='JSON overrides, e.g. \'{"error_rate": {"factor": 1.5}}\''
)
@click.option("--tenant", default=None, help="limit the rollout to one tenant's traffic and devices")
def rollouts_create(
    model: str,
    baseline: str,
    candidate: str,
    scope: str,
    labels: dict[str, str],
    steps: list[float] | None,
    min_step_s: float,
    min_samples: int,
    checks: dict[str, Any] | None,
    tenant: str | None,
) -> None:
    """Create a rollout of CANDIDATE against BASELINE; the controller starts it at its next pass."""
    from shared.rollouts import RolloutSpec, create_rollout
    from shared.storage.session import session_scope

    spec = RolloutSpec(
        model=model,
        baseline_version=baseline,
        candidate_version=candidate,
        scope=scope,
        device_selector=labels,
        steps=steps,
        min_step_s=min_step_s,
        min_samples=min_samples,
        checks=checks,
        tenant=tenant,
    )
    with session_scope() as session:
        r = create_rollout(session, spec, actor=_actor())
        weights = ", ".join(f"{w:g}%" for w in r.steps)
        click.echo(
            f"created rollout {r.id}: {r.model} {r.baseline_version} -> {r.candidate_version} ({r.scope}; "
            f"steps {weights}); pending until the controller's next pass"
        )


@rollouts.command("list")
@click.option("--status", default=None, help="only rollouts in this state")
def rollouts_list(status: str | None) -> None:
    """List rollouts, newest first."""
    from shared.rollouts import list_rollouts
    from shared.storage.session import session_scope

    with session_scope() as session:
        rows = list_rollouts(session, status)
    if not rows:
        click.echo("no rollouts", err=True)
    for r in rows:
        click.echo(_summary(r))


@rollouts.command("get")
@click.argument("rollout_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="print the rollout, its events and pins as JSON")
def rollouts_get(rollout_id: int, as_json: bool) -> None:
    """Show a rollout, its last analysis and its event timeline."""
    from shared.rollouts import event_json, get_rollout, pin_json, rollout_events, rollout_json, rollout_pins
    from shared.storage.session import session_scope

    with session_scope() as session:
        r = get_rollout(session, rollout_id)
        events = rollout_events(session, rollout_id)
        pins = rollout_pins(session, rollout_id)
    if as_json:
        body = {**rollout_json(r), "events": [event_json(e) for e in events], "pins": [pin_json(p) for p in pins]}
        click.echo(json.dumps(body, indent=2))
        return
    click.echo(_summary(r))
    if r.device_selector:
        click.echo("devices: " + ", ".join(f"{k}={v}" for k, v in sorted(r.device_selector.items())))
    for p in pins:
        click.echo(f"pin: {p.kind} {p.key} -> {p.arm}")
    if r.last_analysis:
        click.echo(f"last analysis ({r.last_analysis.get('at')}): {r.last_analysis.get('reason')}")
    for e in events:
        click.echo(f"{e.at:%Y-%m-%d %H:%M:%S}\t{e.kind}\t{e.to_status}\t{e.weight:g}%\t{e.actor}\t{e.reason}")


def _action(name: str, help_text: str) -> click.Command:
    @click.command(name=name, help=help_text)
    @click.argument("rollout_id", type=int)
    @click.option("--reason", default="", help="why, for the timeline and the audit log")
    def command(rollout_id: int, reason: str) -> None:
        from shared import rollouts as service
        from shared.storage.session import session_scope

        with session_scope() as session:
            r = getattr(service, name)(session, rollout_id, actor=_actor(), reason=reason)
            click.echo(_summary(r))

    return command


rollouts.add_command(_action("pause", "Hold a running rollout at its weight."))
rollouts.add_command(_action("resume", "Run a paused rollout again, or start a pending one now."))
rollouts.add_command(_action("promote", "Make the candidate everyone's version now."))
rollouts.add_command(_action("abort", "Stop a rollout; everyone returns to the baseline."))


@rollouts.command("pin")
@click.argument("rollout_id", type=int)
@click.option("--device", default=None, help="a device id")
@click.option("--tenant", default=None, help="a tenant name")
@click.option("--arm", "value", type=click.Choice(["baseline", "candidate", "excluded"]), required=True)
def rollouts_pin(rollout_id: int, device: str | None, tenant: str | None, value: str) -> None:
    """Hold a device or a tenant on one arm of a rollout, or leave it out."""
    from shared.rollouts import set_pin
    from shared.storage.session import session_scope

    if (device is None) == (tenant is None):
        raise click.UsageError("give exactly one of --device and --tenant")
    kind, key = ("device", device) if device is not None else ("tenant", tenant)
    assert key is not None
    with session_scope() as session:
        set_pin(session, rollout_id, kind, key, value, actor=_actor())
    click.echo(f"rollout {rollout_id}: {kind} {key} pinned to {value}")


@rollouts.command("tick")
@click.option("--json", "as_json", is_flag=True, help="print what the pass did as JSON lines")
def rollouts_tick(as_json: bool) -> None:
    """Run one controller pass now: start pending rollouts, judge running ones (for cron and tests)."""
    from shared.rollouts import run_controller_pass
    from shared.storage.session import get_engine

    results = run_controller_pass(get_engine(), actor=f"{_actor()} (tick)")
    if not results:
        click.echo("no pending or running rollouts", err=True)
    for r in results:
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "rollout_id": r.rollout_id,
                        "action": r.action,
                        "status": r.status,
                        "step_index": r.step_index,
                        "weight": r.weight,
                        "reason": r.reason,
                    }
                )
            )
        else:
            click.echo(f"{r.rollout_id}\t{r.action}\t{r.status}\tcandidate {r.weight:g}%\t{r.reason}")
