"""Tenant tokens, the keys file and its reloader, and who a request is served as."""

import base64
import hashlib
import hmac
import json
import os
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hypothesis import given, settings
from hypothesis import strategies as st

from python_backends.common.tenant_auth import (
    ANONYMOUS_TENANT,
    AUTH_FAILED,
    AUTH_OFF,
    KIT_ROOT,
    MAX_JWKS_KEYS,
    MAX_KEYS,
    MAX_TOKEN_LEN,
    AuthConfig,
    AuthError,
    AuthFailure,
    AuthMode,
    KeySource,
    PublicKey,
    VerifiedTokens,
    decode_secret,
    encode_secret,
    find_token,
    format_keys,
    is_jwks,
    issue_token,
    parse_auth_parameter,
    parse_keys,
    parse_secrets,
    parse_token,
    resolve_tenant,
    verify_token,
)

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(100, 132))
NOW = 1_800_000_000.0
KEYS = {"k1": SECRET}


def token(tenant="team-a", expiry_s=int(NOW) + 3600, key_id="k1", secret=SECRET):
    return issue_token(tenant, expiry_s, key_id, secret)


def b64(value) -> str:
    """A JSON value as a JWT part: base64url without padding."""
    return b64_text(json.dumps(value))


def b64_text(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode("latin-1")).rstrip(b"=").decode()


def hs256(claims, header=None, key_id="k1", secret=SECRET) -> str:
    """A token with any header and claims, signed as the kit signs (for claims it never issues)."""
    head = f"{b64({'alg': 'HS256', 'kid': key_id} | (header or {}))}.{b64(claims)}"
    signature = base64.urlsafe_b64encode(hmac.new(secret, head.encode(), hashlib.sha256).digest()).rstrip(b"=")
    return f"{head}.{signature.decode()}"


def failure(call) -> AuthError:
    with pytest.raises(AuthError) as info:
        call()
    assert str(info.value).startswith(AUTH_FAILED)
    return info.value


# --- tokens ---------------------------------------------------------------------------------


def test_a_token_is_a_jwt_naming_its_tenant_expiry_and_key_and_verifies():
    issued = token()
    assert jwt.get_unverified_header(issued) == {"alg": "HS256", "kid": "k1", "typ": "JWT"}
    assert jwt.decode(issued, options={"verify_signature": False}) == {"sub": "team-a", "exp": int(NOW) + 3600}
    assert len(issued.rsplit(".", 1)[1]) == 43  # 32 bytes of HMAC-SHA256
    assert verify_token(issued, KEYS, NOW) == "team-a"
    parts = parse_token(issued)
    assert (parts.tenant, parts.expiry_s, parts.key_id, parts.algorithm) == ("team-a", NOW + 3600, "k1", "HS256")


def test_a_tenant_id_with_dots_is_unambiguous():
    assert verify_token(token("eu.team.a"), KEYS, NOW) == "eu.team.a"
    assert parse_token(token("a.b.c.d")).tenant == "a.b.c.d"


def test_either_of_two_keys_verifies_its_own_tokens():
    keys = {"old": SECRET, "new": OTHER_SECRET}
    assert verify_token(token(key_id="old"), keys, NOW) == "team-a"
    assert verify_token(token(key_id="new", secret=OTHER_SECRET), keys, NOW) == "team-a"


def test_a_token_of_a_key_the_server_does_not_hold_is_refused_naming_the_key():
    error = failure(lambda: verify_token(token(key_id="retired"), KEYS, NOW))
    assert error.reason is AuthFailure.UNKNOWN_KEY and "'retired'" in str(error)


def test_a_token_signed_with_another_secret_under_a_known_key_id_is_forged():
    error = failure(lambda: verify_token(token(secret=OTHER_SECRET), KEYS, NOW))
    assert error.reason is AuthFailure.BAD_SIGNATURE


@pytest.mark.parametrize("claims", [{"sub": "team-b", "exp": int(NOW) + 3600},  # another tenant
                                    {"sub": "team-a", "exp": int(NOW) + 86400 + 3600}])  # a later expiry
def test_changing_a_signed_field_breaks_the_signature(claims):
    header, _, signature = token().split(".")
    altered = f"{header}.{b64(claims)}.{signature}"
    assert failure(lambda: verify_token(altered, KEYS, NOW)).reason is AuthFailure.BAD_SIGNATURE


def test_a_signature_in_another_base64_spelling_is_refused():
    # The last of the 43 characters carries 2 unused bits: only the canonical spelling counts.
    issued = token()
    last = issued[-1]
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    sibling = alphabet[alphabet.index(last) ^ 1]
    error = failure(lambda: verify_token(issued[:-1] + sibling, KEYS, NOW))
    assert error.reason is AuthFailure.BAD_SIGNATURE


def test_an_expired_token_is_refused_after_the_signature_is_checked():
    expired = token(expiry_s=int(NOW) - 100)
    error = failure(lambda: verify_token(expired, KEYS, NOW))
    assert error.reason is AuthFailure.EXPIRED
    assert "'team-a'" in str(error) and "100 s ago" in str(error)
    # A forged token is told it is forged, never that it expired.
    forged = token(expiry_s=int(NOW) - 100, secret=OTHER_SECRET)
    assert failure(lambda: verify_token(forged, KEYS, NOW)).reason is AuthFailure.BAD_SIGNATURE


