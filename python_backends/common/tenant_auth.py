"""Authenticated tenants: signed tenant tokens, the keys that verify them, and who a request is from.

A tenant token is one ASCII string, `v1.<tenant>.<expiry>.<key id>.<signature>`:

  tenant     the tenant id (`quotas.TENANT_PATTERN`; it may itself contain dots)
  expiry     Unix seconds after which the token is refused (decimal, no sign, no leading zero)
  key id     which key signed it, so two keys can be valid at once while they are rotated
  signature  HMAC-SHA256 over `v1.<tenant>.<expiry>.<key id>` with that key's secret,
             base64url without padding (always 43 characters)

The fields are split from the right: expiry, key id and signature never contain a dot, so
a tenant id with dots stays unambiguous. Everything the signature covers is in the token,
the version included, so no field can be changed without the signature failing.

Keys live in a small JSON file, `{"<key id>": "<secret, base64url>", ...}`, each secret at
least 32 random bytes. `KeySource` re-reads it when it changes (checked at most once a
second), so keys rotate without a restart: add the new key, move the issuers to it, and
drop the old one once its tokens have expired. A file that fails to parse keeps the last
good keys.

`resolve_tenant` decides who a request is from, per the spec's mode:

  off        the `tenant` parameter is trusted as sent (no authentication)
  anonymous  a valid token names the tenant; a request with neither a token nor a `tenant`
             parameter is served as the tenant `anonymous` (the spec gives it a low tier)
  required   every request needs a valid token

Policy here is pure: the clocks are passed in (`now_s`), nothing is logged, and no error
message repeats a token or a secret.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from python_backends.common.paths import KIT_ROOT
from python_backends.common.quotas import TENANT_PATTERN, parse_tenant, parse_tenant_claim

TOKEN_VERSION = "v1"
MAX_TOKEN_LEN = 256  # the longest valid token is 157 characters; anything longer is refused unparsed
# Matched with fullmatch: `$` would also match before a trailing newline, and a field must
# have exactly one spelling (no second form of a valid token).
KEY_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,32}")
EXPIRY_PATTERN = re.compile(r"[1-9][0-9]{0,11}")
SIGNATURE_PATTERN = re.compile(r"[A-Za-z0-9_-]{43}")  # 32 bytes of HMAC-SHA256, base64url, no padding
MIN_SECRET_BYTES = 32  # as long as the HMAC-SHA256 output: shorter keys are the weak link
MAX_SECRET_BYTES = 1024
MAX_KEYS = 16  # a keys file holds the keys being rotated, not a key per tenant
MAX_KEYS_FILE_BYTES = 64 * 1024
MAX_CLOCK_SKEW_S = 300.0  # largest allowance the spec may give for clocks that disagree

ANONYMOUS_TENANT = "anonymous"  # who a request without a token is, in `anonymous` mode
# Where a request carries its token: the parameter, or the header the server forwards as a
# parameter under the header's own spelling (matched case-insensitively).
TOKEN_PARAMETER = "tenant_token"
TOKEN_HEADER = "tenant-token"
AUTH_FAILED = "authentication failed: "  # starts every AuthError message; clients and BLS callers match on it


class AuthMode(StrEnum):
    OFF = "off"  # trust the `tenant` parameter as sent
    ANONYMOUS = "anonymous"  # tokens name tenants; requests without one are the anonymous tenant
    REQUIRED = "required"  # every request needs a valid token


class AuthFailure(StrEnum):
    """Why a request failed authentication (the `reason` label of the failure counter)."""

    MISSING = "missing"  # no token where the mode requires one
    MALFORMED = "malformed"  # not a token of this format
    UNKNOWN_KEY = "unknown_key"  # signed with a key this server does not hold (never added, or retired)
    BAD_SIGNATURE = "bad_signature"  # forged or altered
    EXPIRED = "expired"  # genuine, but past its expiry
    UNVERIFIED_CLAIM = "unverified_claim"  # a `tenant` parameter without a token to prove it
    TENANT_MISMATCH = "tenant_mismatch"  # a `tenant` parameter that names another tenant than the token


class AuthError(Exception):
    """A request that failed authentication; it must not reach a model."""

    def __init__(self, reason: AuthFailure, detail: str):
        super().__init__(f"{AUTH_FAILED}{detail}")
        self.reason = reason


@dataclass(frozen=True)
class TokenParts:
    """The fields of a token that parsed, before its signature is checked."""

    tenant: str
    expiry_s: int  # Unix seconds
    key_id: str
    signature: str  # base64url, as sent

    @property
    def signed_text(self) -> bytes:
        return signing_input(self.tenant, self.expiry_s, self.key_id)


def signing_input(tenant: str, expiry_s: int, key_id: str) -> bytes:
    return f"{TOKEN_VERSION}.{tenant}.{expiry_s}.{key_id}".encode("ascii")


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


def _signature(secret: bytes, signed_text: bytes) -> str:
    return base64.urlsafe_b64encode(hmac.new(secret, signed_text, hashlib.sha256).digest()).rstrip(b"=").decode()


def check_key(key_id: str, secret: bytes) -> None:
    """ValueError when a key id or secret is not fit to sign with."""
    if not isinstance(key_id, str) or not KEY_ID_PATTERN.fullmatch(key_id):
        raise ValueError(f"key id {key_id!r} must be 1-32 letters, digits, '_' or '-'")
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise ValueError(f"key {key_id!r}: the secret is {len(secret)} bytes; it must be "
                         f"{MIN_SECRET_BYTES}-{MAX_SECRET_BYTES} random bytes")


def issue_token(tenant: str, expiry_s: int, key_id: str, secret: bytes) -> str:
    """A token for `tenant`, valid until `expiry_s` (Unix seconds), signed with the key `key_id`."""
    if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
        raise ValueError(f"tenant id {tenant!r} must be 1-64 letters, digits, '.', '_' or '-'")
    check_key(key_id, secret)
    if isinstance(expiry_s, bool) or not isinstance(expiry_s, int) or not EXPIRY_PATTERN.fullmatch(str(expiry_s)):
        raise ValueError(f"expiry {expiry_s!r} must be Unix seconds, a positive integer of at most 12 digits")
    signed_text = signing_input(tenant, expiry_s, key_id)
    return f"{signed_text.decode('ascii')}.{_signature(secret, signed_text)}"


def _malformed(what: str) -> AuthError:
    return AuthError(AuthFailure.MALFORMED, f"the tenant token is malformed: {what}; expected "
                     f"{TOKEN_VERSION}.<tenant>.<expiry>.<key id>.<signature> from `python -m tools tenant-token`")


def parse_token(token: object) -> TokenParts:
    """Split a token into its fields, strictly; AuthError(MALFORMED) says which part is wrong."""
    if not isinstance(token, str):
        raise _malformed(f"it is a {type(token).__name__}, not a string")
    if len(token) > MAX_TOKEN_LEN:
        raise _malformed(f"it is {len(token)} characters long; the limit is {MAX_TOKEN_LEN}")
    if not token.isascii():
        raise _malformed("it contains non-ASCII characters")
    parts = token.rsplit(".", 3)
    if len(parts) != 4 or not parts[0].startswith(f"{TOKEN_VERSION}."):
        raise _malformed(f"it does not start with '{TOKEN_VERSION}.' or has too few fields")
    head, expiry, key_id, signature = parts
    tenant = head[len(TOKEN_VERSION) + 1:]
    if not TENANT_PATTERN.fullmatch(tenant):
        raise _malformed("the tenant field is not a tenant id (1-64 letters, digits, '.', '_' or '-')")
    if not EXPIRY_PATTERN.fullmatch(expiry):
        raise _malformed("the expiry field is not Unix seconds")
    if not KEY_ID_PATTERN.fullmatch(key_id):
        raise _malformed("the key id field is not 1-32 letters, digits, '_' or '-'")
    if not SIGNATURE_PATTERN.fullmatch(signature):
        raise _malformed("the signature field is not 43 base64url characters")
    return TokenParts(tenant=tenant, expiry_s=int(expiry), key_id=key_id, signature=signature)


def verify_token(token: object, keys: Mapping[str, bytes], now_s: float, max_clock_skew_s: float = 0.0) -> str:
    """The tenant a token proves, or AuthError: malformed, unknown key, bad signature, expired.

    `now_s` is the wall clock (Unix seconds). The signature is checked before the expiry, so
    only a genuine token is ever told it has expired. `max_clock_skew_s` is how long after
    its expiry a token is still taken, for an issuer whose clock runs behind this server's.
    """
    parts = parse_token(token)
    secret = keys.get(parts.key_id)
    if secret is None:
        raise AuthError(AuthFailure.UNKNOWN_KEY, f"the tenant token was signed with key '{parts.key_id}', which "
                        "this server does not hold (never added, or already retired)")
    expected = _signature(secret, parts.signed_text)
    # Constant time: how much of a forged signature matched must not show in the answer's timing.
    if not hmac.compare_digest(expected.encode("ascii"), parts.signature.encode("ascii")):
        raise AuthError(AuthFailure.BAD_SIGNATURE, "the tenant token's signature does not match (forged or altered)")
    if now_s > parts.expiry_s + max_clock_skew_s:
        raise AuthError(AuthFailure.EXPIRED, f"the tenant token for '{parts.tenant}' expired "
                        f"{now_s - parts.expiry_s:.0f} s ago (at Unix time {parts.expiry_s}); ask for a new one")
    return parts.tenant


# --- the keys file ---------------------------------------------------------------------------


def parse_keys(text: str) -> dict[str, bytes]:
    """Keys from the keys file's text: a JSON object of key id -> base64url secret.

    An empty object is valid (no token verifies: how to revoke every key at once). ValueError
    names the offending key, never a secret.
    """
    if len(text) > MAX_KEYS_FILE_BYTES:
        raise ValueError(f"the keys file is {len(text)} bytes; the limit is {MAX_KEYS_FILE_BYTES}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        # The position only: the decoder's message could quote the text, and the text is secrets.
        raise ValueError(f"the keys file is not valid JSON (line {err.lineno}, column {err.colno})") from None
    if not isinstance(data, dict):
        raise ValueError('the keys file must be a JSON object {"<key id>": "<secret, base64url>"}')
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


def format_keys(keys: Mapping[str, bytes]) -> str:
    """The keys file's text, keys in the order given (the last one signs new tokens by default)."""
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
    refused until the file appears.
    """

    path: Path  # the keys file
    check_interval_s: float = 1.0
    _keys: dict[str, bytes] = field(default_factory=dict, init=False)
    _stamp: tuple[int, int, int] | None = field(default=None, init=False)  # (mtime_ns, size, inode) last read
    _problem: str | None = field(default=None, init=False)  # the last problem reported
    _checked_at: float = field(default=-math.inf, init=False)

    def keys(self, now_s: float, on_error: Callable[[str], None] | None = None) -> Mapping[str, bytes]:
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
        return json.dumps({"mode": self.mode.value, "keys_file": self.keys_file,
                           "max_clock_skew_s": self.max_clock_skew_s}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AuthConfig:
        try:
            data = json.loads(text)
            return cls(mode=AuthMode(data["mode"]), keys_file=str(data.get("keys_file", "")),
                       max_clock_skew_s=float(data.get("max_clock_skew_s", 30.0)))
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


def resolve_tenant(params: Mapping[str, object], config: AuthConfig, keys: Mapping[str, bytes], now_s: float) -> str:
    """The tenant a request is served as.

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
    tenant = verify_token(token, keys, now_s, config.max_clock_skew_s)
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
