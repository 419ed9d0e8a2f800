"""Authenticated tenants: tenant tokens (JWT), the keys that verify them, and who a request is from.

A tenant token is a JSON Web Token (RFC 7519) in its compact form, `<header>.<claims>.<signature>`,
each part base64url without padding. It names its tenant and its signing key:

  header     {"alg": "HS256" | "RS256" | "ES256", "kid": "<key id>", "typ": "JWT"}
  claims     {"sub": "<tenant id>", "exp": <Unix seconds>}   `nbf` is honoured when present;
             `iat`, `iss`, `aud` and any other claim are carried but not checked
  signature  over `<header>.<claims>` as sent, with the key named by `kid`

PyJWT checks the signature (HMAC-SHA256, RSA PKCS#1 v1.5 or ECDSA P-256, each with SHA-256) and
parses JWKS keys. The rest stays here because the kit's rules are stricter than a JWT library's
defaults: the clock is passed in (`now_s`) instead of read, the algorithm is the one of the key
`kid` names (never the one the token asks for: an HS256 token signed with a public RSA key, or
`alg: none`, is refused), `sub` must be a tenant id (`quotas.TENANT_PATTERN`), and a signature
has exactly one spelling (base64url's unused low bits must be zero). The order of the checks is
fixed: the token's shape, then the key, then the signature, then the expiry, so only a genuine
token is ever told it has expired. A token is valid up to and including its `exp` second plus
the spec's `max_clock_skew_s` (the leeway).

The spec's keys file is one of two documents, told apart by content:

  the kit's own keys  `{"<key id>": "<secret, base64url>", ...}`, each secret 32-1024 random bytes;
                      `python -m tools tenant-token` adds and drops keys and signs HS256 tokens
                      with the newest one. To rotate: add the new key, move the issuers to it,
                      drop the old one once its tokens have expired.
  a JWKS document     `{"keys": [<JWK>, ...]}` (RFC 7517), the public keys of an identity provider
                      or gateway that issues the tenants' tokens; the kit only verifies them.
                      Keys with `use` other than `sig`, or for an algorithm other than RS256 or
                      ES256, are skipped (a provider's set often holds such keys); a key the kit
                      would use must have a `kid`, and RSA keys at least 2048 bits. A symmetric
                      (`oct`) key or a private key (`d`) in the document is refused. The issuer
                      must put the tenant id in `sub`. `iss` and `aud` are not checked (the spec
                      has no setting for them): every token these keys sign is taken, so the
                      keys should sign tokens for the kit only (a gateway's, or an audience-
                      specific signing key of the provider).

`{}` or `{"keys": []}` revokes every token at once. `KeySource` re-reads the file when it
changes (checked at most once a second) and keeps the keys parsed (secrets, or the public
keys built from the JWKs), so keys rotate without a restart; a file that fails to parse keeps
the last good keys.

`resolve_tenant` decides who a request is from, per the spec's mode:

  off        the `tenant` parameter is trusted as sent (no authentication)
  anonymous  a valid token names the tenant; a request with neither a token nor a `tenant`
             parameter is served as the tenant `anonymous` (the spec gives it a low tier)
  required   every request needs a valid token

Policy here is pure: the clocks are passed in (`now_s`), nothing is logged, no error message
repeats a token or a secret. The only I/O is `KeySource` reading the keys file.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from python_backends.common.paths import KIT_ROOT
from python_backends.common.quotas import TENANT_PATTERN, parse_tenant, parse_tenant_claim

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey
    from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey

# PyJWT and cryptography are imported in the functions that sign and verify: every model's
# stub imports this module (through `python_backends.common.params`), and only routers with
# auth on use them; the two cost 50 ms of CPU at each of the kit's 26 stub starts.

SECRET_ALGORITHM = "HS256"  # the kit's own keys sign and verify with this
PUBLIC_KEY_ALGORITHMS = ("RS256", "ES256")  # what a JWKS key may verify
ALGORITHMS = (SECRET_ALGORITHM, *PUBLIC_KEY_ALGORITHMS)
# An identity provider's token carries more claims and a longer signature than the kit's own
# (at most 259 characters): 4 KiB holds an RS4096 token with a few dozen claims, and stays
# within gRPC's 8 KiB metadata limit when it travels as the `tenant-token` header.
MAX_TOKEN_LEN = 4096
# Matched with fullmatch: `$` would also match before a trailing newline.
KEY_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,32}")  # the kit's own key ids
JWKS_KEY_ID_PATTERN = re.compile(r"[\x21-\x7e]{1,128}")  # a provider's (and a token's) kid: printable ASCII
BASE64URL_PATTERN = re.compile(r"[A-Za-z0-9_-]*")
MAX_EXPIRY_S = 10**12  # Unix seconds: 12 digits, as far ahead as anyone issues
MIN_SECRET_BYTES = 32  # as long as the HMAC-SHA256 output (RFC 7518 3.2): shorter keys are the weak link
MAX_SECRET_BYTES = 1024
MIN_RSA_BITS = 2048  # RFC 7518 3.3
MAX_KEYS = 16  # the kit's keys file holds the keys being rotated, not a key per tenant
MAX_JWKS_KEYS = 64  # a provider's set holds its signing keys of a few rotations
MAX_KEYS_FILE_BYTES = 64 * 1024
MAX_CLOCK_SKEW_S = 300.0  # largest allowance the spec may give for clocks that disagree

ANONYMOUS_TENANT = "anonymous"  # who a request without a token is, in `anonymous` mode
# Where a request carries its token: the parameter, or the header the server forwards as a
# parameter under the header's own spelling (matched case-insensitively).
TOKEN_PARAMETER = "tenant_token"
TOKEN_HEADER = "tenant-token"
AUTH_FAILED = "authentication failed: "  # starts every AuthError message; clients and BLS callers match on it

# PyJWT checks the signature only: every claim is checked below, against the clock passed in.
SIGNATURE_ONLY = {"verify_signature": True, "verify_exp": False, "verify_nbf": False, "verify_iat": False,
                  "verify_aud": False, "verify_iss": False, "verify_sub": False, "verify_jti": False,
                  "require": []}


class AuthMode(StrEnum):
    OFF = "off"  # trust the `tenant` parameter as sent
    ANONYMOUS = "anonymous"  # tokens name tenants; requests without one are the anonymous tenant
    REQUIRED = "required"  # every request needs a valid token


class AuthFailure(StrEnum):
    """Why a request failed authentication (the `reason` label of the failure counter)."""

    MISSING = "missing"  # no token where the mode requires one
    MALFORMED = "malformed"  # not a tenant token (a JWT with a kid, a tenant `sub` and an `exp`)
    UNKNOWN_KEY = "unknown_key"  # signed with a key this server does not hold (never added, or retired)
    BAD_SIGNATURE = "bad_signature"  # forged or altered, unsigned (`alg: none`), or the wrong algorithm for its key
    EXPIRED = "expired"  # genuine, but past its expiry (or before its `nbf`)
    UNVERIFIED_CLAIM = "unverified_claim"  # a `tenant` parameter without a token to prove it
    TENANT_MISMATCH = "tenant_mismatch"  # a `tenant` parameter that names another tenant than the token
    WRONG_ISSUER = "wrong_issuer"  # a provider's token from another issuer (`iss`) than the spec names
    WRONG_AUDIENCE = "wrong_audience"  # a provider's token not meant for this kit (`aud`)


class AuthError(Exception):
    """A request that failed authentication; it must not reach a model."""

    def __init__(self, reason: AuthFailure, detail: str):
        super().__init__(f"{AUTH_FAILED}{detail}")
        self.reason = reason


@dataclass(frozen=True)
class PublicKey:
    """A key of a JWKS document, parsed once: verifies tokens of one algorithm."""

    algorithm: str  # "RS256" or "ES256"
    key: RSAPublicKey | EllipticCurvePublicKey


# What verifies a token, by key id: a secret of the kit's own keys file (HS256), or a JWKS key.
VerificationKey = bytes | PublicKey


def key_algorithm(key: VerificationKey) -> str:
    return key.algorithm if isinstance(key, PublicKey) else SECRET_ALGORITHM


@dataclass(frozen=True)
class TokenParts:
    """The fields of a token that parsed, before its signature is checked."""

    tenant: str  # `sub`
    expiry_s: float  # `exp`, Unix seconds
    key_id: str  # `kid`
    algorithm: str  # `alg`, one of ALGORITHMS
    signature: str  # base64url, as sent
    not_before_s: float | None = None  # `nbf`, Unix seconds, when the token has one
    issuer: str | None = None  # `iss`, when the token has one
    audience: tuple[str, ...] = ()  # `aud`: one string or a list of them (RFC 7519), when the token has one


def encode_secret(secret: bytes) -> str:
    return base64.urlsafe_b64encode(secret).rstrip(b"=").decode("ascii")


def decode_secret(text: str) -> bytes:
    """A secret from its base64url (or standard base64) text, padded or not; ValueError if it is not one."""
    if not isinstance(text, str) or not re.fullmatch(r"[A-Za-z0-9_\-+/]+={0,2}", text):
        raise ValueError("a secret must be a base64url string")
    stripped = text.rstrip("=")
    try:
        return base64.urlsafe_b64decode(stripped.replace("+", "-").replace("/", "_") + "=" * (-len(stripped) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("a secret must be a base64url string") from None


def check_key(key_id: str, secret: bytes) -> None:
    """ValueError when a key id or secret is not fit to sign with."""
    if not isinstance(key_id, str) or not KEY_ID_PATTERN.fullmatch(key_id):
        raise ValueError(f"key id {key_id!r} must be 1-32 letters, digits, '_' or '-'")
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise ValueError(f"key {key_id!r}: the secret is {len(secret)} bytes; it must be "
                         f"{MIN_SECRET_BYTES}-{MAX_SECRET_BYTES} random bytes")
    import jwt

    try:
        # PyJWT refuses an HMAC secret that parses as a PEM, DER or SSH key or holds a JWK: said
        # here, when the file is read, rather than as every token failing.
        jwt.get_algorithm_by_name(SECRET_ALGORITHM).prepare_key(secret)
    except jwt.InvalidKeyError:
        raise ValueError(f"key {key_id!r}: the secret looks like a public key or a JWK, not random bytes") from None


def issue_token(tenant: str, expiry_s: int, key_id: str, secret: bytes) -> str:
    """An HS256 token for `tenant`, valid until `expiry_s` (Unix seconds), signed with the key `key_id`."""
    if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
        raise ValueError(f"tenant id {tenant!r} must be 1-64 letters, digits, '.', '_' or '-'")
    check_key(key_id, secret)
    if isinstance(expiry_s, bool) or not isinstance(expiry_s, int) or not 0 < expiry_s < MAX_EXPIRY_S:
        raise ValueError(f"expiry {expiry_s!r} must be Unix seconds, a positive integer of at most 12 digits")
    import jwt

    return jwt.encode({"sub": tenant, "exp": expiry_s}, secret, algorithm=SECRET_ALGORITHM,
                      headers={"kid": key_id, "typ": "JWT"})


def _malformed(what: str) -> AuthError:
    return AuthError(AuthFailure.MALFORMED, f"the tenant token is malformed: {what}; expected a JWT "
                     "(<header>.<claims>.<signature>) from `python -m tools tenant-token` or the tenants' "
                     "identity provider")


def _segment(text: str, name: str) -> bytes:
    if not text or not BASE64URL_PATTERN.fullmatch(text) or len(text) % 4 == 1:
        raise _malformed(f"the {name} is not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _json_object(text: str, name: str) -> dict:
    try:
        data = json.loads(_segment(text, name))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested past the parser's depth
        raise _malformed(f"the {name} is not JSON") from None
    if not isinstance(data, dict):
        raise _malformed(f"the {name} is not a JSON object")
    return data


def _unix_seconds(value: object) -> float | None:
    """A NumericDate claim (RFC 7519: integer or not), within (0, MAX_EXPIRY_S); None if it is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < MAX_EXPIRY_S:
        return None
    return float(value)