def test_a_token_checked_once_is_taken_again_until_it_expires_or_its_key_goes():
    tokens, issued = VerifiedTokens(), token(expiry_s=int(NOW) + 60)
    assert tokens.verify(issued, KEYS, NOW) == "team-a"
    assert tokens.verify(issued, KEYS, NOW + 59) == "team-a"  # found, not checked again
    # Its expiry is checked on every request, found or not.
    assert failure(lambda: tokens.verify(issued, KEYS, NOW + 61)).reason is AuthFailure.EXPIRED
    # A key file that changed gives another keys object: the token is checked against it afresh.
    rotated = {"k2": OTHER_SECRET}
    assert failure(lambda: tokens.verify(issued, rotated, NOW)).reason is AuthFailure.UNKNOWN_KEY
    assert failure(lambda: tokens.verify(issued, dict(KEYS) | {"k1": OTHER_SECRET}, NOW)).reason is \
        AuthFailure.BAD_SIGNATURE
    # A forged token is never taken for the genuine one it was made from, and never kept.
    forged = issued[:-2] + ("AA" if not issued.endswith("AA") else "BA")
    assert failure(lambda: tokens.verify(forged, KEYS, NOW)).reason is AuthFailure.BAD_SIGNATURE
    assert failure(lambda: tokens.verify(forged, KEYS, NOW)).reason is AuthFailure.BAD_SIGNATURE
    assert failure(lambda: tokens.verify(None, KEYS, NOW)).reason is AuthFailure.MALFORMED


def test_kept_tokens_are_bounded_and_resolve_tenant_uses_them():
    tokens = VerifiedTokens(max_entries=2)
    issued = [token(f"team-{i}") for i in range(5)]
    assert [tokens.verify(t, KEYS, NOW) for t in issued] == [f"team-{i}" for i in range(5)]
    assert len(tokens._checked) <= 2
    config = AuthConfig(mode=AuthMode.REQUIRED, keys_file="keys.json")
    assert resolve_tenant({"tenant_token": issued[0]}, config, KEYS, NOW, tokens) == "team-0"
    with pytest.raises(AuthError):
        resolve_tenant({"tenant_token": issued[0]}, config, KEYS, NOW + 7200, tokens)


def test_the_clock_skew_allowance_takes_a_token_just_past_its_expiry():
    expiry = int(NOW)
    assert verify_token(token(expiry_s=expiry), KEYS, NOW) == "team-a"  # valid up to its expiry second
    assert verify_token(token(expiry_s=expiry), KEYS, NOW + 30, max_clock_skew_s=30) == "team-a"
    assert failure(lambda: verify_token(token(expiry_s=expiry), KEYS, NOW + 30.5,
                                        max_clock_skew_s=30)).reason is AuthFailure.EXPIRED
    assert failure(lambda: verify_token(token(expiry_s=expiry), KEYS, NOW + 1)).reason is AuthFailure.EXPIRED


def test_a_token_before_its_not_before_time_is_refused_beyond_the_skew_allowance():
    early = hs256({"sub": "team-a", "exp": int(NOW) + 3600, "nbf": int(NOW) + 60})
    error = failure(lambda: verify_token(early, KEYS, NOW))
    assert error.reason is AuthFailure.EXPIRED and "not valid for another 60 s" in str(error)
    assert verify_token(early, KEYS, NOW, max_clock_skew_s=60) == "team-a"
    assert verify_token(early, KEYS, NOW + 60) == "team-a"
    # Claims the kit does not check are carried, and a fractional NumericDate is a date.
    other_claims = {"sub": "team-a", "exp": NOW + 0.5, "iat": int(NOW), "iss": "gateway", "aud": ["x"]}
    assert verify_token(hs256(other_claims), KEYS, NOW) == "team-a"


@pytest.mark.parametrize("header", [{"alg": "none", "kid": "k1"}, {"alg": "None", "kid": "k1"},
                                    {"alg": "NONE", "kid": "k1"}, {"alg": "HS256", "kid": "k1"}])
def test_an_unsigned_token_is_refused_as_a_forgery(header):
    unsigned = f"{b64(header)}.{b64({'sub': 'team-a', 'exp': int(NOW) + 60})}."
    error = failure(lambda: verify_token(unsigned, KEYS, NOW))
    assert error.reason is AuthFailure.BAD_SIGNATURE and "not signed" in str(error)


def test_a_header_pyjwt_cannot_honour_is_malformed():
    critical = hs256({"sub": "team-a", "exp": int(NOW) + 60}, header={"crit": ["exp"]})
    error = failure(lambda: verify_token(critical, KEYS, NOW))
    assert error.reason is AuthFailure.MALFORMED and "PyJWT refused its header" in str(error)


HEADER, CLAIMS, SIGNATURE = token().split(".")
VALID = token()


def crafted(header=None, claims=None, signature=SIGNATURE):
    return (f"{b64(header) if header is not None else HEADER}.{b64(claims) if claims is not None else CLAIMS}"
            f".{signature}")


def claims(**changes):
    return {key: value for key, value in ({"sub": "team-a", "exp": int(NOW) + 3600} | changes).items()
            if value is not None}


