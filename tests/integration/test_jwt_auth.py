"""JWT bearer tokens (RS256 from a PEM key, EdDSA from a JWKS file) accepted by the cloud API: the key's type
fixes the algorithm, and the audience is checked unless explicitly switched off."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from cloud.gateway.jwt_auth import JwtVerifier
from shared.errors import AuthenticationError, ConfigurationError
from tests.conftest import base_env, free_port, migrated_sqlite, run_server, seed_data_dir
from tests.forkserver import run_tierline

ISSUER = "https://login.example.test/"
AUDIENCE = "https://api.tierline.test"


def _pem(key: Any) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _claims(**extra: Any) -> dict[str, Any]:
    return {"iss": ISSUER, "aud": AUDIENCE, "exp": int(time.time()) + 300, "tenant": "acme", **extra}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("jwt")
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ed_key = ed25519.Ed25519PrivateKey.generate()
    (d / "issuer.pem").write_bytes(_pem(rsa_key))
    jwk = json.loads(jwt.algorithms.OKPAlgorithm.to_jwk(ed_key.public_key()))
    rsa_jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key()))
    jwks = {"keys": [{**jwk, "kid": "ed-1", "use": "sig", "alg": "EdDSA"}, {**rsa_jwk, "kid": "rsa-1", "use": "sig"}]}
    (d / "jwks.json").write_text(json.dumps(jwks))
    return {"rsa": rsa_key, "ed": ed_key, "pem": d / "issuer.pem", "jwks": d / "jwks.json"}


def test_verifier_accepts_good_tokens_and_names_what_is_wrong(keys: dict[str, Any]) -> None:
    v = JwtVerifier.from_files(ISSUER, "tenant", AUDIENCE, keys["pem"], keys["jwks"])
    assert v.tenant_name(jwt.encode(_claims(), keys["rsa"], algorithm="RS256")) == "acme"
    assert v.tenant_name(jwt.encode(_claims(), keys["ed"], algorithm="EdDSA", headers={"kid": "ed-1"})) == "acme"
    bad = {
        "expired": jwt.encode(_claims(exp=int(time.time()) - 10), keys["rsa"], algorithm="RS256"),
        "wrong issuer": jwt.encode(_claims(iss="https://evil.test/"), keys["rsa"], algorithm="RS256"),
        "no tenant": jwt.encode(
            {"iss": ISSUER, "aud": AUDIENCE, "exp": int(time.time()) + 60}, keys["rsa"], algorithm="RS256"
        ),
        "unknown kid": jwt.encode(_claims(), keys["ed"], algorithm="EdDSA", headers={"kid": "other"}),
        "other signer": jwt.encode(_claims(), rsa.generate_private_key(65537, 2048), algorithm="RS256"),
        "hmac with the public key": jwt.encode(
            _claims(), "a-shared-secret-of-sufficient-length-32b", algorithm="HS256"
        ),
        "unsigned": jwt.encode(_claims(), "", algorithm="none"),
    }
    for name, token in bad.items():
        with pytest.raises(AuthenticationError):
            v.tenant_name(token)
        assert name


def test_cloud_api_serves_a_tenant_named_by_a_jwt(
    keys: dict[str, Any], tmp_path: Path, tiny_zoo: Path, session_data_dir: Path
) -> None:
    seed_data_dir(tmp_path, tiny_zoo, session_data_dir)
    db_url = migrated_sqlite(tmp_path)
    env = base_env(
        tmp_path,
        TIERLINE_DATABASE_URL=db_url,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_JWT_ISSUER=ISSUER,
        TIERLINE_CLOUD_JWT_JWKS_FILE=str(keys["jwks"]),
        TIERLINE_CLOUD_JWT_AUDIENCE=AUDIENCE,
    )
    run_tierline("tenants", "create", "acme", env=env, check=True)
    with run_server(["cloud", "serve"], env, free_port(), timeout=120) as url:
        token = jwt.encode(_claims(), keys["ed"], algorithm="EdDSA", headers={"kid": "ed-1"})
        body = {"model": "tierline/lm-cloud", "prompt": "x", "max_tokens": 2}
        ok = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        stranger = jwt.encode(_claims(tenant="initech"), keys["ed"], algorithm="EdDSA", headers={"kid": "ed-1"})
        denied = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {stranger}"})
        assert denied.status_code == 401 and "initech" in denied.json()["error"]["message"]
        crossed = jwt.encode(_claims(), keys["rsa"], algorithm="RS256", headers={"kid": "ed-1"})
        refused = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {crossed}"})
        assert refused.status_code == 401, refused.text  # a kid naming a key of another type is no server error
        assert "does not match its key" in refused.json()["error"]["message"]
        no_aud = {k: v for k, v in _claims().items() if k != "aud"}
        unaddressed = jwt.encode(no_aud, keys["ed"], algorithm="EdDSA", headers={"kid": "ed-1"})
        refused = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {unaddressed}"})
        assert refused.status_code == 401 and "aud" in refused.json()["error"]["message"]


def test_a_kid_naming_a_key_of_another_type_is_refused_not_a_crash(keys: dict[str, Any]) -> None:
    v = JwtVerifier.from_files(ISSUER, "tenant", AUDIENCE, None, keys["jwks"])
    crossed = {
        "RS256 under an Ed25519 kid": jwt.encode(_claims(), keys["rsa"], algorithm="RS256", headers={"kid": "ed-1"}),
        "EdDSA under an RSA kid": jwt.encode(_claims(), keys["ed"], algorithm="EdDSA", headers={"kid": "rsa-1"}),
    }
    for name, token in crossed.items():
        with pytest.raises(AuthenticationError, match="does not match its key"):
            v.tenant_name(token)
        assert name
    assert v.tenant_name(jwt.encode(_claims(), keys["rsa"], algorithm="RS256", headers={"kid": "rsa-1"})) == "acme"


def test_the_audience_is_required_unless_explicitly_not_checked(keys: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match="TIERLINE_CLOUD_JWT_AUDIENCE"):
        JwtVerifier.from_files(ISSUER, "tenant", None, keys["pem"], None)
    v = JwtVerifier.from_files(ISSUER, "tenant", AUDIENCE, keys["pem"], None)
    no_aud = {k: val for k, val in _claims().items() if k != "aud"}
    for token in (
        jwt.encode(no_aud, keys["rsa"], algorithm="RS256"),
        jwt.encode(_claims(aud="https://another-api.test"), keys["rsa"], algorithm="RS256"),
    ):
        with pytest.raises(AuthenticationError, match=r"(?i)aud"):
            v.tenant_name(token)
    unchecked = JwtVerifier.from_files(ISSUER, "tenant", None, keys["pem"], None, verify_audience=False)
    assert unchecked.tenant_name(jwt.encode(no_aud, keys["rsa"], algorithm="RS256")) == "acme"