def parse_token(token: object) -> TokenParts:
    """Split a token into its fields, strictly; AuthError(MALFORMED) says which part is wrong,
    AuthError(BAD_SIGNATURE) refuses an unsigned one. Nothing here is verified yet."""
    if not isinstance(token, str):
        raise _malformed(f"it is a {type(token).__name__}, not a string")
    if len(token) > MAX_TOKEN_LEN:
        raise _malformed(f"it is {len(token)} characters long; the limit is {MAX_TOKEN_LEN}")
    if not token.isascii():
        raise _malformed("it contains non-ASCII characters")
    parts = token.split(".")
    if len(parts) != 3:
        raise _malformed(f"it has {len(parts)} part{'s' if len(parts) != 1 else ''}, not 3 separated by '.'")
    header, claims = _json_object(parts[0], "header"), _json_object(parts[1], "claims part")
    algorithm = header.get("alg")
    if not isinstance(algorithm, str):
        raise _malformed("the header has no algorithm (alg)")
    if algorithm.lower() == "none" or not parts[2]:
        # No signature at all is a forgery, however it is spelled.
        raise AuthError(AuthFailure.BAD_SIGNATURE, "the tenant token is not signed (alg 'none' or no signature)")
    if algorithm not in ALGORITHMS:
        raise _malformed(f"alg {algorithm[:16]!r} is not one of {', '.join(ALGORITHMS)}")
    key_id = header.get("kid")
    if not isinstance(key_id, str) or not JWKS_KEY_ID_PATTERN.fullmatch(key_id):
        raise _malformed("the header has no key id (kid) of 1-128 printable ASCII characters")
    tenant = claims.get("sub")
    if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
        raise _malformed("the subject (sub) is not a tenant id (1-64 letters, digits, '.', '_' or '-')")
    expiry_s = _unix_seconds(claims.get("exp"))
    if expiry_s is None:
        raise _malformed("the expiry (exp) is missing or not Unix seconds")
    not_before_s = None
    if "nbf" in claims:
        not_before_s = _unix_seconds(claims["nbf"])
        if not_before_s is None:
            raise _malformed("the not-before time (nbf) is not Unix seconds")
    issuer = claims.get("iss")
    if issuer is not None and not isinstance(issuer, str):
        raise _malformed("the issuer (iss) is not a string")
    audience = claims.get("aud", ())
    if isinstance(audience, str):
        audience = (audience,)
    if not isinstance(audience, list | tuple) or not all(isinstance(a, str) for a in audience):
        raise _malformed("the audience (aud) is not a string or a list of strings")
    if not BASE64URL_PATTERN.fullmatch(parts[2]):
        raise _malformed("the signature is not base64url")
    return TokenParts(tenant=tenant, expiry_s=expiry_s, key_id=key_id, algorithm=algorithm, signature=parts[2],
                      not_before_s=not_before_s, issuer=issuer, audience=tuple(audience))


