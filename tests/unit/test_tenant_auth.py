"""Tenant tokens, the keys file and its reloader, and who a request is served as."""

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from python_backends.common.tenant_auth import (
    ANONYMOUS_TENANT,
    AUTH_FAILED,
    AUTH_OFF,
    KIT_ROOT,
    MAX_KEYS,
    MAX_TOKEN_LEN,
    AuthConfig,
    AuthError,
    AuthFailure,
    AuthMode,
    KeySource,
    decode_secret,
    encode_secret,
    find_token,
    format_keys,
    issue_token,
    parse_auth_parameter,
    parse_keys,
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


def failure(call) -> AuthError:
    with pytest.raises(AuthError) as info:
        call()
    assert str(info.value).startswith(AUTH_FAILED)
    return info.value


# --- tokens ----------------------------------------------------------------------------------


def test_a_token_names_its_tenant_expiry_and_key_and_verifies():
    issued = token()
    assert issued.startswith(f"v1.team-a.{int(NOW) + 3600}.k1.")
    assert len(issued.rsplit(".", 1)[1]) == 43
    assert verify_token(issued, KEYS, NOW) == "team-a"


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


@pytest.mark.parametrize("field", ["tenant", "expiry"])
def test_changing_a_signed_field_breaks_the_signature(field):
    issued = token()
    head, expiry, key_id, signature = issued.rsplit(".", 3)
    altered = (f"v1.team-b.{expiry}.{key_id}.{signature}" if field == "tenant"
               else f"{head}.{int(expiry) + 86400}.{key_id}.{signature}")
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


def test_the_clock_skew_allowance_takes_a_token_just_past_its_expiry():
    expiry = int(NOW)
    assert verify_token(token(expiry_s=expiry), KEYS, NOW) == "team-a"  # valid up to its expiry second
    assert verify_token(token(expiry_s=expiry), KEYS, NOW + 30, max_clock_skew_s=30) == "team-a"
    assert failure(lambda: verify_token(token(expiry_s=expiry), KEYS, NOW + 30.5,
                                        max_clock_skew_s=30)).reason is AuthFailure.EXPIRED
    assert failure(lambda: verify_token(token(expiry_s=expiry), KEYS, NOW + 1)).reason is AuthFailure.EXPIRED


VALID = token()
HEAD, EXPIRY, KEY_ID, SIGNATURE = VALID.rsplit(".", 3)


@pytest.mark.parametrize(("bad", "what"), [
    (None, "not a string"),
    (42, "not a string"),
    ("", "too few fields"),
    ("x" * (MAX_TOKEN_LEN + 1), f"the limit is {MAX_TOKEN_LEN}"),
    (VALID.replace("team-a", "téam-a"), "non-ASCII"),
    (VALID.replace("v1.", "v2.", 1), "does not start with 'v1.'"),
    (VALID[3:], "does not start with 'v1.'"),
    (f"{HEAD}.{KEY_ID}.{SIGNATURE}", "does not start with 'v1.'"),
    (f"v1..{EXPIRY}.{KEY_ID}.{SIGNATURE}", "tenant field"),
    (f"v1.has space.{EXPIRY}.{KEY_ID}.{SIGNATURE}", "tenant field"),
    (f"v1.{'x' * 65}.{EXPIRY}.{KEY_ID}.{SIGNATURE}", "tenant field"),
    (f"{HEAD}.0{EXPIRY}.{KEY_ID}.{SIGNATURE}", "expiry field"),
    (f"{HEAD}.-{EXPIRY}.{KEY_ID}.{SIGNATURE}", "expiry field"),
    (f"{HEAD}.1e9.{KEY_ID}.{SIGNATURE}", "expiry field"),
    (f"{HEAD}.{'9' * 13}.{KEY_ID}.{SIGNATURE}", "expiry field"),
    (f"{HEAD}.{EXPIRY}..{SIGNATURE}", "key id field"),
    (f"{HEAD}.{EXPIRY}.k:1.{SIGNATURE}", "key id field"),
    (f"{HEAD}.{EXPIRY}.{KEY_ID}.{SIGNATURE[:-1]}", "signature field"),
    (f"{HEAD}.{EXPIRY}.{KEY_ID}.{SIGNATURE}=", "signature field"),
    (f"{HEAD}.{EXPIRY}.{KEY_ID}.{SIGNATURE[:-1]}+", "signature field"),
    # A trailing newline on any field would make a second spelling of a valid token.
    (f"{HEAD}\n.{EXPIRY}.{KEY_ID}.{SIGNATURE}", "tenant field"),
    (f"{HEAD}.{EXPIRY}\n.{KEY_ID}.{SIGNATURE}", "expiry field"),
    (f"{HEAD}.{EXPIRY}.{KEY_ID}\n.{SIGNATURE}", "key id field"),
    (f"{VALID}\n", "signature field"),
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
