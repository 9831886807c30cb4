"""deploy/kubernetes and deploy/compose.yaml, checked offline: every overlay renders (``kubectl kustomize`` when
kubectl is installed, and always with the small renderer below, which must agree with it), every rendered object
validates against the Kubernetes API schemas in strict mode (``kubernetes-validate``: an unknown field fails), and
the objects refer to each other correctly (Service selectors, probe ports, ConfigMaps, Secrets, backends file).
A deliberately broken copy of the manifests must fail each check. deploy/compose.yaml and the Kubernetes base run the
one image (deploy/Dockerfile, entrypoint ``tierline``) with the same command line and environment per service; the
container test that builds and runs them is tests/e2e/test_images.py."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from cloud.serving.backends.config import BackendsFile
from tests.conftest import REPO, base_env
from tests.forkserver import run_tierline

KUBERNETES = REPO / "deploy" / "kubernetes"
OVERLAYS = ("cpu-demo", "gpu-vllm")
KUBE_VERSION = "1.31"  # the oldest Kubernetes release the manifests must validate against
DOCS = REPO / "docs" / "deploy.md"
# Secrets the manifests use but do not create: each must be named, with its keys, in docs/deploy.md.
EXTERNAL_SECRETS = {
    "tierline-secrets": {"database-url", "redis-url", "secret-key"},
    "tierline-keys": set(),  # mounted whole: cloud-ids.key, artifact-signing.ed25519(.pub)
    "tierline-vllm": {"api-key", "hf-token"},
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
SECRET_LIKE = re.compile(r"SECRET|PASSWORD|TOKEN|API_KEY|DATABASE_URL|REDIS_URL")

Obj = dict[str, Any]


# -- a renderer for the subset of kustomize the manifests use -------------------------------------------------------
KNOWN_FIELDS = {"apiVersion", "kind", "namespace", "resources", "configMapGenerator", "images", "patches"}


class UnsupportedError(Exception):
    """A kustomization uses something this renderer does not implement (use kubectl kustomize)."""


def _load_yaml_docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _configmap(directory: Path, spec: Obj) -> Obj:
    data: dict[str, str] = {}
    for literal in spec.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    for entry in spec.get("files", []):
        key, _, name = entry.rpartition("=") if "=" in entry else ("", "", entry)
        data[key or Path(name).name] = (directory / name).read_text()
    unknown = set(spec) - {"name", "behavior", "literals", "files"}
    if unknown:
        raise UnsupportedError(f"configMapGenerator fields {sorted(unknown)}")
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": spec["name"]}, "data": data}


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")] if path != "/" else []


def _apply_op(doc: Obj, op: Obj) -> None:
    *parents, last = _pointer(op["path"])
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    kind = op["op"]
    if kind == "add":
        if isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
        else:
            node[last] = copy.deepcopy(op["value"])
    elif kind == "replace":
        if isinstance(node, list):
            node[int(last)] = copy.deepcopy(op["value"])
        else:
            if last not in node:
                raise KeyError(f"replace {op['path']}: no such field")
            node[last] = copy.deepcopy(op["value"])
    elif kind == "remove":
        del node[int(last) if isinstance(node, list) else last]
    else:
        raise UnsupportedError(f"JSON patch op {kind}")


def _image(image: str, rules: list[Obj]) -> str:
    name, tag = image, ""
    if "@" in image:
        name, tag = image.split("@", 1)
        tag = "@" + tag
    elif ":" in image.rsplit("/", 1)[-1]:
        name, _, rest = image.rpartition(":")
        tag = ":" + rest
    for rule in rules:
        if rule["name"] == name:
            name = rule.get("newName", name)
            if "newTag" in rule:
                tag = ":" + str(rule["newTag"])
            if "digest" in rule:
                tag = "@" + rule["digest"]
            break
    return name + tag


def pod_specs(obj: Obj) -> Iterator[Obj]:
    if obj["kind"] in WORKLOADS:
        yield obj["spec"]["template"]["spec"]
    elif obj["kind"] == "CronJob":
        yield obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def containers(pod: Obj) -> list[Obj]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _build(directory: Path) -> tuple[list[Obj], set[str]]:
    """The objects of ``directory``'s kustomization, generated ConfigMaps still under their plain names."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - KNOWN_FIELDS
    if unknown:
        raise UnsupportedError(f"{directory}: kustomization fields {sorted(unknown)}")
    objects: list[Obj] = []
    generated: set[str] = set()
    for entry in k.get("resources", []):
        path = directory / entry
        if path.is_dir():
            sub, sub_generated = _build(path)
            objects += sub
            generated |= sub_generated
        else:
            objects += _load_yaml_docs(path)
    for spec in k.get("configMapGenerator", []):
        cm = _configmap(directory, spec)
        behavior = spec.get("behavior", "create")
        existing = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == spec["name"]]
        if behavior == "create":
            if existing:
                raise ValueError(f"configMapGenerator {spec['name']}: already generated (use behavior: replace)")
            objects.append(cm)
        elif behavior in ("replace", "merge"):
            if not existing:
                raise ValueError(f"configMapGenerator {spec['name']}: nothing to {behavior}")
            target = existing[0]
            target["data"] = cm["data"] if behavior == "replace" else {**target.get("data", {}), **cm["data"]}
        else:
            raise UnsupportedError(f"configMapGenerator behavior {behavior}")
        generated.add(spec["name"])
    for patch in k.get("patches", []):
        ops = yaml.safe_load(patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text())
        if not isinstance(ops, list):
            raise UnsupportedError("strategic-merge patches (only JSON 6902 lists)")
        target = patch["target"]
        if set(target) - {"kind", "name"}:
            raise UnsupportedError(f"patch target fields {sorted(target)}")
        matched = [o for o in objects if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        if not matched:
            raise ValueError(f"patch target {target} matches nothing")
        for obj in matched:
            for op in ops:
                _apply_op(obj, op)
    if "images" in k:
        for obj in objects:
            for pod in pod_specs(obj):
                for c in containers(pod):
                    c["image"] = _image(c["image"], k["images"])
    if "namespace" in k:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = k["namespace"]
    return objects, generated


def kustomize_hash(cm: Obj) -> str:
    """kustomize's name suffix of a generated ConfigMap: sha256 of its JSON encoding (Go's json.Marshal: sorted
    keys, HTML characters escaped), 10 hex digits with 0, 1, 3, a and e remapped. Its hasher looks the name up
    under the path "metadata/name" as one key, finds none, and hashes an empty name (kustomize v5)."""
    encoded = json.dumps(
        {"data": cm.get("data", {}), "kind": "ConfigMap", "name": ""},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028")):
        encoded = encoded.replace(char, escape)
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def render_builtin(directory: Path) -> list[Obj]:
    objects, generated = _build(directory)
    renamed: dict[str, str] = {}
    for obj in objects:
        name = obj["metadata"]["name"]
        if obj["kind"] == "ConfigMap" and name in generated:
            renamed[name] = f"{name}-{kustomize_hash(obj)}"
            obj["metadata"]["name"] = renamed[name]
    for obj in objects:
        for pod in pod_specs(obj):
            for volume in pod.get("volumes", []):
                if "configMap" in volume:
                    volume["configMap"]["name"] = renamed.get(volume["configMap"]["name"], volume["configMap"]["name"])
            for c in containers(pod):
                for source in c.get("envFrom", []):
                    if "configMapRef" in source:
                        ref = source["configMapRef"]
                        ref["name"] = renamed.get(ref["name"], ref["name"])
                for env in c.get("env", []):
                    ref = env.get("valueFrom", {}).get("configMapKeyRef")
                    if ref is not None:
                        ref["name"] = renamed.get(ref["name"], ref["name"])
    return objects


def render_kubectl(directory: Path) -> list[Obj]:
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    if out.returncode:
        raise AssertionError(f"kubectl kustomize {directory}: {out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def has_kubectl() -> bool:
    return shutil.which("kubectl") is not None


def render(directory: Path) -> list[Obj]:
    """kubectl's rendering where kubectl runs, else the built-in one (the tests check the two agree)."""
    return render_kubectl(directory) if has_kubectl() else render_builtin(directory)


def by_key(objects: list[Obj]) -> dict[tuple[str, str], Obj]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


# -- the checks ------------------------------------------------------------------------------------------------------
def schema_errors(objects: list[Obj]) -> list[str]:
    errors = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")
    return errors


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def reference_errors(objects: list[Obj]) -> list[str]:
    """What points nowhere: selectors, scale targets, probe ports, ConfigMaps and keys, undocumented Secrets,
    literal secrets in env."""
    errors: list[str] = []
    keyed = by_key(objects)
    workloads = [o for o in objects if o["kind"] in WORKLOADS - {"Job"}]
    templates = {o["metadata"]["name"]: o["spec"]["template"] for o in workloads}
    configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    docs = DOCS.read_text() if DOCS.is_file() else ""

    def pods_matching(selector: dict[str, str]) -> list[Obj]:
        return [t for t in templates.values() if _matches(selector, t["metadata"].get("labels", {}))]

    for obj in objects:
        name, kind = obj["metadata"]["name"], obj["kind"]
        spec = obj.get("spec", {})
        if kind == "Service":
            matched = pods_matching(spec.get("selector", {}))
            if not matched:
                errors.append(f"Service/{name}: selector {spec.get('selector')} matches no workload's pods")
            for port in spec.get("ports", []):
                target = port.get("targetPort", port["port"])
                for pod in matched:
                    ports = {p.get("name") for c in pod["spec"]["containers"] for p in c.get("ports", [])}
                    ports |= {p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
                    if target not in ports:
                        errors.append(f"Service/{name}: targetPort {target} is no container port")
        if kind in ("PodDisruptionBudget",) and not pods_matching(spec["selector"].get("matchLabels", {})):
            errors.append(f"{kind}/{name}: selector matches no workload's pods")
        if kind == "NetworkPolicy":
            if not pods_matching(spec["podSelector"].get("matchLabels", {})):
                errors.append(f"NetworkPolicy/{name}: podSelector matches no workload's pods")
            for rule in spec.get("ingress", []):
                for peer in rule.get("from", []):
                    if "podSelector" in peer and not pods_matching(peer["podSelector"].get("matchLabels", {})):
                        errors.append(f"NetworkPolicy/{name}: a from.podSelector matches no workload's pods")
        if kind == "HorizontalPodAutoscaler":
            ref = spec["scaleTargetRef"]
            if (ref["kind"], ref["name"]) not in keyed:
                errors.append(f"HorizontalPodAutoscaler/{name}: scale target {ref['kind']}/{ref['name']} is missing")
        if kind in WORKLOADS - {"Job"}:
            selector = spec["selector"].get("matchLabels", {})
            if not _matches(selector, spec["template"]["metadata"].get("labels", {})):
                errors.append(f"{kind}/{name}: selector does not match its own pod template")
        for pod in pod_specs(obj):
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            if not pod.get("securityContext", {}).get("runAsNonRoot"):
                errors.append(f"{kind}/{name}: pod without runAsNonRoot")
            for volume in volumes.values():
                if "configMap" in volume and volume["configMap"]["name"] not in configmaps:
                    errors.append(f"{kind}/{name}: volume {volume['name']}: no ConfigMap {volume['configMap']['name']}")
                if "secret" in volume and volume["secret"]["secretName"] not in EXTERNAL_SECRETS:
                    errors.append(f"{kind}/{name}: volume {volume['name']}: undocumented Secret")
            for c in containers(pod):
                cname = f"{kind}/{name} container {c['name']}"
                for mount in c.get("volumeMounts", []):
                    if mount["name"] not in volumes:
                        errors.append(f"{cname}: mounts undeclared volume {mount['name']}")
                ports = {p.get("name") for p in c.get("ports", [])} | {p["containerPort"] for p in c.get("ports", [])}
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    action = c.get(probe, {}).get("httpGet") or c.get(probe, {}).get("tcpSocket")
                    if action is not None and action["port"] not in ports:
                        errors.append(f"{cname}: {probe} port {action['port']} is no container port")
                for source in c.get("envFrom", []):
                    if "configMapRef" in source and source["configMapRef"]["name"] not in configmaps:
                        errors.append(f"{cname}: envFrom: no ConfigMap {source['configMapRef']['name']}")
                    if "secretRef" in source:
                        errors.append(f"{cname}: envFrom a whole Secret (name its keys with secretKeyRef)")
                for env in c.get("env", []):
                    ref_from = env.get("valueFrom", {})
                    if "value" in env and SECRET_LIKE.search(env["name"]):
                        errors.append(f"{cname}: {env['name']} is a literal (secrets come from secretKeyRef)")
                    if (ref := ref_from.get("configMapKeyRef")) is not None and ref["key"] not in configmaps.get(
                        ref["name"], {}
                    ).get("data", {}):
                        errors.append(f"{cname}: {env['name']}: no key {ref['key']} in ConfigMap {ref['name']}")
                    if (ref := ref_from.get("secretKeyRef")) is not None:
                        known = EXTERNAL_SECRETS.get(ref["name"])
                        if known is None or ref["key"] not in known:
                            errors.append(f"{cname}: {env['name']}: Secret {ref['name']} key {ref['key']} undocumented")
                resources = c.get("resources", {})
                if not {"cpu", "memory"} <= set(resources.get("requests", {})) or "memory" not in resources.get(
                    "limits", {}
                ):
                    errors.append(f"{cname}: needs cpu and memory requests and a memory limit")
                if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
                    errors.append(f"{cname}: allowPrivilegeEscalation must be false")
                image = c["image"]
                if "@" not in image and (":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")):
                    errors.append(f"{cname}: image {image} has no pinned tag")
    for secret, keys in EXTERNAL_SECRETS.items():
        if secret not in docs or not all(f"`{key}`" in docs for key in keys):
            errors.append(f"Secret {secret} (keys {sorted(keys)}) is not documented in {DOCS.name}")
    return errors


def gateway_backends(objects: list[Obj]) -> tuple[Obj, BackendsFile]:
    """The gateway container and the backends file it reads (TIERLINE_CLOUD_BACKENDS), parsed as the gateway does."""
    gateway = by_key(objects)[("Deployment", "tierline-gateway")]
    pod = gateway["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "gateway")
    path = Path(next(e["value"] for e in container["env"] if e["name"] == "TIERLINE_CLOUD_BACKENDS"))
    mount = next(m for m in container["volumeMounts"] if path.parent == Path(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    configmap = by_key(objects)[("ConfigMap", volume["configMap"]["name"])]
    return container, BackendsFile.model_validate_json(configmap["data"][path.name])


def copy_manifests(tmp_path: Path) -> Path:
    root = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, root)
    return root


# -- the tests -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[Obj]]:
    return request.param, render(KUBERNETES / "overlays" / request.param)


def test_the_builtin_renderer_agrees_with_kubectl(overlay: tuple[str, list[Obj]]) -> None:
    name, objects = overlay
    builtin = by_key(render_builtin(KUBERNETES / "overlays" / name))
    assert set(builtin) == set(by_key(objects))
    if has_kubectl():  # else ``objects`` is the built-in rendering itself
        for key, obj in by_key(objects).items():
            assert builtin[key] == obj, key


def test_every_rendered_object_validates_against_the_kubernetes_schemas(overlay: tuple[str, list[Obj]]) -> None:
    _, objects = overlay
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Job", "ConfigMap"} <= kinds
    assert schema_errors(objects) == []


def test_references_resolve_and_secrets_are_by_reference(overlay: tuple[str, list[Obj]]) -> None:
    _, objects = overlay
    assert reference_errors(objects) == []


def test_the_topology(overlay: tuple[str, list[Obj]]) -> None:
    name, objects = overlay
    keyed = by_key(objects)
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"tierline"}
    gateway = keyed[("Deployment", "tierline-gateway")]["spec"]["template"]["spec"]
    console = keyed[("Deployment", "tierline-console")]["spec"]["template"]["spec"]
    server = keyed[("Deployment", "tierline-model-server")]["spec"]["template"]["spec"]
    migrate = keyed[("Job", "tierline-migrate")]["spec"]["template"]["spec"]
    assert migrate["containers"][0]["args"] == ["db", "upgrade"]
    for pod in (gateway, console):  # both wait for the migrations Job's schema before starting
        assert pod["initContainers"][0]["args"][:2] == ["db", "wait"]
        assert pod["initContainers"][0]["image"] == migrate["containers"][0]["image"]
    gw = next(c for c in gateway["containers"] if c["name"] == "gateway")
    assert gw["args"][:2] == ["cloud", "serve"]
    assert (gw["readinessProbe"]["httpGet"]["path"], gw["livenessProbe"]["httpGet"]["path"]) == ("/readyz", "/healthz")
    assert console["containers"][0]["args"][:2] == ["console", "serve"]
    hpa = keyed[("HorizontalPodAutoscaler", "tierline-gateway")]["spec"]
    assert {m["type"] for m in hpa["metrics"]} == {"Resource", "External"}
    assert keyed[("HorizontalPodAutoscaler", "tierline-model-server")]["spec"]["metrics"][0]["pods"]["metric"] == {
        "name": "vllm_num_requests_waiting"
    }
    service = keyed[("Service", "tierline-model-server")]["spec"]
    assert service["clusterIP"] == "None"  # headless: its DNS name resolves to every ready model server
    model_server = server["containers"][0]
    if name == "cpu-demo":
        assert model_server["args"][:2] == ["engine", "serve"]
        assert "nvidia.com/gpu" not in model_server["resources"].get("limits", {})
    else:
        assert model_server["image"].startswith("vllm/vllm-openai:")
        assert model_server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    name_flag = "--served-model-name" if name == "gpu-vllm" else "--name"
    served = model_server["args"][model_server["args"].index(name_flag) + 1]
    container, backends = gateway_backends(objects)
    assert len(backends.models) == 1
    backend = next(iter(backends.models.values()))
    assert backend.upstream_model == served
    [endpoint] = backend.roots()
    url = urlsplit(endpoint)
    assert url.hostname == "tierline-model-server.tierline.svc.cluster.local"
    assert url.port == service["ports"][0]["port"] == model_server["ports"][0]["containerPort"]
    if backend.api_key_env:  # the gateway sends the key the model server checks, both from one Secret
        gateway_key = next(e for e in container["env"] if e["name"] == backend.api_key_env)
        server_key = next(e for e in model_server["env"] if e["name"] == "VLLM_API_KEY")
        assert gateway_key["valueFrom"] == server_key["valueFrom"]


def test_a_broken_manifest_fails_the_schema_check(tmp_path: Path) -> None:
    root = copy_manifests(tmp_path)
    gateway = root / "base" / "gateway.yaml"
    gateway.write_text(gateway.read_text().replace("  replicas: 2\n", "  replica: 2\n", 1))
    objects = render(root / "overlays" / "cpu-demo")
    errors = schema_errors(objects)
    assert errors == [
        "Deployment/tierline-gateway: spec: Additional properties are not allowed ('replica' was unexpected)"
    ]
    assert schema_errors(render_builtin(root / "overlays" / "cpu-demo")) == errors


def test_broken_references_fail_the_reference_check(tmp_path: Path) -> None:
    root = copy_manifests(tmp_path)
    gateway = root / "base" / "gateway.yaml"
    text = gateway.read_text()
    text = text.replace("httpGet: {path: /readyz, port: http}", "httpGet: {path: /readyz, port: 8080}")
    text = text.replace(
        "spec:\n  selector:\n    app.kubernetes.io/name: tierline-gateway",
        "spec:\n  selector:\n    app.kubernetes.io/name: tierline-gatway",
    )
    text = text.replace("key: redis-url}", "key: redis-password}")
    gateway.write_text(text)
    errors = reference_errors(render(root / "overlays" / "cpu-demo"))
    selector = "{'app.kubernetes.io/name': 'tierline-gatway'}"
    assert f"Service/tierline-gateway: selector {selector} matches no workload's pods" in errors
    assert "Deployment/tierline-gateway container gateway: readinessProbe port 8080 is no container port" in errors
    assert (
        "Deployment/tierline-gateway container gateway: TIERLINE_REDIS_URL: Secret tierline-secrets key redis-password "
        "undocumented" in errors
    )
    assert len(errors) == 3, errors


def test_a_literal_secret_fails_the_reference_check(tmp_path: Path) -> None:
    root = copy_manifests(tmp_path)
    overlay = root / "overlays" / "cpu-demo" / "kustomization.yaml"
    overlay.write_text(
        overlay.read_text()
        + "  - target: {kind: Deployment, name: tierline-console}\n"
        + "    patch: |-\n"
        + "      - {op: add, path: /spec/template/spec/containers/0/env/-, value: {name: X_API_KEY, value: sk-1}}\n"
    )
    errors = reference_errors(render(root / "overlays" / "cpu-demo"))
    assert errors == [
        "Deployment/tierline-console container console: X_API_KEY is a literal (secrets come from secretKeyRef)"
    ]


def test_db_wait_waits_for_the_head_revision(db_url: str, tmp_path: Path) -> None:
    """The gateways' init container: exit 1 naming the fix while the schema is behind, 0 once migrated."""
    from controlplane.storage.migrate import head_revision, upgrade

    env = base_env(tmp_path, TIERLINE_DATABASE_URL=db_url)
    args = ("db", "wait", "--timeout", "1", "--interval", "0.2")
    behind = run_tierline(*args, env=env, timeout=60)
    assert behind.returncode == 1
    assert f"code at {head_revision()}" in behind.stderr and "tierline db upgrade" in behind.stderr
    upgrade(db_url)
    done = run_tierline(*args, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"database at head {head_revision()}"


# -- deploy/compose.yaml ---------------------------------------------------------------------------------------------
COMPOSE = REPO / "deploy" / "compose.yaml"
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
LONG_RUNNING_RESTART = {"always", "unless-stopped", "on-failure"}


def compose_errors(path: Path) -> list[str]:
    """What docker compose would refuse or what would not start in order: unknown services or volumes, missing
    bind-mount sources, conditions on services that cannot meet them, services without restart policy or
    healthcheck."""
    doc = yaml.safe_load(path.read_text())
    services: dict[str, Obj] = doc["services"]
    volumes = set(doc.get("volumes") or {})
    errors = []
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            condition = cond.get("condition", "service_started") if isinstance(cond, dict) else "service_started"
            if condition not in CONDITIONS:
                errors.append(f"{name}: depends_on {dep}: unknown condition {condition}")
            if dep not in services:
                errors.append(f"{name}: depends_on unknown service {dep}")
                continue
            if condition == "service_healthy" and "healthcheck" not in services[dep]:
                errors.append(f"{name}: waits for {dep} to be healthy, which has no healthcheck")
            if condition == "service_completed_successfully" and services[dep].get("restart", "no") != "no":
                errors.append(f"{name}: waits for {dep} to complete, which restarts")
        for volume in svc.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith((".", "/")):
                if not (path.parent / source).exists():
                    errors.append(f"{name}: bind mount {source} does not exist")
            elif source not in volumes:
                errors.append(f"{name}: volume {source} is not declared")
        if svc.get("restart", "no") == "no":
            if not any(
                (s.get("depends_on") or {}).get(name, {}).get("condition") == "service_completed_successfully"
                for s in services.values()
            ):
                errors.append(f"{name}: no restart policy")
        elif svc["restart"].split(":")[0] not in LONG_RUNNING_RESTART:
            errors.append(f"{name}: restart {svc['restart']}")
        elif "healthcheck" not in svc:
            errors.append(f"{name}: no healthcheck")
    return errors


def test_compose_has_the_topology_and_its_references_resolve() -> None:
    assert compose_errors(COMPOSE) == []
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    assert {"postgres", "redis", "migrate", "model-server", "gateway-1", "gateway-2", "lb", "console"} <= set(services)
    gateways = {n: s for n, s in services.items() if s.get("command", [])[:2] == ["cloud", "serve"]}
    assert len(gateways) == 2
    ports = {n: int(s["command"][s["command"].index("--port") + 1]) for n, s in gateways.items()}
    nginx = (COMPOSE.parent / "compose" / "nginx.conf").read_text()
    upstream = re.search(r"upstream gateways \{(.*?)\}", nginx, re.S)
    assert upstream is not None
    assert set(re.findall(r"server ([\w.-]+):(\d+)", upstream.group(1))) == {(n, str(p)) for n, p in ports.items()}
    server = services["model-server"]["command"]
    assert server[:2] == ["engine", "serve"]
    for name, gateway in gateways.items():
        env = gateway["environment"]
        assert env["TIERLINE_REDIS_URL"].startswith("redis://redis:")
        assert "postgres:5432" in env["TIERLINE_DATABASE_URL"]
        mount = next(v for v in gateway["volumes"] if v.split(":")[1] == env["TIERLINE_CLOUD_BACKENDS"])
        backends = BackendsFile.model_validate_json((COMPOSE.parent / mount.split(":")[0]).read_text())
        [backend] = backends.models.values()
        assert backend.upstream_model == server[server.index("--name") + 1], name
        assert backend.roots() == [f"http://model-server:{server[server.index('--port') + 1]}"]
    # dependencies: migrations before gateways and console; the load balancer after healthy gateways
    for name in (*gateways, "console"):
        assert services[name]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert services["lb"]["depends_on"] == {g: {"condition": "service_healthy"} for g in gateways}


def test_a_broken_compose_file_fails_the_check(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    shutil.copytree(COMPOSE.parent / "compose", tmp_path / "compose")
    text = COMPOSE.read_text().replace("gateway-2: {condition: service_healthy}", "gateway-3: {condition: healthy}")
    broken.write_text(text.replace("[pgdata:/var/lib/postgresql", "[pg:/var/lib/postgresql"))
    assert sorted(compose_errors(broken)) == [
        "lb: depends_on gateway-3: unknown condition healthy",
        "lb: depends_on unknown service gateway-3",
        "postgres: volume pg is not declared",
    ]


def test_docker_compose_accepts_the_file(tmp_path: Path) -> None:
    """``docker compose config`` (or docker-compose's) where compose is installed, with and without the local
    services file; the YAML checks above hold either way."""
    command = next(
        (
            cmd
            for cmd in (["docker", "compose"], ["docker-compose"])
            if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], capture_output=True).returncode == 0
        ),
        None,
    )
    if command is None:
        pytest.skip("docker compose is not installed here; compose.yaml is checked by the YAML tests")
    env = {"POSTGRES_PASSWORD": "x" * 16, "TIERLINE_SECRET_KEY": "y" * 32, "PATH": "/usr/bin:/bin:/usr/local/bin"}
    for files in ([COMPOSE], [COMPOSE, COMPOSE.parent / "compose.local.yaml"]):
        args = [arg for f in files for arg in ("-f", str(f))]
        out = subprocess.run([*command, *args, "config", "--quiet"], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    missing = subprocess.run([*command, "-f", str(COMPOSE), "config", "--quiet"], env={"PATH": env["PATH"]},
                             capture_output=True, text=True)  # fmt: skip
    assert missing.returncode != 0 and "set POSTGRES_PASSWORD" in missing.stderr


# -- one image, one command line and environment per service: compose and Kubernetes agree --------------------------
# compose service -> the Kubernetes base's container that runs the same service
SAME_SERVICE = {
    "migrate": ("Job", "tierline-migrate", "migrate"),
    "model-server": ("Deployment", "tierline-model-server", "model-server"),
    "gateway-1": ("Deployment", "tierline-gateway", "gateway"),
    "gateway-2": ("Deployment", "tierline-gateway", "gateway"),
    "console": ("Deployment", "tierline-console", "console"),
}
# Deliberate differences: (compose service, variable) -> why.
ENV_DIFFERENCES = {
    (
        "console",
        "TIERLINE_CONSOLE_SECURE_COOKIES",
    ): "Kubernetes serves the console behind TLS; compose on http://localhost",
}
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def compose_command(service: Obj) -> list[str]:
    """The arguments compose passes to the image's entrypoint (``tierline``). The migrate service runs a shell:
    its first command, ``tierline db upgrade``, is the one Kubernetes runs (the keys it then makes are a Secret
    there)."""
    if service.get("entrypoint") == ["sh", "-c"]:
        first = shlex.split(service["command"][0].split("&&", 1)[0])
        assert first[0] == "tierline", first
        return first[1:]
    return list(service["command"])


def kubernetes_env(container: Obj, configmaps: dict[str, Obj]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        env[var["name"]] = var["value"] if ref is None else f"<Secret {ref['name']} key {ref['key']}>"
    return env


def drift_errors(compose_path: Path, base: Path) -> list[str]:
    """Where compose and the Kubernetes base run a service differently: another image, command line or
    environment (secrets compared by name only: compose interpolates them, Kubernetes reads Secrets)."""
    services = yaml.safe_load(compose_path.read_text())["services"]
    objects = render_builtin(base)
    keyed = by_key(objects)
    configmaps = {o["metadata"]["name"].rsplit("-", 1)[0]: o for o in objects if o["kind"] == "ConfigMap"}
    configmaps |= {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    errors = []
    entrypoint = re.search(r"^ENTRYPOINT (.*)$", DOCKERFILE.read_text(), re.M)
    if entrypoint is None or json.loads(entrypoint.group(1)) != ["tierline"]:
        errors.append('deploy/Dockerfile: ENTRYPOINT is not ["tierline"]')
    for name, (kind, workload, cname) in SAME_SERVICE.items():
        svc = services[name]
        pod = keyed[(kind, workload)]["spec"]["template"]["spec"]
        container = next(c for c in pod["containers"] if c["name"] == cname)
        where = f"{kind}/{workload}"
        if svc["image"].rsplit(":", 1)[0] != container["image"]:
            errors.append(f"{name}: image {svc['image']}, {where} runs {container['image']}")
        if "command" in container:
            errors.append(f"{where}: overrides the image's entrypoint")
        if compose_command(svc) != container["args"]:
            errors.append(f"{name}: runs {compose_command(svc)}, {where} runs {container['args']}")
        ours, theirs = svc.get("environment") or {}, kubernetes_env(container, configmaps)
        for var in sorted(set(ours) | set(theirs)):
            if (name, var) in ENV_DIFFERENCES:
                continue
            if var not in ours:
                errors.append(f"{name}: {var} is set in {where} but not in compose")
            elif var not in theirs:
                errors.append(f"{name}: {var} is set in compose but not in {where}")
            elif not SECRET_LIKE.search(var) and str(ours[var]) != theirs[var]:
                errors.append(f"{name}: {var}={ours[var]} in compose, {theirs[var]} in {where}")
    for pod in (p for o in objects for p in pod_specs(o)):  # the init containers run the same image
        for c in containers(pod):
            if c["image"] != "tierline" and not c["image"].startswith("vllm/"):
                errors.append(f"{c['name']}: image {c['image']} is not the tierline image")
    ours_backends = json.loads((compose_path.parent / "compose" / "backends.json").read_text())["models"]
    theirs_backends = json.loads((base / "backends.json").read_text())["models"]
    for model in ours_backends.values():
        model.pop("endpoints")
    for model in theirs_backends.values():
        model.pop("endpoints")
    if ours_backends != theirs_backends:
        errors.append("compose/backends.json and kubernetes/base/backends.json differ beyond their endpoints")
    return errors


def test_compose_and_kubernetes_run_one_image_with_the_same_commands_and_environment() -> None:
    assert drift_errors(COMPOSE, KUBERNETES / "base") == []
    assert set(SAME_SERVICE) == {
        n for n, s in yaml.safe_load(COMPOSE.read_text())["services"].items() if "tierline" in s["image"]
    }


def test_a_drifted_command_or_environment_fails_the_check(tmp_path: Path) -> None:
    root = copy_manifests(tmp_path)
    shutil.copytree(COMPOSE.parent / "compose", tmp_path / "compose")
    compose = tmp_path / "compose.yaml"
    text = COMPOSE.read_text().replace(
        '"--name", "tierline/lm-cloud", "--host", "0.0.0.0", "--port", "8000"]',
        '"--name", "tierline/lm-cloud", "--host", "0.0.0.0", "--port", "8001"]',
    )
    compose.write_text(text.replace('TIERLINE_CLOUD_KV_CACHE_MB: "512"', 'TIERLINE_CLOUD_KV_CACHE_MB: "256"'))
    config = root / "base" / "kustomization.yaml"
    config.write_text(config.read_text().replace("      - TIERLINE_LOG_FORMAT=json\n", ""))
    errors = drift_errors(compose, root / "base")
    model = ["engine", "serve", "--model", "/opt/tierline/shared/zoo/weights/demo/lm-cloud", "--name"]
    model += ["tierline/lm-cloud", "--host", "0.0.0.0", "--port"]
    expected = [
        f"{s}: TIERLINE_LOG_FORMAT is set in compose but not in {k}/{w}" for s, (k, w, _) in SAME_SERVICE.items()
    ]
    expected += [
        "model-server: TIERLINE_CLOUD_KV_CACHE_MB=256 in compose, 512 in Deployment/tierline-model-server",
        f"model-server: runs {[*model, '8001']}, Deployment/tierline-model-server runs {[*model, '8000']}",
    ]
    assert sorted(errors) == sorted(expected)