def _forged() -> AuthError:
    return AuthError(AuthFailure.BAD_SIGNATURE, "the tenant token's signature does not match (forged or altered)")


def _canonical(signature: str) -> bool:
    """Whether the signature is base64url as an encoder writes it: the unused low bits of its last
    character must be zero, or one genuine token would have several accepted spellings."""
    if len(signature) % 4 == 1:
        return False
    raw = base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4))
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") == signature


def verify_token(token: object, keys: Mapping[str, VerificationKey], now_s: float,
                 max_clock_skew_s: float = 0.0, issuer: str = "", audience: str = "") -> str:
    """The tenant a token proves, or AuthError: malformed, unknown key, bad signature, wrong issuer
    or audience, expired.

    `keys` maps key ids to the kit's HS256 secrets or a JWKS document's public keys. `now_s` is
    the wall clock (Unix seconds). The signature is checked before the expiry, so only a genuine
    token is ever told it has expired. `max_clock_skew_s` (the leeway) is how long after its
    expiry, and before its `nbf`, a token is still taken, for an issuer whose clock disagrees.

    `issuer` and `audience`, when set, are checked on tokens a JWKS key verifies: an identity
    provider signs tokens for many services with the same keys, so its token is for this kit
    only when it names the expected issuer (`iss`) and this kit among its audiences (`aud`).
    The kit's own HS256 secrets sign tokens for this kit alone, so its tokens need neither.
    """
    parts = verified_parts(token, keys, issuer, audience)
    check_times(parts, now_s, max_clock_skew_s)
    return parts.tenant


