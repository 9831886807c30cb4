"""``tierline models`` and ``tierline rollouts`` (straight to the database, like ``tierline tenants``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click


@click.group()
def models() -> None:
    """The model registry: models, versions, artifacts, aliases."""


@models.command("list")
def models_list() -> None:
    """List registered models."""
    from controlplane.registry import service as registry
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        rows = [registry.model_json(session, m, with_versions=False) for m in registry.list_models(session)]
    if not rows:
        click.echo("no models registered", err=True)
    for m in rows:
        aliases = ",".join(f"{a}={n}" for a, n in m["aliases"].items()) or "-"
        latest = m["latest_version"] or "-"
        click.echo(
            f"{m['name']}\t{m['kind']}\tversions {m['num_versions']} (latest {latest})\t{aliases}\t{m['description']}"
        )


@models.command("push")
@click.argument("path", type=click.Path(path_type=Path, exists=True))
@click.option("--name", required=True, help="the model's name (created when new)")
@click.option(
    "--kind",
    type=click.Choice(["causal-lm", "tensor"]),
    default=None,
    help="of a new model [default: causal-lm for a checkpoint or edge dir, tensor for an .onnx file]",
)
@click.option("--label", default=None, help="a label for the version, e.g. 2026-12-rc1")
@click.option("--tag", "tags", multiple=True, help="a tag for the version (repeatable)")
@click.option("--alias", default=None, help="point this alias (e.g. canary) at the new version")
@click.option(
    "--serving",
    "serving_file",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="a JSON serving spec: an openai backend (upstream servers) answers the version; PATH is its tokenizer",
)
@click.option("--json", "as_json", is_flag=True, help="print the new version as JSON")
def models_push(
    path: Path,
    name: str,
    kind: str | None,
    label: str | None,
    tags: tuple[str, ...],
    alias: str | None,
    serving_file: Path | None,
    as_json: bool,
) -> None:
    """Register a new version of model NAME from PATH.

    PATH is a Hugging Face checkpoint directory (config.json + *.safetensors: a cloud artifact), a tokenizer
    directory (config.json + tokenizer.json, no weights: with --serving), an .onnx file (cloud) or an edge artifact
    directory (edge_model.json, as `tierline zoo build` writes). Its files go to the artifact store
    (TIERLINE_ARTIFACT_STORE), the manifest is signed with the platform key.
    """
    from controlplane.registry import artifacts as registry_artifacts
    from controlplane.registry import service as registry
    from controlplane.registry.store import store_from_settings
    from controlplane.storage.session import session_scope

    store = store_from_settings()
    key = registry_artifacts.platform_signing_key()
    with session_scope() as session:
        pushed = registry_artifacts.push_path(
            session,
            store,
            path,
            name=name,
            kind=kind,
            label=label,
            tags=tags,
            alias=alias,
            actor=_actor(),
            signing_key=key,
            serving=_read_spec(serving_file) if serving_file is not None else None,
        )
        body = registry.version_json(pushed.version, [pushed.artifact], [alias] if alias else [])
    if as_json:
        click.echo(json.dumps(body, indent=2))
        return
    a = pushed.artifact
    click.echo(
        f"registered {name} version {pushed.version.number}: {a.target} {a.format}, {a.size} bytes, sha256 {a.sha256}"
        + (f"; alias {alias} -> {pushed.version.number}" if alias else "")
    )
    if pushed.servability is not None:
        click.echo(pushed.servability.summary())
        if alias is None and "engine" in pushed.servability.servable_by:
            # the cloud serves a model's stable version (or the arms of a rollout): say how this one gets there
            click.echo(
                f"the cloud serves it once it is stable: tierline models alias {name} stable {pushed.version.number}"
            )


@models.command("pair")
@click.argument("edge_model")
@click.argument("cloud_model", required=False)
@click.option(
    "--resend",
    type=click.Choice(["as-sent", "text"]),
    default=None,
    help="as-sent: requests go up unchanged; text: token-id prompts are decoded first "
    "[default: as-sent when both tokenizers share a vocabulary, else text]",
)
@click.option("--none", "unpair", is_flag=True, help="no cloud pair: EDGE_MODEL answers locally")
def models_pair(edge_model: str, cloud_model: str | None, resend: str | None, unpair: bool) -> None:
    """Make registry model EDGE_MODEL escalate to CLOUD_MODEL (a registry model, or a zoo id tierline/NAME).

    Devices serving a release of EDGE_MODEL (EDGE_MODEL, or EDGE_MODEL-FORMAT such as acme-edge-onnx-int8) are told
    at their next sync.
    """
    from controlplane.registry import artifacts as registry_artifacts
    from controlplane.registry import service as registry
    from controlplane.registry.store import store_from_settings
    from controlplane.storage.session import session_scope

    if unpair == (cloud_model is not None):
        raise click.UsageError("give CLOUD_MODEL or --none")
    with session_scope() as session:
        model = registry.get_model(session, edge_model)
        if cloud_model is not None and resend is None:
            resend = registry_artifacts.default_resend(session, store_from_settings(), model, cloud_model)
        registry.set_pairing(session, model, cloud_model, resend=resend or "as-sent", actor=_actor())
        line = registry.pairing_line(model)
    click.echo(f"{edge_model}: {line}")


def _read_spec(path: Path) -> dict[str, Any]:
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise click.BadParameter(f"{path}: not a JSON file ({exc})", param_hint="--serving") from None
    if not isinstance(spec, dict):
        raise click.BadParameter(f"{path}: a JSON object, please", param_hint="--serving")
    return spec


@models.command("serving")
@click.argument("name")
@click.argument("version", type=int)
@click.argument("spec_file", type=click.Path(path_type=Path, exists=True, dir_okay=False), required=False)
@click.option("--clear", is_flag=True, help="remove the serving spec (the built-in engine serves the version)")
def models_serving(name: str, version: int, spec_file: Path | None, clear: bool) -> None:
    """Set VERSION of NAME's serving spec from SPEC_FILE (JSON), e.g. a new endpoint list.

    Running gateways pick it up at their next refresh without a restart: new endpoints take requests, removed
    ones stop taking new requests and are dropped once their requests in flight are done. Its key must come from
    where the operator designates (a TIERLINE_UPSTREAM_KEY_* variable, or a file by name in
    TIERLINE_CLOUD_UPSTREAM_SECRETS_DIR) and its endpoints must pass the operator's egress policy
    (TIERLINE_CLOUD_UPSTREAM_*): anything else is refused, naming the field and the rule.
    """
    from controlplane.registry import service as registry
    from controlplane.storage.session import session_scope

    if clear == (spec_file is not None):
        raise click.UsageError("give SPEC_FILE or --clear")
    spec = _read_spec(spec_file) if spec_file is not None else None
    with session_scope() as session:
        v = registry.set_serving(session, registry.get_model(session, name), version, spec, actor=_actor())
        endpoints = (v.serving or {}).get("endpoints", [])
    click.echo(f"{name} version {version}: " + (f"openai backend, {len(endpoints)} endpoint(s)" if spec else "builtin"))


@models.command("versions")
@click.argument("name")
def models_versions(name: str) -> None:
    """List the versions of model NAME with their status, aliases and artifacts."""
    from controlplane.registry import service as registry
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        body = registry.model_json(session, registry.get_model(session, name))
    if not body["versions"]:
        click.echo(f"{name} has no versions", err=True)
    for v in body["versions"]:
        arts = ", ".join(f"{a['target']}:{a['format']}({a['status']})" for a in v["artifacts"]) or "no artifacts"
        extra = [f"label {v['label']}"] if v["label"] else []
        extra += [f"from v{v['derived_from']}"] if v["derived_from"] else []
        extra += [f"aliases {','.join(v['aliases'])}"] if v["aliases"] else []
        extra += [f"tags {','.join(v['tags'])}"] if v["tags"] else []
        extra += [f"serving openai {','.join(v['serving']['endpoints'])}"] if v.get("serving") else []
        extra += [f"servable by {','.join(v['servable_by'])}"] if v["servable_by"] else []
        click.echo(f"{v['number']}\t{v['status']}\t{arts}\t{'; '.join(extra)}")


@models.command("show")
@click.argument("name")
def models_show(name: str) -> None:
    """Print model NAME, its aliases, versions and artifacts as JSON."""
    from controlplane.registry import service as registry
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        body = registry.model_json(session, registry.get_model(session, name))
    click.echo(json.dumps(body, indent=2))


@models.command("alias")
@click.argument("name")
@click.argument("alias")
@click.argument("version", type=int)
def models_alias(name: str, alias: str, version: int) -> None:
    """Point ALIAS (stable, canary, any name) of model NAME at VERSION, in one step."""
    from controlplane.registry import service as registry
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        registry.move_alias(session, registry.get_model(session, name), alias, version, actor=_actor())
    click.echo(f"{name}: {alias} -> {version}")


@models.command("status")
@click.argument("name")
@click.argument("version", type=int)
@click.argument("status", type=click.Choice(["validated", "active", "retired"]))
@click.option("--reason", default="", help="why, for the audit log")
def models_status(name: str, version: int, status: str, reason: str) -> None:
    """Move VERSION of NAME forward: registered -> validated -> active -> retired."""
    from controlplane.registry import service as registry
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        model = registry.get_model(session, name)
        registry.set_status(session, model, version, status, actor=_actor(), reason=reason)
    click.echo(f"{name} version {version}: {status}")


@models.command("tag")
@click.argument("name")
@click.argument("version", type=int)
@click.option("--add", "add", multiple=True, help="a tag to add (repeatable)")
@click.option("--remove", "remove", multiple=True, help="a tag to remove (repeatable)")
def models_tag(name: str, version: int, add: tuple[str, ...], remove: tuple[str, ...]) -> None:
    """Add or remove tags of VERSION of NAME."""
    from controlplane.registry import service as registry
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        model = registry.get_model(session, name)
        v = registry.tag_version(session, model, version, add=add, remove=remove, actor=_actor())
        tags = list(v.tags)
    click.echo(f"{name} version {version}: tags {', '.join(tags) or '(none)'}")


@models.command("export")
@click.argument("name")
@click.argument("version")
@click.option(
    "--format",
    "format",
    type=click.Choice(["hf-safetensors", "hf-tokenizer", "onnx", "onnx-int8", "tflite", "gguf", "tensorrt-plan"]),
    required=True,
    help="which of the version's artifacts",
)
@click.option("--out", "out", type=click.Path(path_type=Path), required=True, help="directory to write into")
def models_export(name: str, version: str, format: str, out: Path) -> None:
    """Write an artifact of VERSION (a number or an alias) of NAME to OUT, laid out like a built zoo.

    OUT/artifacts/RELEASE/ holds its files (each checked against its hash) and OUT/manifests/RELEASE.json its
    signed manifest, so `tierline cloud publish OUT/artifacts/RELEASE` offers it to devices as RELEASE version
    NUMBER. RELEASE is NAME, or NAME-FORMAT for an LM's edge formats (each format of a version is its own release;
    a device serves the best of them as NAME). A rejected or failed artifact is refused.
    """
    from controlplane.registry import artifacts as registry_artifacts
    from controlplane.registry.store import store_from_settings
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        files_dir, manifest = registry_artifacts.export_artifact(
            session, store_from_settings(), name, version, format, out
        )
    click.echo(f"wrote {files_dir} and {manifest}; publish it with: tierline cloud publish {files_dir}")


@models.command("derive")
@click.argument("name")
@click.argument("version", type=int)
@click.option(
    "--min-int8-agreement",
    type=click.FloatRange(0.0, 1.0),
    default=None,
    help="reject INT8 below this next-token agreement with the source checkpoint's greedy answers "
    "[default: TIERLINE_REGISTRY_MIN_INT8_AGREEMENT, 0.9]",
)
@click.option(
    "--tflite/--no-tflite", default=None, help="also convert to TFLite [default: when litert-torch is installed]"
)
@click.option(
    "--gguf/--no-gguf",
    default=None,
    help="also export GGUF Q8_0 + f32 for llama.cpp on devices [default: TIERLINE_REGISTRY_DERIVE_GGUF, off]",
)
def models_derive(
    name: str, version: int, min_int8_agreement: float | None, tflite: bool | None, gguf: bool | None
) -> None:
    """Derive edge artifacts (ONNX fp32, ONNX INT8, TFLite, GGUF) of cloud checkpoint VERSION of NAME, here and now.

    The result is a new version of NAME recording the version it was derived from; its artifacts are signed.
    (The console's POST /api/models/NAME/versions/VERSION/derive runs the same job in the background.)
    """
    from controlplane.registry import artifacts as registry_artifacts
    from controlplane.registry.edge_derive import run_derive, start_derive
    from controlplane.registry.store import store_from_settings
    from controlplane.storage.session import get_db, session_scope

    store = store_from_settings()
    key = registry_artifacts.platform_signing_key()
    with session_scope() as session:
        job = start_derive(
            session, name, version, actor=_actor(), min_int8_agreement=min_int8_agreement, tflite=tflite, gguf=gguf
        )
    click.echo(f"deriving {name} version {job.number} from version {version}", err=True)
    result = run_derive(get_db(), store, job, key, lambda msg: click.echo(f"[derive] {msg}", err=True))
    if result.error:
        raise click.ClickException(f"derive failed: {result.error}")
    click.echo(f"{name} version {job.number}: " + ", ".join(f"{f} {s}" for f, s in result.statuses.items()))
    for fmt, reason in sorted(result.reasons.items()):
        click.echo("  " + (reason if reason.startswith(f"{fmt}:") else f"{fmt}: {reason}"))


@click.group()
def rollouts() -> None:
    """Canary rollouts of model versions to cloud traffic and device fleets."""


def _actor() -> str:
    from controlplane.storage.audit import cli_actor

    return cli_actor()


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
        f"{r.id}\t{r.status}\t{'policy ' if r.kind == 'policy' else ''}{r.model}\t"
        f"{r.baseline_version} -> {r.candidate_version}\t{r.scope}\t"
        f"{step}\tcandidate {r.weight:g}%"
    )


@rollouts.command("create")
@click.option("--model", required=True, help="cloud model name, or the edge artifact name (e.g. lm-edge-onnx-int8)")
@click.option("--baseline", required=True, help="the version serving now")
@click.option("--candidate", required=True, help="the version to roll out")
@click.option(
    "--policy",
    "is_policy",
    is_flag=True,
    help="roll out an escalation policy version of edge model MODEL (versions are policy version numbers; "
    "the scope is edge; judged on escalation rate, cost per request, errors and p95)",
)
@click.option("--scope", type=click.Choice(["cloud", "edge", "both"]), default="cloud", show_default=True)
@click.option("--label", "labels", multiple=True, callback=_labels, help="device label K=V the fleet must carry")
@click.option("--steps", callback=_steps, default=None, help="candidate weights in percent [default: 5,25,50,100]")
@click.option("--min-step-s", type=float, default=300.0, show_default=True, help="least seconds per step")
@click.option("--min-samples", type=int, default=100, show_default=True, help="least requests per arm per step")
@click.option(
    "--checks", callback=_checks, default=None, help='JSON overrides, e.g. \'{"error_rate": {"factor": 1.5}}\''
)
@click.option("--tenant", default=None, help="limit the rollout to one tenant's traffic and devices")
@click.option(
    "--shadow-sample",
    type=float,
    default=0.0,
    show_default=True,
    help="percent of baseline cloud requests mirrored to the candidate at a shadow step 0 before any user "
    "sees it (0: no shadow step; cloud scope only)",
)
@click.option(
    "--shadow-min-agreement",
    type=float,
    default=0.9,
    show_default=True,
    help="least mean token agreement (0-1) of the shadow samples for the shadow step to pass; below it rolls back",
)
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
    shadow_sample: float,
    shadow_min_agreement: float,
    is_policy: bool,
) -> None:
    """Create a rollout of CANDIDATE against BASELINE; the controller starts it at its next pass."""
    from controlplane.rollouts.service import RolloutSpec, create_rollout
    from controlplane.storage.session import session_scope

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
        shadow_sample=shadow_sample,
        shadow_min_agreement=shadow_min_agreement,
        kind="policy" if is_policy else "model",
    )
    with session_scope() as session:
        r = create_rollout(session, spec, actor=_actor())
        weights = ", ".join(f"{w:g}%" for w in r.steps)
        if r.shadow_sample > 0:
            weights += f"; step 0 is a shadow step mirroring {r.shadow_sample:g}% of baseline requests"
        click.echo(
            f"created rollout {r.id}: {'policy of ' if r.kind == 'policy' else ''}{r.model} "
            f"{r.baseline_version} -> {r.candidate_version} ({r.scope}; "
            f"steps {weights}); pending until the controller's next pass"
        )


@rollouts.command("list")
@click.option("--status", default=None, help="only rollouts in this state")
def rollouts_list(status: str | None) -> None:
    """List rollouts, newest first."""
    from controlplane.rollouts.service import list_rollouts
    from controlplane.storage.session import session_scope

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
    from controlplane.rollouts.service import (
        event_json,
        get_rollout,
        pin_json,
        rollout_events,
        rollout_json,
        rollout_pins,
    )
    from controlplane.storage.session import session_scope

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
        from controlplane.rollouts import service
        from controlplane.storage.session import session_scope

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
    from controlplane.rollouts.service import set_pin
    from controlplane.storage.session import session_scope

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
    from controlplane.rollouts.service import run_controller_pass
    from controlplane.storage.session import get_db

    results = run_controller_pass(get_db(), actor=f"{_actor()} (tick)")
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
