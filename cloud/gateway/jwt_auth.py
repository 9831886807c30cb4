"""JWT bearer tokens from a configured issuer (the OAuth 2.0 resource-server pattern).

A token is accepted when its signature verifies against the issuer's public key (a PEM file) or a key of
its JWKS file (chosen by ``kid``), with the algorithm of that key's type (RS256 for RSA, EdDSA for Ed25519),
an unexpired ``exp``, the configured ``iss`` and the configured ``aud``. Audience checking is on by default:
without an audience the verifier refuses to start, unless ``verify_audience`` is explicitly off (an issuer
whose tokens are all meant for this API). The tenant is the one named by the configured claim.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey

from shared.errors import AuthenticationError, ConfigurationError

ALGORITHMS = ("RS256", "EdDSA")


def _algorithm_for(key: Any) -> str | None:
    """The one algorithm a key may verify: a token naming another is refused before PyJWT sees the pair."""
    if isinstance(key, RSAPublicKey):
        return "RS256"
    if isinstance(key, Ed25519PublicKey):
        return "EdDSA"
    return None


def looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and token.startswith("eyJ")


@dataclass(slots=True)
class JwtVerifier:
    issuer: str
    tenant_claim: str
    audience: str | None
    public_key: Any | None = None
    jwks: jwt.PyJWKSet | None = None
    verify_audience: bool = True

    @classmethod
    def from_files(
        cls,
        issuer: str,
        tenant_claim: str,
        audience: str | None,
        public_key_file: Path | None,
        jwks_file: Path | None,
        *,
        verify_audience: bool = True,
    ) -> JwtVerifier:
        if public_key_file is None and jwks_file is None:
            raise ConfigurationError(
                "JWT auth needs TIERLINE_CLOUD_JWT_PUBLIC_KEY_FILE or TIERLINE_CLOUD_JWT_JWKS_FILE"
            )
        if verify_audience and not audience:
            # Without an audience any token the issuer mints, for any of its APIs, would name a tenant here.
            raise ConfigurationError(
                "JWT auth needs TIERLINE_CLOUD_JWT_AUDIENCE (the aud claim tokens for this API carry), or "
                "TIERLINE_CLOUD_JWT_VERIFY_AUDIENCE=false to accept the issuer's tokens for any audience"
            )
        verifier = cls(issuer, tenant_claim, audience, verify_audience=verify_audience)
        try:
            if public_key_file is not None:
                from cryptography.hazmat.primitives.serialization import load_pem_public_key

                verifier.public_key = load_pem_public_key(public_key_file.read_bytes())
                if _algorithm_for(verifier.public_key) is None:
                    raise ValueError(f"{public_key_file} holds neither an RSA nor an Ed25519 public key")
            if jwks_file is not None:
                verifier.jwks = jwt.PyJWKSet.from_dict(json.loads(jwks_file.read_text()))
        except (OSError, ValueError, jwt.PyJWTError) as exc:
            raise ConfigurationError(f"cannot load the JWT issuer key: {exc}") from None
        return verifier

    def _key_for(self, token: str) -> tuple[Any, str | None]:
        """The key that must have signed ``token``, and the algorithm its header names."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise AuthenticationError("malformed bearer token") from None
        kid, alg = header.get("kid"), header.get("alg")
        named = alg if isinstance(alg, str) else None
        if self.jwks is not None and kid is not None:
            for k in self.jwks.keys:
                if k.key_id == kid:
                    return k.key, named
            raise AuthenticationError("bearer token signed by an unknown key")
        if self.public_key is not None:
            return self.public_key, named
        if self.jwks is not None and len(self.jwks.keys) == 1:
            return self.jwks.keys[0].key, named
        raise AuthenticationError("bearer token has no key id (kid)")

    def tenant_name(self, token: str) -> str:
        """Verify the token and return the tenant it names; AuthenticationError when anything is off."""
        key, named = self._key_for(token)
        algorithm = _algorithm_for(key)
        if algorithm is None:
            raise AuthenticationError(f"bearer token's key is a {type(key).__name__}, not an RSA or Ed25519 key")
        if named != algorithm:
            raise AuthenticationError(f"bearer token's alg {named!r} does not match its key (which takes {algorithm})")
        required = ["exp", "iss", "aud"] if self.verify_audience else ["exp", "iss"]
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[algorithm],
                issuer=self.issuer,
                audience=self.audience if self.verify_audience else None,
                options={"require": required, "verify_aud": self.verify_audience},
            )
        except jwt.ExpiredSignatureError:
            raise AuthenticationError("bearer token has expired") from None
        except jwt.PyJWTError as exc:
            raise AuthenticationError(f"invalid bearer token: {exc}") from None
        except (TypeError, ValueError) as exc:  # PyJWT raises these for a key its algorithm cannot use
            raise AuthenticationError(f"invalid bearer token: {exc}") from None
        tenant = claims.get(self.tenant_claim)
        if not isinstance(tenant, str) or not tenant:
            raise AuthenticationError(f"bearer token lacks the '{self.tenant_claim}' claim")
        return tenant