def verified_parts(token: object, keys: Mapping[str, VerificationKey], issuer: str = "",
                   audience: str = "") -> TokenParts:
    """The fields of a token whose signature, issuer and audience `keys` and the expected
    `issuer` and `audience` accept (AuthError otherwise); its times are not checked here."""
    parts = parse_token(token)
    key = keys.get(parts.key_id)
    if key is None:
        raise AuthError(AuthFailure.UNKNOWN_KEY, f"the tenant token was signed with key '{parts.key_id}', which "
                        "this server does not hold (never added, or already retired)")
    algorithm = key_algorithm(key)
    if parts.algorithm != algorithm:
        # The algorithm is the key's, never the token's: verifying an HS256 token with an RSA
        # public key as the secret is the classic forgery.
        raise AuthError(AuthFailure.BAD_SIGNATURE, f"the tenant token is signed with {parts.algorithm}, but key "
                        f"'{parts.key_id}' verifies {algorithm} only (forged or altered)")
    if not _canonical(parts.signature):
        raise _forged()
    import jwt

    try:
        jwt.decode(str(token), key.key if isinstance(key, PublicKey) else key, algorithms=[algorithm],
                   options=SIGNATURE_ONLY)
    except jwt.InvalidSignatureError:
        raise _forged() from None
    except jwt.PyJWTError:  # e.g. a `crit` header it does not know; the message could quote the token
        raise _malformed("PyJWT refused its header") from None
    if isinstance(key, PublicKey):
        if issuer and parts.issuer != issuer:
            raise AuthError(AuthFailure.WRONG_ISSUER, f"the tenant token for '{parts.tenant}' was issued by "
                            f"{parts.issuer!r}, not by {issuer!r}")
        if audience and audience not in parts.audience:
            raise AuthError(AuthFailure.WRONG_AUDIENCE, f"the tenant token for '{parts.tenant}' is for "
                            f"{list(parts.audience)!r}, not for {audience!r}")
    return parts