@pytest.mark.parametrize(("bad", "what"), [
    (None, "not a string"),
    (42, "not a string"),
    ("", "it has 1 part,"),
    ("x" * (MAX_TOKEN_LEN + 1), f"the limit is {MAX_TOKEN_LEN}"),
    (f"{HEADER}.{CLAIMS}é.{SIGNATURE}", "non-ASCII"),
    (f"{HEADER}.{CLAIMS}", "it has 2 parts"),
    (f"{VALID}.{SIGNATURE}", "it has 4 parts"),
    ("v1.team-a.1800003600.k1." + SIGNATURE, "it has 5 parts"),  # the kit's tokens before JWT
    (f".{CLAIMS}.{SIGNATURE}", "the header is not base64url"),
    (f"{HEADER}=.{CLAIMS}.{SIGNATURE}", "the header is not base64url"),
    (f"{HEADER}x.{CLAIMS}.{SIGNATURE}", "the header is not"),  # one character too many for base64
    (f"{HEADER}.{CLAIMS}+.{SIGNATURE}", "the claims part is not base64url"),
    (f"bm90IGpzb24.{CLAIMS}.{SIGNATURE}", "the header is not JSON"),
    (f"{HEADER}.{b64_text('[' * 1500 + ']' * 1500)}.{SIGNATURE}", "the claims part is not JSON"),  # too deep
    (f"{b64_text(chr(0xff) * 3)}.{CLAIMS}.{SIGNATURE}", "the header is not JSON"),
    (crafted(header=[]), "the header is not a JSON object"),
    (crafted(claims="team-a"), "the claims part is not a JSON object"),
    (crafted(header={"kid": "k1"}), "no algorithm (alg)"),
    (crafted(header={"alg": 256, "kid": "k1"}), "no algorithm (alg)"),
    (crafted(header={"alg": "HS512", "kid": "k1"}), "alg 'HS512' is not one of HS256, RS256, ES256"),
    (crafted(header={"alg": "PS256", "kid": "k1"}), "alg 'PS256'"),
    (crafted(header={"alg": "HS256"}), "no key id (kid)"),
    (crafted(header={"alg": "HS256", "kid": ""}), "no key id (kid)"),
    (crafted(header={"alg": "HS256", "kid": "k 1"}), "no key id (kid)"),
    (crafted(header={"alg": "HS256", "kid": "k" * 129}), "no key id (kid)"),
    (crafted(header={"alg": "HS256", "kid": ["k1"]}), "no key id (kid)"),
    (crafted(claims=claims(sub=None)), "the subject (sub) is not a tenant id"),
    (crafted(claims=claims(sub="")), "the subject (sub)"),
    (crafted(claims=claims(sub="has space")), "the subject (sub)"),
    (crafted(claims=claims(sub="x" * 65)), "the subject (sub)"),
    (crafted(claims=claims(sub=7)), "the subject (sub)"),
    (crafted(claims=claims(sub="team-a\n")), "the subject (sub)"),
    (crafted(claims=claims(exp=None)), "the expiry (exp) is missing or not Unix seconds"),
    (crafted(claims=claims(exp=str(int(NOW)))), "the expiry (exp)"),
    (crafted(claims=claims(exp=True)), "the expiry (exp)"),
    (crafted(claims=claims(exp=0)), "the expiry (exp)"),
    (crafted(claims=claims(exp=-5)), "the expiry (exp)"),
    (crafted(claims=claims(exp=10**12)), "the expiry (exp)"),
    (crafted(claims=claims(nbf="soon")), "the not-before time (nbf)"),
    (crafted(signature=SIGNATURE + "="), "the signature is not base64url"),
    (crafted(signature=SIGNATURE[:-1] + "+"), "the signature is not base64url"),
    # A trailing newline would make a second spelling of a valid token.
    (f"{VALID}\n", "the signature is not base64url"),
    (f"{HEADER}\n.{CLAIMS}.{SIGNATURE}", "the header is not base64url"),
])
def test_a_malformed_token_says_which_part_is_wrong(bad, what):
    error = failure(lambda: verify_token(bad, KEYS, NOW))
    assert error.reason is AuthFailure.MALFORMED and what in str(error)


def test_no_error_repeats_the_token_or_a_secret():
    cases = [token(key_id="retired"), token(secret=OTHER_SECRET), token(expiry_s=int(NOW) - 5), VALID + "x"]
    for bad in cases:
        message = str(failure(lambda bad=bad: verify_token(bad, KEYS, NOW)))
        assert bad.rsplit(".", 1)[1] not in message and encode_secret(SECRET) not in message


@pytest.mark.parametrize(("args", "message"), [
    (("has space", 10, "k1", SECRET), "tenant id"),
    (("", 10, "k1", SECRET), "tenant id"),
    (("a", 10, "k.1", SECRET), "key id"),
    (("a", 10, "k1", SECRET[:31]), "31 bytes"),
    (("a", 0, "k1", SECRET), "expiry"),
    (("a", -5, "k1", SECRET), "expiry"),
    (("a", True, "k1", SECRET), "expiry"),
    (("a", "10", "k1", SECRET), "expiry"),
    (("a", 10**12, "k1", SECRET), "expiry"),
])
def test_issue_refuses_what_would_not_verify(args, message):
    with pytest.raises(ValueError, match=message):
        issue_token(*args)


tenants = st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True)
key_ids = st.from_regex(r"[A-Za-z0-9_-]{1,32}", fullmatch=True)
secrets_ = st.binary(min_size=32, max_size=64)


