"""Webhook rules that need no server: which URLs are accepted, how a receiver verifies a signature, and how
retries back off."""

from __future__ import annotations

import hashlib
import hmac
import random

import pytest

from cloud.gateway.ids import CloudIds
from cloud.gateway.jobs import job_json
from cloud.gateway.webhooks import is_valid_signature, new_secret, retry_delay, sign, validate_webhook_url
from controlplane.storage.tables import Job
from shared.errors import ValidationError


def receiver_verifies(secret: str, raw_body: bytes, signature_header: str) -> bool:
    """The verification recipe documented for webhook receivers."""
    expected = "sha256=" + hmac.new(secret.encode(), raw_body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, signature_header)


def test_a_receiver_verifies_the_signature_of_the_exact_body() -> None:
    secret = new_secret()
    body = b'{"id":"job_1","object":"job","status":"succeeded"}'
    header = sign(secret, body)
    assert header.startswith("sha256=") and receiver_verifies(secret, body, header)
    assert is_valid_signature(secret, body, header)
    assert not receiver_verifies(secret, body + b" ", header)
    assert not receiver_verifies(new_secret(), body, header)
    assert secret.startswith("whsec_") and secret != new_secret()


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com/tierline",
        "http://hooks.example.com:8080/a?b=c",
        "https://8.8.8.8/hook",
    ],
)
def test_public_http_urls_are_accepted(url: str) -> None:
    assert validate_webhook_url(url, allow_private=False) == url


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://example.com/hook", "http"),
        ("file:///etc/passwd", "http"),
        ("https://", "host"),
        ("example.com/hook", "http"),
        ("https://user:pw@example.com/", "credentials"),
        ("http://example.com:99999/", "valid URL"),
        ("https://example.com/" + "a" * 3000, "2048"),
        ("http://127.0.0.1:8080/hook", "public"),
        ("http://localhost/hook", "public"),
        ("http://10.0.0.5/hook", "public"),
        ("http://169.254.169.254/latest/meta-data", "public"),
        ("http://[::1]/hook", "public"),
    ],
)
def test_bad_or_private_urls_are_refused_naming_webhook_url(url: str, reason: str) -> None:
    with pytest.raises(ValidationError, match=reason) as exc:
        validate_webhook_url(url, allow_private=False)
    assert exc.value.param == "webhook_url" and exc.value.status_code == 400


def test_private_addresses_pass_when_allowed_but_other_rules_still_hold() -> None:
    assert validate_webhook_url("http://127.0.0.1:9/hook", allow_private=True)
    with pytest.raises(ValidationError):
        validate_webhook_url("ftp://127.0.0.1/", allow_private=True)
    with pytest.raises(ValidationError, match="string"):
        validate_webhook_url(["http://example.com"], allow_private=True)


def test_retry_delays_grow_exponentially_with_bounded_jitter() -> None:
    rng = random.Random(7)
    for attempt in range(1, 8):
        delays = [retry_delay(attempt, 2.0, rng) for _ in range(200)]
        nominal = 2.0 * 2 ** (attempt - 1)
        assert all(0.5 * nominal <= d <= 1.5 * nominal for d in delays)
        assert len(set(delays)) > 100  # jittered, so receivers are not hit in lockstep
    assert retry_delay(40, 2.0, rng) <= 3600 * 1.5


def test_an_idempotency_key_names_one_job_per_tenant() -> None:
    ids = CloudIds(b"s" * 32)
    assert ids.job_id(1, "k") == ids.job_id(1, "k") != ids.job_id(2, "k")
    assert ids.job_id(1) != ids.job_id(1)
    assert all(len(ids.job_id(1, k)) <= 64 for k in ("k", "x" * 255))


def test_the_job_json_has_every_field_the_api_documents() -> None:
    shown = job_json(Job(id="job_1", tenant_id=1, endpoint="/v1/completions", model="m"))
    assert shown["object"] == "job" and shown["status"] == "queued" and isinstance(shown["created_at"], int)
    assert set(shown) == {
        "id",
        "object",
        "endpoint",
        "model",
        "status",
        "created_at",
        "started_at",
        "finished_at",
        "attempts",
        "webhook_url",
        "result",
        "error",
    }


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://2130706433/", "'2130706433' is an IPv4 address (127.0.0.1) not written as four decimal numbers"),
        ("http://0177.0.0.1/", "'0177.0.0.1' is an IPv4 address (127.0.0.1) not written as four decimal numbers"),
        ("http://0/", "'0' is an IPv4 address (0.0.0.0) not written as four decimal numbers"),
        ("http://0x7f.1:8080/hook", "'0x7f.1' is an IPv4 address (127.0.0.1)"),
        ("http://127.1/", "'127.1' is an IPv4 address (127.0.0.1)"),
        ("http://1.2.3.999/", "'1.2.3.999' is not a valid IPv4 address"),
        ("http://%31%32%37.0.0.1/", "must not be percent-encoded"),
    ],
)
@pytest.mark.parametrize("allow_private", [False, True])
def test_numbers_a_resolver_reads_as_an_address_are_refused_at_submission(
    url: str, reason: str, allow_private: bool
) -> None:
    with pytest.raises(ValidationError) as exc:
        validate_webhook_url(url, allow_private=allow_private)
    assert reason in exc.value.message and exc.value.param == "webhook_url" and exc.value.status_code == 400


def test_a_trailing_dot_neither_hides_loopback_nor_refuses_a_public_address() -> None:
    with pytest.raises(ValidationError, match="public"):
        validate_webhook_url("http://localhost./hook", allow_private=False)
    with pytest.raises(ValidationError, match="public"):
        validate_webhook_url("http://127.0.0.1./hook", allow_private=False)
    assert validate_webhook_url("https://8.8.8.8./hook", allow_private=False)
    assert validate_webhook_url("https://[2001:4860:4860::8888]/hook", allow_private=False)