def check_times(parts: TokenParts, now_s: float, max_clock_skew_s: float = 0.0) -> None:
    """AuthError(EXPIRED) when a verified token is past its expiry or before its `nbf` at `now_s`."""
    if now_s > parts.expiry_s + max_clock_skew_s:
        raise AuthError(AuthFailure.EXPIRED, f"the tenant token for '{parts.tenant}' expired "
                        f"{now_s - parts.expiry_s:.0f} s ago (at Unix time {parts.expiry_s:.0f}); ask for a new one")
    if parts.not_before_s is not None and now_s < parts.not_before_s - max_clock_skew_s:
        raise AuthError(AuthFailure.EXPIRED, f"the tenant token for '{parts.tenant}' is not valid for another "
                        f"{parts.not_before_s - now_s:.0f} s (nbf, Unix time {parts.not_before_s:.0f})")


class VerifiedTokens:
    """Tokens whose signatures were checked already, each with the keys that checked it.

    A client sends the same token with every request until it expires, and checking it costs
    the router most of what refusing a request costs: a fifth of a refusal's time in the
    router's Python went to PyJWT (sampled at 1280 refusals/s on 2 vCPU). A token found here,
    as the very string checked before and with the very keys object that checked it, is not
    checked again; its expiry and `nbf` are, on every request. A key file that changes gives
    a new keys object (`KeySource`), so a rotated-out key's tokens are checked afresh (and
    refused). Entries are dropped all at once when `max_entries` is reached.
    """

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._checked: dict[tuple[str, str, str], tuple[Mapping[str, VerificationKey], TokenParts]] = {}

    def verify(self, token: object, keys: Mapping[str, VerificationKey], now_s: float,
               max_clock_skew_s: float = 0.0, issuer: str = "", audience: str = "") -> str:
        """What `verify_token` answers for the same arguments."""
        if not isinstance(token, str):
            return verify_token(token, keys, now_s, max_clock_skew_s, issuer, audience)
        entry = self._checked.get((token, issuer, audience))
        if entry is not None and entry[0] is keys:
            parts = entry[1]
        else:
            parts = verified_parts(token, keys, issuer, audience)
            if len(self._checked) >= self.max_entries:
                self._checked.clear()
            self._checked[(token, issuer, audience)] = (keys, parts)
        check_times(parts, now_s, max_clock_skew_s)
        return parts.tenant


# --- the keys file ---------------------------------------------------------------------------


def is_jwks(data: object) -> bool:
    """Whether a keys file's JSON is a JWKS document rather than the kit's own keys (whose
    values are all strings, so a `keys` member holding a list tells them apart)."""
    return isinstance(data, dict) and isinstance(data.get("keys"), list)