@settings(max_examples=200, deadline=None)
@given(tenant=tenants, key_id=key_ids, secret=secrets_, expiry=st.integers(1, 10**12 - 1))
def test_every_issued_token_verifies_to_its_tenant(tenant, key_id, secret, expiry):
    issued = issue_token(tenant, expiry, key_id, secret)
    assert len(issued) <= MAX_TOKEN_LEN
    assert verify_token(issued, {key_id: secret}, expiry) == tenant


@settings(max_examples=300, deadline=None)
@given(tenant=tenants, position=st.integers(0, 10_000), replacement=st.characters(codec="ascii"))
def test_a_token_changed_anywhere_does_not_verify(tenant, position, replacement):
    issued = issue_token(tenant, int(NOW) + 60, "k1", SECRET)
    index = position % len(issued)
    if issued[index] == replacement:
        return
    altered = issued[:index] + replacement + issued[index + 1:]
    with pytest.raises(AuthError):
        verify_token(altered, KEYS, NOW)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=300))
def test_any_string_either_verifies_or_fails_with_an_auth_error(text):
    try:
        verify_token(text, KEYS, NOW)
    except AuthError as err:
        assert err.reason in AuthFailure


# --- the keys file ---------------------------------------------------------------------------


def test_keys_round_trip_through_the_file_format_in_order():
    keys = {"2026-01": SECRET, "2026-02": OTHER_SECRET}
    text = format_keys(keys)
    assert parse_keys(text) == keys and list(parse_keys(text)) == ["2026-01", "2026-02"]
    assert parse_keys("{}") == {}


def test_a_secret_may_be_written_in_standard_base64_with_padding():
    import base64

    assert parse_keys(json.dumps({"k1": base64.b64encode(SECRET).decode()})) == {"k1": SECRET}
    assert decode_secret(encode_secret(OTHER_SECRET)) == OTHER_SECRET


@pytest.mark.parametrize(("text", "message"), [
    ('{"k1": ', "not valid JSON (line 1"),
    ("[]", "must be a JSON object"),
    (json.dumps({f"k{i}": encode_secret(SECRET) for i in range(MAX_KEYS + 1)}), f"limit is {MAX_KEYS}"),
    (json.dumps({"k 1": encode_secret(SECRET)}), "key id 'k 1'"),
    (json.dumps({"k1": 12345}), "'k1': the secret is not a base64url string"),
    (json.dumps({"k1": "not base64!"}), "'k1': the secret is not a base64url string"),
    (json.dumps({"k1": encode_secret(b"short")}), "5 bytes"),
    (json.dumps({"k1": encode_secret(json.dumps({"kty": "oct", "k": encode_secret(SECRET)}).encode())}),
     "'k1': the secret looks like a public key or a JWK"),
    ("x" * 70_000, "the limit is 65536"),
])
def test_a_bad_keys_file_is_refused_with_the_reason(text, message):
    with pytest.raises(ValueError) as info:
        parse_keys(text)
    assert message in str(info.value)


def test_a_keys_file_error_never_quotes_a_secret():
    secret_text = encode_secret(SECRET)
    for text in (f'{{"k1": "{secret_text}", "k2": "{secret_text}"', json.dumps({"k1": secret_text[:20]})):
        with pytest.raises(ValueError) as info:
            parse_keys(text)
        assert secret_text[:20] not in str(info.value)


def test_format_keys_refuses_a_short_secret():
    with pytest.raises(ValueError, match="bytes"):
        format_keys({"k1": b"x" * 8})


def write(path, keys):
    # As the tenant-token tool does: a new file renamed into place.
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(format_keys(keys))
    os.replace(staging, path)


def test_the_key_source_reads_the_file_once_per_interval_and_follows_changes(tmp_path):
    path = tmp_path / "keys.json"
    errors = []
    source = KeySource(path, check_interval_s=1.0)
    assert source.keys(0.0, errors.append) == {}
    assert len(errors) == 1 and "cannot be read" in errors[0] and "every tenant token is refused" in errors[0]
    assert source.keys(5.0, errors.append) == {} and len(errors) == 1  # said once, not every second
    write(path, {"k1": SECRET})
    assert source.keys(5.5, errors.append) == {}  # checked at 5.0: not looked at again yet
    assert source.keys(6.0, errors.append) == {"k1": SECRET}
    write(path, {"k1": SECRET, "k2": OTHER_SECRET})  # rotation: a second key
    assert source.keys(7.0) == {"k1": SECRET, "k2": OTHER_SECRET}
    write(path, {"k2": OTHER_SECRET})  # the old key dropped
    assert source.keys(8.0) == {"k2": OTHER_SECRET}


def test_a_bad_or_missing_file_keeps_the_last_good_keys(tmp_path):
    path = tmp_path / "keys.json"
    write(path, {"k1": SECRET})
    errors = []
    source = KeySource(path, check_interval_s=1.0)
    assert source.keys(0.0, errors.append) == {"k1": SECRET}
    path.write_text('{"k1": "half a wri')
    assert source.keys(1.0, errors.append) == {"k1": SECRET}
    assert len(errors) == 1 and "not valid JSON" in errors[0] and "keeping the keys read before (k1)" in errors[0]
    assert source.keys(2.0, errors.append) == {"k1": SECRET} and len(errors) == 1
    path.unlink()
    assert source.keys(3.0, errors.append) == {"k1": SECRET} and "cannot be read" in errors[-1]
    path.write_bytes(b"\xff\xfe")
    assert source.keys(4.0, errors.append) == {"k1": SECRET} and "not UTF-8" in errors[-1]
    write(path, {"k3": OTHER_SECRET})
    assert source.keys(5.0, errors.append) == {"k3": OTHER_SECRET}
    assert len(errors) == 3


