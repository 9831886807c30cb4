"""What a registry serving spec may reach, without servers: the egress policy's address rules, the designated places
an upstream key may come from, the submission check's 400s, and the pool's re-check at every resolution (DNS
rebinding)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from pathlib import Path
from typing import Any

import pytest

from cloud.serving.backends.pool import ReplicaPool, pinned_roots
from cloud.serving.backends.upstream import make_pool
from controlplane.registry.service import check_serving
from shared.backend_spec import KeySources, ServingSpec, UpstreamSettings, UpstreamSpec
from shared.egress import EgressPolicy, own_listeners
from shared.errors import ConfigurationError, ValidationError

LOOPBACK_OK = EgressPolicy(allow_loopback=True, check_own_sockets=False)


def spec(*endpoints: str, **extra: Any) -> ServingSpec:
    return ServingSpec.model_validate(
        {"backend": "openai", "endpoints": list(endpoints), "upstream_model": "x", **extra}
    )


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://169.254.169.254/latest/meta-data", "link-local or cloud metadata"),
        ("http://[fe80::1]:80", "link-local or cloud metadata"),
        ("http://100.100.100.200", "link-local or cloud metadata"),
        ("http://[fd00:ec2::254]", "link-local or cloud metadata"),
        ("http://metadata.google.internal", "cloud metadata host"),
        ("http://0.0.0.0:8000", "unspecified"),
        ("http://[::]:8000", "unspecified"),
        ("http://2130706433:8000", "127.0.0.1) not written as four decimal numbers"),
        ("http://0177.0.0.1:8000", "not written as four decimal numbers"),
        ("http://0x7f.1:8000", "not written as four decimal numbers"),
        ("http://127.1:8000", "not written as four decimal numbers"),
        ("http://127.0.0.1:8000", "loopback"),
        ("http://[::1]:8000", "loopback"),
        ("http://[::ffff:127.0.0.1]:8000", "127.0.0.1 is a loopback"),
        ("http://localhost:8000", "loopback"),
    ],
)
def test_the_default_policy_refuses_metadata_unspecified_and_loopback(url: str, why: str) -> None:
    addresses, problem = EgressPolicy(check_own_sockets=False).resolve(url)
    assert addresses == [] and problem is not None and why in problem


def test_private_cluster_addresses_are_allowed_by_default_and_loopback_when_the_operator_says() -> None:
    assert EgressPolicy(check_own_sockets=False).resolve("http://10.0.0.7:8000") == (
        [ipaddress.IPv4Address("10.0.0.7")],
        None,
    )
    assert LOOPBACK_OK.resolve("http://127.0.0.1:8000")[1] is None
    # metadata stays refused whatever the operator allows
    assert "metadata" in (LOOPBACK_OK.resolve("http://169.254.169.254")[1] or "")


def test_an_allow_list_admits_only_what_it_names() -> None:
    policy = EgressPolicy(allow=EgressPolicy.parse_allow("10.1.0.0/16, 127.0.0.2/32"), check_own_sockets=False)
    assert policy.resolve("http://10.1.2.3:8000")[1] is None
    assert policy.resolve("http://127.0.0.2:8000")[1] is None  # a listed loopback address
    assert "allow-list" in (policy.resolve("http://10.2.0.1:8000")[1] or "")
    assert "loopback" in (policy.resolve("http://127.0.0.1:8000")[1] or "")
    with pytest.raises(ValueError, match="neither a network"):
        EgressPolicy.parse_allow("10.0.0.0/8, http://x")


def test_the_clouds_database_redis_and_listeners_are_refused_even_with_loopback_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIERLINE_DATABASE_URL", "postgresql+psycopg://tierline:pw@127.0.0.1:5432/tierline")
    monkeypatch.setenv("TIERLINE_REDIS_URL", "redis://localhost/0")
    monkeypatch.setenv("TIERLINE_CONSOLE_PORT", "18401")
    monkeypatch.setenv("TIERLINE_CLOUD_UPSTREAM_ALLOW_LOOPBACK", "true")
    upstream = UpstreamSettings()
    for url, param in [
        ("http://127.0.0.1:5432", "serving.endpoints.0"),
        ("http://127.0.0.1:6379", "serving.endpoints.0"),  # localhost:6379 from the Redis URL's default port
        ("http://localhost:18401", "serving.endpoints.0"),
    ]:
        with pytest.raises(ValidationError) as err:
            check_serving({"backend": "openai", "endpoints": [url], "upstream_model": "x"}, upstream)
        assert err.value.param == param and err.value.status_code == 400
        assert "one of the cloud's own services" in err.value.message
    assert check_serving({"backend": "openai", "endpoints": ["http://127.0.0.1:8000"], "upstream_model": "x"}, upstream)


def test_a_listening_socket_of_the_checking_process_is_refused() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert (ipaddress.IPv4Address("127.0.0.1"), port) in own_listeners()
        policy = EgressPolicy(allow_loopback=True)
        assert "own services" in (policy.resolve(f"http://127.0.0.1:{port}")[1] or "")


def test_a_serving_spec_reads_its_key_only_from_designated_places(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "x.key").write_text("sk-designated\n")
    (secrets / "x.key").chmod(0o600)
    outside = tmp_path / "outside.key"
    outside.write_text("sk-outside\n")
    outside.chmod(0o600)
    (secrets / "escape.key").symlink_to(outside)
    (secrets / "open.key").write_text("sk-open\n")
    (secrets / "open.key").chmod(0o644)
    monkeypatch.setenv("TIERLINE_SECRET_KEY", "the-cloud-secret")
    monkeypatch.setenv("TIERLINE_UPSTREAM_KEY_X", "sk-env")
    keys = KeySources(secrets, "TIERLINE_UPSTREAM_KEY_")
    url = "http://10.0.0.7:8000"
    assert spec(url, api_key_env="TIERLINE_UPSTREAM_KEY_X").api_key(keys) == "sk-env"
    assert spec(url, api_key_file="x.key").api_key(keys) == "sk-designated"
    refusals = [
        (spec(url, api_key_env="TIERLINE_SECRET_KEY"), "not an upstream key variable"),
        (spec(url, api_key_env="TIERLINE_UPSTREAM_KEY_"), "not an upstream key variable"),
        (spec(url, api_key_file=str(outside)), "is a path"),
        (spec(url, api_key_file="../outside.key"), "is a path"),
        (spec(url, api_key_file="escape.key"), "leads out of the secrets directory"),
        (spec(url, api_key_file="open.key"), "chmod 600"),
    ]
    for refused, why in refusals:
        with pytest.raises(ConfigurationError, match=why) as err:
            refused.api_key(keys)
        assert "the-cloud-secret" not in err.value.message and "sk-outside" not in err.value.message
    with pytest.raises(ConfigurationError, match="no secrets directory"):
        spec(url, api_key_file="x.key").api_key(KeySources(None, "TIERLINE_UPSTREAM_KEY_"))
    # A serving spec never reads at the operator's trust, even when no places are handed in ...
    with pytest.raises(ConfigurationError, match="not an upstream key variable"):
        spec(url, api_key_env="TIERLINE_SECRET_KEY").api_key()
    # ... while the operator's own backends file may name any variable.
    monkeypatch.setenv("VLLM_API_KEY", "sk-operator")
    operator = UpstreamSpec.model_validate({"endpoints": [url], "upstream_model": "x", "api_key_env": "VLLM_API_KEY"})
    assert operator.api_key() == "sk-operator"


def test_a_key_prefix_that_reaches_the_platforms_secrets_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for prefix in ("TIERLINE_", "TIERLINE_S", "X"):
        monkeypatch.setenv("TIERLINE_CLOUD_UPSTREAM_KEY_ENV_PREFIX", prefix)
        with pytest.raises(ValueError, match="key_env_prefix"):
            UpstreamSettings()


def test_a_name_that_resolves_to_a_refused_address_is_refused_when_the_pool_is_built() -> None:
    roots, refused = pinned_roots(["http://localhost:8000"], EgressPolicy(check_own_sockets=False), False)
    assert roots == [] and "localhost" in refused[0] and "loopback" in refused[0]
    with pytest.raises(ConfigurationError, match="loopback"):
        make_pool("m", spec("http://10.0.0.7:8000", "http://localhost:8000"), EgressPolicy(check_own_sockets=False))


def test_a_name_is_pinned_to_a_checked_address_and_dropped_when_it_rebinds_to_a_refused_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers = {"model.svc": "10.0.0.9"}

    def fake_getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[host], port or 0))]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    policy = EgressPolicy(check_own_sockets=False)
    pool = make_pool("m", spec("http://model.svc:8000"), policy)
    assert [(e.root, e.host) for e in pool.endpoints] == [("http://10.0.0.9:8000", "model.svc:8000")]

    async def rebind() -> ReplicaPool:
        answers["model.svc"] = "169.254.169.254"  # the attacker's DNS answers differently now
        await pool.resolve()
        return pool

    asyncio.run(rebind())
    assert all(e.draining for e in pool.endpoints) or pool.endpoints == []
    assert not any(e.root.startswith("http://169.254") for e in pool.endpoints)
