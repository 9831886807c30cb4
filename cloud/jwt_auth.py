"""JWT bearer tokens from a configured issuer (the OAuth 2.0 resource-server pattern).

A token is accepted when its signature verifies against the issuer's public key (a PEM file) or a key of
its JWKS file (chosen by ``kid``), with an allowed algorithm (RS256 or EdDSA), an unexpired ``exp``, the
configured ``iss`` (and ``aud`` when set). The tenant is the one named by the configured claim.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt

from shared.errors import AuthenticationError, ConfigurationError

ALGORITHMS = ("RS256", "EdDSA")


def looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and token.startswith("eyJ")


@dataclass(slots=True)
class JwtVerifier:
    issuer: str
    tenant_claim: str
    audience: str | None
    public_key: Any | None = None
    jwks: jwt.PyJWKSet | None = None

    @classmethod
    def from_files(
        cls,
        issuer: str,
        tenant_claim: str,
        audience: str | None,
        public_key_file: Path | None,
        jwks_file: Path | None,
    ) -> JwtVerifier:
        if public_key_file is None and jwks_file is None:
            raise ConfigurationError(
                "JWT auth needs TIERLINE_CLOUD_JWT_PUBLIC_KEY_FILE or TIERLINE_CLOUD_JWT_JWKS_FILE"
            )
        verifier = cls(issuer, tenant_claim, audience)
        try:
            if public_key_file is not None:
                from cryptography.hazmat.primitives.serialization import load_pem_public_key

                verifier.public_key = load_pem_public_key(public_key_file.read_bytes())
            if jwks_file is not None:
                verifier.jwks = jwt.PyJWKSet.from_dict(json.loads(jwks_file.read_text()))
        except (OSError, ValueError, jwt.PyJWTError) as exc:
            raise ConfigurationError(f"cannot load the JWT issuer key: {exc}") from None
        return verifier

    def _key_for(self, token: str) -> Any:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise AuthenticationError("malformed bearer token") from None
        kid = header.get("kid")
        if self.jwks is not None and kid is not None:
            for k in self.jwks.keys:
                if k.key_id == kid:
                    return k.key
            raise AuthenticationError("bearer token signed by an unknown key")
        if self.public_key is not None:
            return self.public_key
        if self.jwks is not None and len(self.jwks.keys) == 1:
            return self.jwks.keys[0].key
        raise AuthenticationError("bearer token has no key id (kid)")

    def tenant_name(self, token: str) -> str:
        """Verify the token and return the tenant it names; AuthenticationError when anything is off."""
        key = self._key_for(token)
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=list(ALGORITHMS),
                issuer=self.issuer,
                audience=self.audience,
                options={"require": ["exp", "iss"], "verify_aud": self.audience is not None},
            )
        except jwt.ExpiredSignatureError:
            raise AuthenticationError("bearer token has expired") from None
        except jwt.PyJWTError as exc:
            raise AuthenticationError(f"invalid bearer token: {exc}") from None
        tenant = claims.get(self.tenant_claim)
        if not isinstance(tenant, str) or not tenant:
            raise AuthenticationError(f"bearer token lacks the '{self.tenant_claim}' claim")
        return tenant