def test_an_emptied_keys_file_revokes_every_key(tmp_path):
    path = tmp_path / "keys.json"
    write(path, {"k1": SECRET})
    source = KeySource(path)
    assert source.keys(0.0) == {"k1": SECRET}
    path.write_text("{}")
    assert source.keys(1.0) == {}


# --- a JWKS document: an identity provider's public keys ------------------------------------


@pytest.fixture(scope="module")
def provider():
    """An identity provider's signing keys (RSA 2048 and EC P-256) and its JWKS document."""
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    document = {"keys": [jwk(rsa_key, "idp-rsa", "RS256"), jwk(ec_key, "idp-ec", "ES256")]}
    return {"RS256": ("idp-rsa", rsa_key), "ES256": ("idp-ec", ec_key), "jwks": document}


def jwk(private_key, kid, alg=None, **members) -> dict:
    """The public half of a key as a JWK, as a provider publishes it."""
    public = private_key.public_key()
    algorithm = jwt.algorithms.RSAAlgorithm if isinstance(public, rsa.RSAPublicKey) else jwt.algorithms.ECAlgorithm
    entry = algorithm.to_jwk(public, as_dict=True) | {"kid": kid, "use": "sig"} | members
    return entry | ({"alg": alg} if alg else {})


def signed(provider, algorithm, tenant="team-a", expiry_s=int(NOW) + 3600, kid=None, **claims) -> str:
    key_id, private_key = provider[algorithm]
    return jwt.encode({"sub": tenant, "exp": expiry_s, **claims}, private_key, algorithm=algorithm,
                      headers={"kid": kid or key_id})


@pytest.mark.parametrize("algorithm", ["RS256", "ES256"])
def test_a_providers_token_verifies_with_its_jwks_file(tmp_path, provider, algorithm):
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps(provider["jwks"]))
    keys = KeySource(path).keys(0.0)
    assert set(keys) == {"idp-rsa", "idp-ec"} and all(isinstance(key, PublicKey) for key in keys.values())
    issued = signed(provider, algorithm, iss="https://idp.example", aud="kit", iat=int(NOW))
    assert verify_token(issued, keys, NOW) == "team-a"
    assert resolve_tenant({"tenant-token": issued, "tenant": "team-a"}, REQUIRED, keys, NOW) == "team-a"
    # Forged, altered and expired tokens of the provider are refused as the kit's own are.
    header, _, signature = issued.split(".")
    altered = f"{header}.{b64({'sub': 'team-b', 'exp': int(NOW) + 3600})}.{signature}"
    assert failure(lambda: verify_token(altered, keys, NOW)).reason is AuthFailure.BAD_SIGNATURE
    other = {"RS256": rsa.generate_private_key(public_exponent=65537, key_size=2048),
             "ES256": ec.generate_private_key(ec.SECP256R1())}[algorithm]
    forged = jwt.encode({"sub": "team-a", "exp": int(NOW) + 3600}, other, algorithm=algorithm,
                        headers={"kid": provider[algorithm][0]})
    assert failure(lambda: verify_token(forged, keys, NOW)).reason is AuthFailure.BAD_SIGNATURE
    expired = signed(provider, algorithm, expiry_s=int(NOW) - 100)
    error = failure(lambda: verify_token(expired, keys, NOW, max_clock_skew_s=30))
    assert error.reason is AuthFailure.EXPIRED and "100 s ago" in str(error)
    assert verify_token(expired, keys, NOW, max_clock_skew_s=100) == "team-a"


def test_a_token_naming_a_kid_the_jwks_does_not_hold_is_an_unknown_key(provider):
    keys = parse_keys(json.dumps(provider["jwks"]))
    error = failure(lambda: verify_token(signed(provider, "RS256", kid="idp-rsa-2027"), keys, NOW))
    assert error.reason is AuthFailure.UNKNOWN_KEY and "'idp-rsa-2027'" in str(error)


def test_alg_none_is_refused_by_a_jwks_verifier(provider):
    keys = parse_keys(json.dumps(provider["jwks"]))
    unsigned = jwt.encode({"sub": "team-a", "exp": int(NOW) + 60}, None, algorithm="none",
                          headers={"kid": "idp-rsa"})
    error = failure(lambda: verify_token(unsigned, keys, NOW))
    assert error.reason is AuthFailure.BAD_SIGNATURE and "not signed" in str(error)


def test_an_hs256_token_signed_with_the_public_key_is_refused_by_a_jwks_verifier(provider):
    """Algorithm confusion: the public key, which anyone may read, used as an HMAC secret."""
    keys = parse_keys(json.dumps(provider["jwks"]))
    public_pem = provider["RS256"][1].public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    for secret in (public_pem, json.dumps(provider["jwks"]["keys"][0]).encode()):
        confused = hs256({"sub": "team-a", "exp": int(NOW) + 60}, key_id="idp-rsa", secret=secret)
        error = failure(lambda confused=confused: verify_token(confused, keys, NOW))
        assert error.reason is AuthFailure.BAD_SIGNATURE and "verifies RS256 only" in str(error)
    # Nor does a kid pick an algorithm for the other key type, or a provider's key for the kit's.
    wrong_kind = signed(provider, "ES256", kid="idp-rsa")
    assert "verifies RS256 only" in str(failure(lambda: verify_token(wrong_kind, keys, NOW)))
    own_kid = signed(provider, "RS256", kid="k1")
    assert "verifies HS256 only" in str(failure(lambda: verify_token(own_kid, KEYS, NOW)))