def _load_json(text: str) -> object:
    if len(text) > MAX_KEYS_FILE_BYTES:
        raise ValueError(f"the keys file is {len(text)} bytes; the limit is {MAX_KEYS_FILE_BYTES}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        # The position only: the decoder's message could quote the text, and the text is secrets.
        raise ValueError(f"the keys file is not valid JSON (line {err.lineno}, column {err.colno})") from None


def parse_secrets(text: str) -> dict[str, bytes]:
    """The kit's own keys (HS256 secrets) from the keys file's text, oldest first; ValueError for
    anything else, a JWKS document included (it verifies, it cannot sign)."""
    data = _load_json(text)
    if is_jwks(data):
        raise ValueError("the keys file is a JWKS document: it holds an identity provider's public keys, which "
                         "verify tenant tokens but cannot sign them (the provider issues the tokens)")
    return _secrets(data)


def _secrets(data: object) -> dict[str, bytes]:
    if not isinstance(data, dict):
        raise ValueError('the keys file must be a JSON object {"<key id>": "<secret, base64url>"} '
                         'or a JWKS document {"keys": [...]}')
    if len(data) > MAX_KEYS:
        raise ValueError(f"the keys file holds {len(data)} keys; the limit is {MAX_KEYS} "
                         "(it holds the keys being rotated, not one per tenant)")
    keys = {}
    for key_id, encoded in data.items():
        if not KEY_ID_PATTERN.fullmatch(key_id):
            raise ValueError(f"key id {key_id!r} must be 1-32 letters, digits, '_' or '-'")
        try:
            secret = decode_secret(encoded)
        except ValueError:
            raise ValueError(f"key {key_id!r}: the secret is not a base64url string") from None
        check_key(key_id, secret)
        keys[key_id] = secret
    return keys


def _jwk_algorithm(jwk: dict) -> str | None:
    """The algorithm a JWK verifies: its `alg`, else the one its key type implies (as PyJWK decides)."""
    if "alg" in jwk:
        return jwk["alg"] if isinstance(jwk["alg"], str) else None
    if jwk.get("kty") == "RSA":
        return "RS256"
    if jwk.get("kty") == "EC" and jwk.get("crv", "P-256") == "P-256":
        return "ES256"
    return None


def _public_key(jwk: dict, name: str, algorithm: str) -> PublicKey:
    kty = {"RS256": "RSA", "ES256": "EC"}[algorithm]
    if jwk.get("kty") != kty or (algorithm == "ES256" and jwk.get("crv") != "P-256"):
        raise ValueError(f"{name}: alg {algorithm} needs kty {kty!r}" + (" and crv 'P-256'" if kty == "EC" else ""))
    import jwt
    from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, EllipticCurvePublicKey
    from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey

    try:
        key = jwt.PyJWK(jwk, algorithm).key
    except (jwt.PyJWTError, ValueError, TypeError, KeyError):  # PyJWT's message quotes the key: not repeated
        raise ValueError(f"{name}: not a valid {algorithm} public key") from None
    if isinstance(key, RSAPublicKey) and key.key_size < MIN_RSA_BITS:
        raise ValueError(f"{name}: the RSA key is {key.key_size} bits; at least {MIN_RSA_BITS} are needed")
    if not isinstance(key, RSAPublicKey | EllipticCurvePublicKey) or (
            isinstance(key, EllipticCurvePublicKey) and not isinstance(key.curve, SECP256R1)):
        raise ValueError(f"{name}: not a {algorithm} public key")
    return PublicKey(algorithm=algorithm, key=key)


def parse_jwks(data: dict) -> dict[str, PublicKey]:
    """The RS256 and ES256 signing keys of a JWKS document, by kid; the rest is skipped (see the
    module docstring). ValueError names the offending key, never its numbers."""
    entries = data["keys"]
    if len(entries) > MAX_JWKS_KEYS:
        raise ValueError(f"the JWKS document holds {len(entries)} keys; the limit is {MAX_JWKS_KEYS}")
    keys: dict[str, PublicKey] = {}
    for index, jwk in enumerate(entries, start=1):
        if not isinstance(jwk, dict):
            raise ValueError(f"JWKS key #{index} is not a JSON object")
        kid = jwk.get("kid")
        name = f"JWKS key {kid!r}" if isinstance(kid, str) and len(kid) <= 128 else f"JWKS key #{index}"
        if "d" in jwk or jwk.get("kty") == "oct":
            # A private or shared secret published beside the public keys: whoever reads the file can sign.
            raise ValueError(f"{name} is a private or symmetric key: a JWKS keys file holds public keys only "
                             "(the kit's own HS256 secrets go in a keys file of its own format)")
        if jwk.get("use", "sig") != "sig":
            continue  # the issuer's encryption keys
        algorithm = _jwk_algorithm(jwk)
        if algorithm not in PUBLIC_KEY_ALGORITHMS:
            continue  # a key for an algorithm this server does not verify with
        if not isinstance(kid, str) or not JWKS_KEY_ID_PATTERN.fullmatch(kid):
            raise ValueError(f"{name}: a signing key needs a kid of 1-128 printable ASCII characters, "
                             "which tokens name it by")
        if kid in keys:
            raise ValueError(f"{name} appears twice")
        keys[kid] = _public_key(jwk, name, algorithm)
    if entries and not keys:
        raise ValueError(f"none of the JWKS document's {len(entries)} keys is an RS256 or ES256 signing key")
    return keys


def parse_keys(text: str) -> dict[str, VerificationKey]:
    """The verification keys in the keys file's text, by key id: the kit's own HS256 secrets, or
    the public keys of a JWKS document (told apart by `is_jwks`).

    An empty object (or an empty JWKS) is valid: no token verifies, which is how to revoke every
    key at once. ValueError names the offending key, never a secret.
    """
    data = _load_json(text)
    return dict(parse_jwks(data)) if is_jwks(data) else dict(_secrets(data))


def format_keys(keys: Mapping[str, bytes]) -> str:
    """The kit's keys file text, keys in the order given (the last one signs new tokens by default)."""
    for key_id, secret in keys.items():
        check_key(key_id, secret)
    return json.dumps({key_id: encode_secret(secret) for key_id, secret in keys.items()}, indent=2) + "\n"


@dataclass
class KeySource:
    """The live keys of one process: the keys file, re-read when it changes.

    The file is looked at no more than once per `check_interval_s` of the clock passed in
    (a `stat`, and a read only when its mtime, size or inode changed). A file that cannot be
    read or parsed keeps the keys that were good before, and `on_error` hears of it once per
    change, not once a second. Before any good read there are no keys, so every token is
    refused until the file appears. The keys are kept parsed between reads (a JWKS document's
    public keys are built once per change, not per request).
    """

    path: Path  # the keys file
    check_interval_s: float = 1.0
    _keys: dict[str, VerificationKey] = field(default_factory=dict, init=False)
    _stamp: tuple[int, int, int] | None = field(default=None, init=False)  # (mtime_ns, size, inode) last read
    _problem: str | None = field(default=None, init=False)  # the last problem reported
    _checked_at: float = field(default=-math.inf, init=False)

    def keys(self, now_s: float, on_error: Callable[[str], None] | None = None) -> Mapping[str, VerificationKey]:
        """The keys to verify with at monotonic time `now_s`."""
        if now_s - self._checked_at < self.check_interval_s:
            return self._keys
        self._checked_at = now_s
        try:
            stat = os.stat(self.path)
        except OSError as err:
            self._stamp = None  # read it again whenever it comes back
            self._fail(f"cannot be read ({err.strerror})", on_error)
            return self._keys
        stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if stamp == self._stamp:
            return self._keys
        self._stamp = stamp
        try:
            with open(self.path, encoding="utf-8") as handle:
                keys = parse_keys(handle.read(MAX_KEYS_FILE_BYTES + 1))
        except UnicodeDecodeError:
            self._fail("is not UTF-8 text", on_error)
        except OSError as err:
            self._fail(f"cannot be read ({err.strerror})", on_error)
        except ValueError as err:
            self._fail(f"is not valid: {err}", on_error)
        else:
            self._keys, self._problem = keys, None
        return self._keys

    def _fail(self, problem: str, on_error: Callable[[str], None] | None) -> None:
        if problem != self._problem and on_error is not None:
            kept = (f"keeping the keys read before ({', '.join(self._keys)})" if self._keys
                    else "no keys: every tenant token is refused")
            on_error(f"tenant keys file {self.path} {problem}; {kept}")
        self._problem = problem


# --- who a request is from -------------------------------------------------------------------


@dataclass(frozen=True)
class AuthConfig:
    """How a model authenticates tenants (spec `[tenants.auth]`, a model config parameter)."""

    mode: AuthMode = AuthMode.OFF
    keys_file: str = ""  # the keys file; a relative path is relative to the kit's root (KIT_ROOT)
    max_clock_skew_s: float = 30.0  # a token is taken this long past its expiry
    issuer: str = ""  # the `iss` a provider's (JWKS-verified) token must name; empty: not checked
    audience: str = ""  # the `aud` a provider's (JWKS-verified) token must include; empty: not checked

    def __post_init__(self) -> None:
        if not isinstance(self.mode, AuthMode):
            raise ValueError(f"auth mode {self.mode!r} must be one of {[m.value for m in AuthMode]}")
        if self.mode is not AuthMode.OFF and not self.keys_file:
            raise ValueError(f"auth mode '{self.mode}' needs a keys_file")
        if not 0.0 <= self.max_clock_skew_s <= MAX_CLOCK_SKEW_S:
            raise ValueError(f"max_clock_skew_s must be within [0, {MAX_CLOCK_SKEW_S:g}], got {self.max_clock_skew_s}")

    def keys_path(self, root: Path = KIT_ROOT) -> Path:
        path = Path(self.keys_file)
        return path if path.is_absolute() else root / path

    def to_json(self) -> str:
        data = {"mode": self.mode.value, "keys_file": self.keys_file, "max_clock_skew_s": self.max_clock_skew_s}
        # Written only when set: a spec without them generates the same parameter as before.
        data.update({name: value for name, value in (("issuer", self.issuer), ("audience", self.audience)) if value})
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AuthConfig:
        try:
            data = json.loads(text)
            return cls(mode=AuthMode(data["mode"]), keys_file=str(data.get("keys_file", "")),
                       max_clock_skew_s=float(data.get("max_clock_skew_s", 30.0)),
                       issuer=str(data.get("issuer", "")), audience=str(data.get("audience", "")))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"tenant auth config is not valid: {err}") from None


