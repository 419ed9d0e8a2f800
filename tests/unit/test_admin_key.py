"""The admin key: where serve and the tools find it, what a usable key is, and the server flags it sets."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tools.cli.serve import server_admin_key
from tools.server.admin_key import (
    ADMIN_HEADER,
    ADMIN_KEY_ENV,
    GRPC_ADMIN_METADATA,
    AdminKeyError,
    admin_headers,
    check_key,
    find_admin_key,
    grpc_admin_metadata,
    read_key_file,
    restricted_api_args,
    write_new_key,
)
from tools.server.triton_server import ModelControlMode, ServerConfig, TritonDistribution, build_command

REPO = Path(__file__).resolve().parents[2]
KEY = "a" * 20 + "-_.~+/" + "Z9" * 4
FAKE = TritonDistribution(binary=Path("/t/bin/tritonserver"), libs_dir=Path("/t/libs"),
                          backends_dir=Path("/t/backends"), stub=Path("/t/stub"))


def test_a_usable_key_is_long_and_free_of_what_the_server_command_line_splits_on():
    assert check_key(KEY, "test") == KEY
    with pytest.raises(AdminKeyError, match="from test has 5 characters; it needs at least 24"):
        check_key("short", "test")
    for bad in (KEY + ":x", KEY + "=x", KEY + ",x", KEY + " x", KEY + "é"):
        with pytest.raises(AdminKeyError, match="may only hold"):
            check_key(bad, "test")


def test_errors_name_the_source_never_the_key(tmp_path):
    bad = tmp_path / "admin.key"
    bad.write_text("x" * 30 + ":secretpart\n")
    with pytest.raises(AdminKeyError) as error:
        read_key_file(bad)
    assert str(bad) in str(error.value) and "secretpart" not in str(error.value)


def test_the_key_file_wins_over_the_environment_which_wins_over_the_default_file(tmp_path):
    given, default = tmp_path / "given.key", tmp_path / "default.key"
    given.write_text("g" * 30 + "\n")
    default.write_text("d" * 30)
    env = {ADMIN_KEY_ENV: "e" * 30}
    assert find_admin_key(given, env, default) == "g" * 30  # surrounding whitespace ignored
    assert find_admin_key(None, env, default) == "e" * 30
    assert find_admin_key(None, {}, default) == "d" * 30
    assert find_admin_key(None, {}, tmp_path / "absent.key") is None
    assert find_admin_key(None, {}, None) is None


def test_a_given_source_that_is_unusable_is_an_error_not_skipped(tmp_path):
    with pytest.raises(AdminKeyError, match="does not exist"):
        find_admin_key(tmp_path / "absent.key", {ADMIN_KEY_ENV: KEY})
    with pytest.raises(AdminKeyError, match=f"from \\${ADMIN_KEY_ENV} has 3 characters"):
        find_admin_key(None, {ADMIN_KEY_ENV: "abc"}, None)


def test_serve_refuses_explicit_mode_without_a_key_and_allows_the_others():
    with pytest.raises(AdminKeyError, match="explicit model control needs an admin key"):
        server_admin_key(None, ModelControlMode.EXPLICIT, {})
    assert server_admin_key(None, ModelControlMode.NONE, {}) is None
    assert server_admin_key(None, ModelControlMode.EXPLICIT, {ADMIN_KEY_ENV: KEY}) == KEY


def test_the_server_restricts_the_control_apis_on_both_protocols_and_leaves_the_rest_open():
    http_flag, grpc_flag = restricted_api_args(KEY)
    assert http_flag == f"--http-restricted-api=model-repository,shared-memory,trace,logging:{ADMIN_HEADER}={KEY}"
    assert grpc_flag == f"--grpc-restricted-protocol=model-repository,shared-memory,trace,logging:{ADMIN_HEADER}={KEY}"
    for open_api in ("inference", "health", "metadata", "statistics", "model-config"):
        assert open_api not in http_flag
    command = build_command(ServerConfig(admin_key=KEY), FAKE, Path("/b"))
    assert http_flag in command and grpc_flag in command
    assert not any("restricted" in part for part in build_command(ServerConfig(), FAKE, Path("/b")))
    assert KEY not in repr(ServerConfig(admin_key=KEY))  # configs get printed; the key must not be


def test_clients_send_the_key_under_each_protocols_name():
    assert admin_headers(KEY) == {ADMIN_HEADER: KEY} and admin_headers(None) == {}
    assert grpc_admin_metadata(KEY) == {GRPC_ADMIN_METADATA: KEY} and grpc_admin_metadata(None) == {}
    assert GRPC_ADMIN_METADATA == "triton-grpc-protocol-triton-admin-key"


def test_a_new_key_is_random_usable_and_readable_by_its_owner_only(tmp_path):
    path = tmp_path / "keys" / "admin.key"
    write_new_key(path)
    first = read_key_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    write_new_key(path)
    assert read_key_file(path) != first and stat.S_IMODE(path.stat().st_mode) == 0o600


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools", "admin-key", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_the_cli_makes_keeps_and_checks_keys(tmp_path):
    path = tmp_path / "admin.key"
    assert run_cli("check", str(path)).returncode == 2
    made = run_cli("new", "--keep", str(path))
    assert made.returncode == 0 and "wrote a new admin key" in made.stdout and KEY not in made.stdout
    key = path.read_text()
    assert run_cli("new", "--keep", str(path)).returncode == 0 and path.read_text() == key
    assert run_cli("check", str(path)).returncode == 0
    path.write_text("short")
    kept = run_cli("new", "--keep", str(path))
    assert kept.returncode == 2 and "it needs at least 24" in kept.stderr