def test_a_providers_token_must_name_the_expected_issuer_and_this_kit_as_audience(provider):
    """An identity provider signs tokens for many services with the same keys: with `issuer` and
    `audience` set, only its tokens for this kit are taken."""
    keys = parse_keys(json.dumps(provider["jwks"]))
    ours = {"issuer": "https://idp.example", "audience": "triton-kit"}
    for aud in ("triton-kit", ["billing", "triton-kit"]):
        token = signed(provider, "RS256", iss="https://idp.example", aud=aud)
        assert verify_token(token, keys, NOW, **ours) == "team-a"
    cases = [
        ({"iss": "https://other.example", "aud": "triton-kit"}, AuthFailure.WRONG_ISSUER, "'https://other.example'"),
        ({"aud": "triton-kit"}, AuthFailure.WRONG_ISSUER, "issued by None"),
        ({"iss": "https://idp.example", "aud": "billing"}, AuthFailure.WRONG_AUDIENCE, "['billing']"),
        ({"iss": "https://idp.example"}, AuthFailure.WRONG_AUDIENCE, "is for [], not for 'triton-kit'"),
    ]
    for claims, reason, detail in cases:
        error = failure(lambda claims=claims: verify_token(signed(provider, "ES256", **claims), keys, NOW, **ours))
        assert error.reason is reason and detail in str(error), (claims, str(error))
    # Through the model's config, as the router resolves a request.
    config = AuthConfig(AuthMode.REQUIRED, "jwks.json", issuer="https://idp.example", audience="triton-kit")
    elsewhere = signed(provider, "RS256", iss="https://idp.example", aud="billing")
    error = failure(lambda: resolve_tenant({"tenant_token": elsewhere}, config, keys, NOW))
    assert error.reason is AuthFailure.WRONG_AUDIENCE
    # Unset, neither is checked (a provider whose tokens are for this kit alone).
    assert verify_token(elsewhere, keys, NOW) == "team-a"


def test_the_kits_own_tokens_need_no_issuer_or_audience():
    """The kit's HS256 secrets sign for this kit only: its tokens pass a config that names a provider's."""
    token = hs256({"sub": "team-a", "exp": int(NOW) + 60})
    assert verify_token(token, KEYS, NOW, issuer="https://idp.example", audience="triton-kit") == "team-a"


@pytest.mark.parametrize("claims, what", [({"iss": 7}, "issuer (iss)"), ({"aud": ["kit", 3]}, "audience (aud)"),
                                          ({"aud": {"kit": 1}}, "audience (aud)")])
def test_a_token_whose_issuer_or_audience_is_not_a_string_is_malformed(provider, claims, what):
    keys = parse_keys(json.dumps(provider["jwks"]))
    payload = json.dumps({"sub": "team-a", "exp": int(NOW) + 60, **claims}).encode()
    token = jwt.PyJWS().encode(payload, provider["RS256"][1], algorithm="RS256", headers={"kid": "idp-rsa"})
    error = failure(lambda: verify_token(token, keys, NOW))
    assert error.reason is AuthFailure.MALFORMED and what in str(error)


def test_keys_a_jwks_verifier_does_not_use_are_skipped(provider):
    rsa_key, ec_key = provider["RS256"][1], provider["ES256"][1]
    ec384 = ec.generate_private_key(ec.SECP384R1())
    document = {"keys": [
        jwk(rsa_key, "enc-1", "RSA-OAEP", use="enc"),  # the provider's encryption key
        jwk(rsa_key, "rs512", "RS512"),  # an algorithm this server does not verify with
        jwk(ec384, "p384"),  # ES384, from its curve
        {"kty": "OKP", "crv": "Ed25519", "x": "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"},  # no kid: not used
        {key: value for key, value in jwk(rsa_key, "idp-rsa").items() if key != "use"},  # RS256 from its type
        jwk(ec_key, "idp-ec", "ES256"),
    ], "issuer": "members a JWKS may carry are ignored"}
    keys = parse_keys(json.dumps(document))
    assert list(keys) == ["idp-rsa", "idp-ec"]
    assert [key.algorithm for key in keys.values()] == ["RS256", "ES256"]
    assert parse_keys('{"keys": []}') == {}  # revokes every token, as `{}` does


def broken(provider, **changes):
    entry = jwk(provider["RS256"][1], "idp-rsa", "RS256") | changes
    return json.dumps({"keys": [{key: value for key, value in entry.items() if value is not None}]})