AUTH_OFF = AuthConfig()


def find_token(params: Mapping[str, object]) -> object | None:
    """The token a request carries (parameter `tenant_token` or header `tenant-token`), or None.

    Two different tokens in one request are malformed: which of them would count is not
    for the server to guess.
    """
    found = [value for key, value in params.items() if key.lower() in (TOKEN_PARAMETER, TOKEN_HEADER)]
    if not found:
        return None
    if len({str(value) for value in found}) > 1:
        raise _malformed(f"the request carries {len(found)} different tenant tokens")
    return found[0]  # verify_token refuses anything but a string


def resolve_tenant(params: Mapping[str, object], config: AuthConfig, keys: Mapping[str, VerificationKey],
                   now_s: float, tokens: VerifiedTokens | None = None) -> str:
    """The tenant a request is served as; `tokens`, when given, spares re-checking a token's
    signature.

    ValueError: the `tenant` parameter is not a tenant id (a bad request, as before
    authentication existed). AuthError: the request may not be served at all.
    """
    if config.mode is AuthMode.OFF:
        return parse_tenant(params)
    claim = parse_tenant_claim(params)
    token = find_token(params)
    if token is None:
        if config.mode is AuthMode.REQUIRED:
            raise AuthError(AuthFailure.MISSING, f"this model requires a tenant token: send it as the "
                            f"'{TOKEN_PARAMETER}' parameter or the '{TOKEN_HEADER}' header "
                            "(`python -m tools tenant-token TENANT` issues one)")
        if claim is not None:
            # Trusting a bare claim would let anyone spend another tenant's quota or take its tier.
            raise AuthError(AuthFailure.UNVERIFIED_CLAIM, f"parameter 'tenant' names '{claim}' without a tenant "
                            f"token to prove it: send the tenant's token as '{TOKEN_PARAMETER}', or leave "
                            f"'tenant' out to be served as '{ANONYMOUS_TENANT}'")
        return ANONYMOUS_TENANT
    verify = tokens.verify if tokens is not None else verify_token
    tenant = verify(token, keys, now_s, config.max_clock_skew_s, config.issuer, config.audience)
    if claim is not None and claim != tenant:
        raise AuthError(AuthFailure.TENANT_MISMATCH,
                        f"parameter 'tenant' names '{claim}', but the tenant token is for '{tenant}'")
    return tenant


def parse_auth_parameter(model_name: str, raw: str) -> AuthConfig:
    """The `tenant_auth` config parameter of a model (empty: authentication off); errors name the model."""
    if not raw:
        return AUTH_OFF
    try:
        return AuthConfig.from_json(raw)
    except ValueError as err:
        raise ValueError(f"model '{model_name}': parameter tenant_auth: {err}") from None