@pytest.mark.parametrize(("document", "message"), [
    (lambda p: '{"keys": [1]}', "JWKS key #1 is not a JSON object"),
    (lambda p: json.dumps({"keys": [{"kty": "oct", "kid": "s", "k": encode_secret(SECRET)}]}),
     "JWKS key 's' is a private or symmetric key"),
    (lambda p: json.dumps({"keys": [jwt.algorithms.RSAAlgorithm.to_jwk(p["RS256"][1], as_dict=True)
                                    | {"kid": "leaked"}]}), "JWKS key 'leaked' is a private or symmetric key"),
    (lambda p: broken(p, kid=None), "JWKS key #1: a signing key needs a kid"),
    (lambda p: broken(p, kid="has space"), "a signing key needs a kid"),
    (lambda p: json.dumps({"keys": json.loads(broken(p))["keys"] * 2}), "JWKS key 'idp-rsa' appears twice"),
    (lambda p: broken(p, kty="EC"), "alg RS256 needs kty 'RSA'"),
    (lambda p: json.dumps({"keys": [jwk(ec.generate_private_key(ec.SECP384R1()), "e", "ES256")]}),
     "alg ES256 needs kty 'EC' and crv 'P-256'"),
    (lambda p: json.dumps({"keys": [jwk(rsa.generate_private_key(public_exponent=65537, key_size=1024), "w")]}),
     "the RSA key is 1024 bits; at least 2048"),
    (lambda p: broken(p, n="!!"), "JWKS key 'idp-rsa': not a valid RS256 public key"),
    (lambda p: broken(p, e=None), "not a valid RS256 public key"),
    (lambda p: broken(p, use="enc"), "none of the JWKS document's 1 keys is an RS256 or ES256 signing key"),
    (lambda p: json.dumps({"keys": json.loads(broken(p, kid=None))["keys"] * (MAX_JWKS_KEYS + 1)}),
     f"the limit is {MAX_JWKS_KEYS}"),
])
def test_a_bad_jwks_document_is_refused_naming_the_key_never_its_numbers(provider, document, message):
    text = document(provider)
    with pytest.raises(ValueError) as info:
        parse_keys(text)
    assert message in str(info.value)
    for entry in json.loads(text)["keys"]:
        for member in ("n", "d", "k", "x"):
            if isinstance(entry, dict) and isinstance(entry.get(member), str) and len(entry[member]) > 8:
                assert entry[member] not in str(info.value)


def test_the_kits_own_keys_and_a_jwks_are_told_apart_by_content(provider):
    assert is_jwks(provider["jwks"]) and not is_jwks({"keys": encode_secret(SECRET)}) and not is_jwks([])
    # A key of the kit's own file may even be called `keys`.
    assert parse_keys(json.dumps({"keys": encode_secret(SECRET)})) == {"keys": SECRET}
    assert parse_secrets(format_keys(KEYS)) == KEYS
    with pytest.raises(ValueError, match=r"is a JWKS document: .* cannot sign them"):
        parse_secrets(json.dumps(provider["jwks"]))


def test_the_key_source_follows_a_jwks_through_a_providers_rotation(tmp_path, provider):
    path = tmp_path / "jwks.json"
    rsa_entry, ec_entry = provider["jwks"]["keys"]
    path.write_text(json.dumps({"keys": [rsa_entry]}))
    errors = []
    source = KeySource(path, check_interval_s=1.0)
    rsa_token, ec_token = signed(provider, "RS256"), signed(provider, "ES256")
    assert verify_token(rsa_token, source.keys(0.0, errors.append), NOW) == "team-a"
    assert failure(lambda: verify_token(ec_token, source.keys(0.5), NOW)).reason is AuthFailure.UNKNOWN_KEY
    write_text(path, json.dumps({"keys": [rsa_entry, ec_entry]}))  # the provider publishes its next key
    keys = source.keys(1.0)
    assert verify_token(rsa_token, keys, NOW) == verify_token(ec_token, keys, NOW) == "team-a"
    assert source.keys(1.5) is keys  # parsed once per change, not per request
    write_text(path, '{"keys": [{"kty": "RSA", "kid": "half')  # caught mid-download
    assert source.keys(2.0, errors.append) is keys and "keeping the keys read before (idp-rsa, idp-ec)" in errors[-1]
    write_text(path, json.dumps({"keys": [ec_entry]}))  # and retires the old one
    assert failure(lambda: verify_token(rsa_token, source.keys(3.0), NOW)).reason is AuthFailure.UNKNOWN_KEY
    assert verify_token(ec_token, source.keys(3.0), NOW) == "team-a"


def write_text(path, text):
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(text)
    os.replace(staging, path)


# --- who a request is from -------------------------------------------------------------------

ANONYMOUS = AuthConfig(AuthMode.ANONYMOUS, "keys.json")
REQUIRED = AuthConfig(AuthMode.REQUIRED, "keys.json")


def test_with_authentication_off_the_tenant_parameter_is_trusted():
    assert resolve_tenant({"tenant": "team-a"}, AUTH_OFF, {}, NOW) == "team-a"
    assert resolve_tenant({}, AUTH_OFF, {}, NOW) == "default"
    assert resolve_tenant({"tenant_token": "garbage"}, AUTH_OFF, {}, NOW) == "default"


@pytest.mark.parametrize("config", [ANONYMOUS, REQUIRED])
@pytest.mark.parametrize("params", [
    {"tenant_token": VALID},
    {"tenant-token": VALID},  # the header, forwarded as a parameter
    {"Tenant-Token": VALID},  # HTTP header names arrive as the client spelled them
    {"tenant_token": VALID, "tenant-token": VALID},  # the same token twice
    {"tenant_token": VALID, "tenant": "team-a"},  # a claim the token proves
    {"tenant_token": VALID, "TENANT": "team-a"},
])
def test_a_valid_token_names_the_tenant(config, params):
    assert resolve_tenant(params, config, KEYS, NOW) == "team-a"


def test_without_a_token_a_request_is_anonymous_or_refused_per_the_mode():
    assert resolve_tenant({}, ANONYMOUS, KEYS, NOW) == ANONYMOUS_TENANT
    assert resolve_tenant({"truncate": "false"}, ANONYMOUS, {}, NOW) == ANONYMOUS_TENANT
    error = failure(lambda: resolve_tenant({}, REQUIRED, KEYS, NOW))
    assert error.reason is AuthFailure.MISSING and "'tenant_token'" in str(error) and "'tenant-token'" in str(error)
    assert failure(lambda: resolve_tenant({"tenant": "team-a"}, REQUIRED, KEYS, NOW)).reason is AuthFailure.MISSING


def test_a_bare_tenant_claim_is_never_trusted_when_authentication_is_on():
    error = failure(lambda: resolve_tenant({"tenant": "search-frontend"}, ANONYMOUS, KEYS, NOW))
    assert error.reason is AuthFailure.UNVERIFIED_CLAIM and "'search-frontend'" in str(error)


def test_a_claim_naming_another_tenant_than_the_token_is_refused():
    error = failure(lambda: resolve_tenant({"tenant_token": VALID, "tenant": "team-b"}, ANONYMOUS, KEYS, NOW))
    assert error.reason is AuthFailure.TENANT_MISMATCH and "'team-b'" in str(error) and "'team-a'" in str(error)


@pytest.mark.parametrize("claim", ["has space", "team-a\n", ""])
def test_a_claim_that_is_not_a_tenant_id_is_a_bad_request_before_anything_else(claim):
    for config in (AUTH_OFF, ANONYMOUS, REQUIRED):
        with pytest.raises(ValueError, match="parameter 'tenant'"):
            resolve_tenant({"tenant": claim, "tenant_token": VALID}, config, KEYS, NOW)


@pytest.mark.parametrize(("params", "reason"), [
    ({"tenant_token": "v1.team-a"}, AuthFailure.MALFORMED),
    ({"tenant_token": 7}, AuthFailure.MALFORMED),
    ({"tenant_token": ""}, AuthFailure.MALFORMED),
    ({"tenant_token": VALID, "tenant-token": token("team-b")}, AuthFailure.MALFORMED),
    ({"tenant_token": token(key_id="k9")}, AuthFailure.UNKNOWN_KEY),
    ({"tenant_token": token(secret=OTHER_SECRET)}, AuthFailure.BAD_SIGNATURE),
    ({"tenant_token": token(expiry_s=int(NOW) - 3600)}, AuthFailure.EXPIRED),
])
@pytest.mark.parametrize("config", [ANONYMOUS, REQUIRED])
def test_a_bad_token_is_refused_in_every_mode_that_checks(config, params, reason):
    assert failure(lambda: resolve_tenant(params, config, KEYS, NOW)).reason is reason


def test_two_tokens_in_one_request_are_malformed():
    with pytest.raises(AuthError, match="2 different tenant tokens"):
        find_token({"tenant_token": "a", "tenant-token": "b"})
    assert find_token({"tenant": "x"}) is None


def test_the_skew_allowance_of_the_config_applies():
    config = AuthConfig(AuthMode.REQUIRED, "keys.json", max_clock_skew_s=60)
    assert resolve_tenant({"tenant_token": token(expiry_s=int(NOW) - 30)}, config, KEYS, NOW) == "team-a"


# --- the config parameter --------------------------------------------------------------------


def test_the_auth_config_round_trips_through_its_parameter():
    config = AuthConfig(AuthMode.ANONYMOUS, "build/tenant_keys.json", 15.0)
    assert AuthConfig.from_json(config.to_json()) == config
    # issuer and audience travel when set, and are absent from the parameter when not
    assert "issuer" not in config.to_json() and "audience" not in config.to_json()
    provider = AuthConfig(AuthMode.REQUIRED, "jwks.json", issuer="https://idp.example", audience="triton-kit")
    assert AuthConfig.from_json(provider.to_json()) == provider
    assert parse_auth_parameter("embed", config.to_json()) == config
    assert parse_auth_parameter("embed", "") == AUTH_OFF


def test_a_relative_keys_file_is_found_from_the_kit_root_and_an_absolute_one_as_written():
    assert AuthConfig(AuthMode.REQUIRED, "build/k.json").keys_path() == KIT_ROOT / "build/k.json"
    assert (KIT_ROOT / "python_backends" / "common" / "tenant_auth.py").is_file()
    assert AuthConfig(AuthMode.REQUIRED, "/etc/kit/k.json").keys_path() == Path("/etc/kit/k.json")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "sometimes"}, "auth mode 'sometimes'"),
    ({"mode": AuthMode.REQUIRED}, "needs a keys_file"),
    ({"mode": AuthMode.ANONYMOUS, "keys_file": "k.json", "max_clock_skew_s": -1}, "max_clock_skew_s"),
    ({"mode": AuthMode.ANONYMOUS, "keys_file": "k.json", "max_clock_skew_s": 301}, "max_clock_skew_s"),
])
def test_an_auth_config_out_of_bounds_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AuthConfig(**kwargs)


@pytest.mark.parametrize("raw", ["{", "[]", '{"mode": "sometimes"}', '{"keys_file": "k"}',
                                 '{"mode": "required"}', '{"mode": "off", "max_clock_skew_s": "x"}'])
def test_a_bad_auth_parameter_names_the_model(raw):
    with pytest.raises(ValueError, match="model 'embed': parameter tenant_auth"):
        parse_auth_parameter("embed", raw)
