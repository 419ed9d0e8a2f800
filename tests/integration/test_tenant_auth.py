"""Authenticated tenants against the real tritonserver.

One server for the module, on its own model repository: the bucket models (version 1, one
instance each) and three routers, `embed` requiring a tenant token and `embed_open` serving
requests without one as the tenant `anonymous`, both verifying the kit's own HS256 tokens with
a keys file of this test, which it rotates while the server runs; and `embed_idp`, requiring
a token an identity provider signed (RS256, ES256), verified with the provider's JWKS document.
The `batch` tier is cut to a burst of 3 requests, so a tenant's quota runs out within the test.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jwt
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from python_backends.common.quotas import TenantPolicy, TierPolicy
from python_backends.common.shared_files import server_run, shared_dir, shared_file_name
from python_backends.common.tenant_auth import (
    MAX_TOKEN_LEN,
    AuthConfig,
    AuthMode,
    encode_secret,
    parse_keys,
    parse_token,
    verify_token,
)
from python_backends.embed.admission import SharedWork
from tests.doc_examples import run_shown, shown
from tests.integration.helpers import ROUTER_COUNTERS_LAG_S, settled
from tools.clients.tenant_token import add_key, drop_key, issue
from tools.server.triton_server import ServerConfig, TritonServer, free_port
from tools.spec.serving import load_spec

from .conftest import EXIT_TIMEOUT_S, LOG_DIR, REPO

REQUIRED, OPEN, IDP = "embed", "embed_open", "embed_idp"
BURST = 3  # requests a tenant of the `batch` tier may send at once here
QUOTA_TENANTS = ("team-a", "team-b")  # in the batch tier


def write_config(folder: Path, config: mc.ModelConfig) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(text_format.MessageToString(config))


def read_config(model: str) -> mc.ModelConfig:
    return text_format.Parse((REPO / "model_repository" / model / "config.pbtxt").read_text(), mc.ModelConfig())


def tenants_json() -> str:
    policy = load_spec(REPO / "serving.toml").tenant_policy()
    tiers = dict(policy.tiers)
    tiers["batch"] = TierPolicy("batch", tiers["batch"].priority, requests_per_s=0.05, burst=BURST)
    members = {tenant: "batch" for tenant in QUOTA_TENANTS} | {"anonymous": "batch"}
    return TenantPolicy(tiers=tiers, default_tier=policy.default_tier, members=members).to_json()


def build_repository(root: Path, keys_file: Path, jwks_file: Path) -> Path:
    """Bucket models (version 1, one instance) and the three routers, sharing the built model files."""
    repository = root / "repository"
    for bucket in (16, 32, 64, 128, 256):
        name = f"encoder_{bucket}"
        config = read_config(name)
        del config.version_policy.specific.versions[:]
        config.version_policy.specific.versions.append(1)
        config.instance_group[0].count = 1
        write_config(repository / name, config)
        (repository / name / "1").symlink_to(REPO / "model_repository" / name / "1")
    for name, mode, keys in ((REQUIRED, AuthMode.REQUIRED, keys_file), (OPEN, AuthMode.ANONYMOUS, keys_file),
                             (IDP, AuthMode.REQUIRED, jwks_file)):
        config = read_config("embed")
        config.name = name
        config.instance_group[0].count = 2 if keys is keys_file else 1  # two processes, each reading the file
        config.parameters["tenant_auth"].string_value = AuthConfig(mode, str(keys), 30.0).to_json()
        config.parameters["tenants"].string_value = tenants_json()
        write_config(repository / name, config)
        (repository / name / "1").symlink_to(REPO / "model_repository" / "embed" / "1")
    return repository


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tenant-keys") / "tenant_keys.json"
    add_key(path, "k1")
    return path


@pytest.fixture(scope="module")
def provider(tmp_path_factory) -> dict:
    """An identity provider's signing keys, and its JWKS document as the `embed_idp` keys file."""
    keys = {"idp-rsa": ("RS256", rsa.generate_private_key(public_exponent=65537, key_size=2048)),
            "idp-ec": ("ES256", ec.generate_private_key(ec.SECP256R1()))}
    document = {"keys": [jwt.get_algorithm_by_name(alg).to_jwk(key.public_key(), as_dict=True)
                         | {"kid": kid, "alg": alg, "use": "sig"} for kid, (alg, key) in keys.items()]}
    path = tmp_path_factory.mktemp("idp") / "jwks.json"
    path.write_text(json.dumps(document))
    return {"jwks_file": path, "keys": keys}


@pytest.fixture(scope="module")
def dead_run_files() -> list[Path]:
    """The admission and quota files a server killed with work in flight leaves behind."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    run = server_run(child.pid)
    child.communicate(b"")  # its server run is over now
    directory = shared_dir()
    SharedWork(directory / shared_file_name(run, REQUIRED, "work"), 5).add(158.0)  # left open, as a kill leaves it
    quotas = directory / shared_file_name(run, REQUIRED, "quotas")
    quotas.write_bytes(b"\xff" * 64)
    return [directory / shared_file_name(run, REQUIRED, "work"), quotas]


@pytest.fixture(scope="module")
def server(tmp_path_factory, keys_file, provider, dead_run_files):
    repository = build_repository(tmp_path_factory.mktemp("auth-repo"), keys_file, provider["jwks_file"])
    config = ServerConfig(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), host="127.0.0.1",
                          exit_timeout_s=EXIT_TIMEOUT_S)
    with TritonServer(config, log_path=LOG_DIR / "tenant-auth.log") as triton:
        yield triton


@pytest.fixture(scope="module")
def http(server):
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    yield client
    client.close()


def text_input(module, text: str = "hello there"):
    tensor = module.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
    return tensor


def embed(http, model: str, parameters: dict | None = None, headers: dict | None = None):
    return http.infer(model, [text_input(httpclient)], parameters=parameters, headers=headers)


def refused(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


def token(keys_file: Path, tenant: str, ttl_s: float = 600, key_id: str | None = None, now_s: float | None = None):
    return issue(keys_file, tenant, ttl_s, key_id, now_s)[0]


def b64(value) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()


def with_claims(genuine: str, **changes) -> str:
    """A genuine token's header and signature around claims changed by hand."""
    header, _, signature = genuine.split(".")
    return f"{header}.{b64(jwt.decode(genuine, options={'verify_signature': False}) | changes)}.{signature}"


def kid(token_text: str) -> str:
    return jwt.get_unverified_header(token_text)["kid"]


def metric(server, name: str, **labels) -> float:
    text = requests.get(server.metrics_url, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and labels.items() <= dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))).items():
            total += float(match.group(2))
    return total


def encoder_requests(server) -> float:
    """Requests the bucket models have taken, served or failed."""
    return sum(metric(server, name, model=f"encoder_{bucket}")
               for name in ("nv_inference_request_success", "nv_inference_request_failure")
               for bucket in (16, 32, 64, 128, 256))


def test_the_routers_share_files_of_this_server_run_and_sweep_a_dead_runs(server, dead_run_files):
    """A dead server's files (here with 158 ms of work in flight) are removed, not inherited.

    Files named by process id alone were taken over by a later server that got the same id,
    which then refused every request as busy with its predecessor's work.
    """
    assert not any(path.exists() for path in dead_run_files)
    run = server_run(server.process.pid)
    for model in (REQUIRED, OPEN):
        for kind in ("work", "quotas"):
            assert (shared_dir() / shared_file_name(run, model, kind)).exists(), (model, kind)
    ahead = SharedWork(shared_dir() / shared_file_name(run, REQUIRED, "work"), 63)
    try:
        assert ahead.total_ms() == 0.0  # idle: nothing inherited
    finally:
        ahead.close()


def test_a_valid_token_is_served_under_its_own_tenants_quota(server, http, keys_file):
    a, b = token(keys_file, "team-a"), token(keys_file, "team-b")
    for _ in range(BURST):
        assert embed(http, REQUIRED, {"tenant_token": a}).as_numpy("EMBEDDING").shape == (1, 384)
    over = refused(lambda: embed(http, REQUIRED, {"tenant_token": a}))
    assert over.status() == "503" and "tenant 'team-a' is over its quota" in over.message(), over.message()
    # Team B is in the same tier with a bucket of its own: A's flood took nothing from it.
    assert embed(http, REQUIRED, {"tenant_token": b}).as_numpy("EMBEDDING").shape == (1, 384)
    assert settled(lambda: metric(server, "embed_tenant_requests_total", model=REQUIRED, tenant="team-a",
                                  outcome="over_quota"), lambda n: n >= 1) >= 1


@pytest.mark.parametrize("model", [REQUIRED, OPEN])
def test_forged_expired_and_malformed_tokens_are_refused_before_any_model_runs(server, http, keys_file, model):
    valid = token(keys_file, "team-c")  # standard tier: no quota runs out here
    header, claims, _ = valid.split(".")
    expiry = jwt.decode(valid, options={"verify_signature": False})["exp"]
    cases = {
        # A signature made without the key: what someone guessing at team-c's token sends.
        "forged": (f"{header}.{claims}.{'A' * 43}", "signature does not match"),
        # A genuine token whose expiry was pushed out by hand.
        "altered": (with_claims(valid, exp=expiry + 86400), "signature does not match"),
        "expired": (token(keys_file, "team-c", ttl_s=60, now_s=time.time() - 3600), "expired"),
        "unknown key": (f"{b64({'alg': 'HS256', 'kid': 'k9'})}.{claims}.{'A' * 43}",
                        "key 'k9', which this server does not hold"),
        "unsigned": (f"{b64({'alg': 'none', 'kid': kid(valid)})}.{claims}.", "not signed"),
        "malformed": ("not-a-token", "malformed"),
        "too long": ("x" * (MAX_TOKEN_LEN + 1), f"the limit is {MAX_TOKEN_LEN}"),
    }
    before_encoders = encoder_requests(server)
    time.sleep(ROUTER_COUNTERS_LAG_S)  # earlier tests' refusals reach the counter first
    before_refused = metric(server, "embed_tenant_requests_total", model=model, outcome="unauthenticated")
    for name, (bad, reason) in cases.items():
        error = refused(lambda bad=bad: embed(http, model, {"tenant_token": bad}))
        assert error.status() == "400", (name, error.status(), error.message())
        assert error.message().startswith("authentication failed: ") and reason in error.message(), (name, error)
        assert bad not in error.message()  # a token is never echoed
    # The same over gRPC, with the token as metadata (Triton forwards the `tenant-token` header).
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        error = refused(lambda: client.infer(model, [text_input(grpcclient)],
                                             headers={"tenant-token": cases["forged"][0]}))
        assert error.status() == "StatusCode.INVALID_ARGUMENT" and "signature does not match" in error.message()
        assert client.infer(model, [text_input(grpcclient)], headers={"tenant-token": valid}).as_numpy(
            "EMBEDDING").shape == (1, 384)
    finally:
        client.close()
    # None of them reached a bucket model, each was counted, and the server serves on.
    assert encoder_requests(server) - before_encoders == 1  # the valid gRPC request only
    refusals = settled(lambda: metric(server, "embed_tenant_requests_total", model=model, outcome="unauthenticated"),
                       lambda n: n - before_refused >= len(cases) + 1)
    assert refusals - before_refused == len(cases) + 1
    assert settled(lambda: metric(server, "embed_auth_failures_total", model=model, reason="bad_signature"),
                   lambda n: n >= 4) >= 4
    assert settled(lambda: metric(server, "embed_auth_failures_total", model=model, reason="expired"),
                   lambda n: n >= 1) >= 1
    assert embed(http, model, {"tenant_token": valid}).as_numpy("EMBEDDING").shape == (1, 384)
    assert server.is_ready()


def test_forged_tokens_do_not_spend_the_named_tenants_quota(http, keys_file):
    # team-b has not called `embed_open` yet: a forged flood in its name must leave its whole burst.
    valid = token(keys_file, "team-b")
    header, claims, _ = valid.split(".")
    for _ in range(10):
        refused(lambda: embed(http, OPEN, {"tenant_token": f"{header}.{claims}.{'B' * 43}"}))
    for _ in range(BURST):
        assert embed(http, OPEN, {"tenant_token": valid}).as_numpy("EMBEDDING").shape == (1, 384)


def test_a_missing_token_is_refused_in_required_mode_and_anonymous_in_anonymous_mode(server, http):
    missing = refused(lambda: embed(http, REQUIRED))
    assert missing.status() == "400" and "this model requires a tenant token" in missing.message()
    # Anonymous mode: served as the one tenant `anonymous`, in the lowest tier (the burst here is 3).
    results = []
    for _ in range(BURST + 1):
        try:
            results.append(embed(http, OPEN).as_numpy("EMBEDDING").shape)
        except InferenceServerException as err:
            results.append(err.message())
    assert results[:BURST] == [(1, 384)] * BURST
    assert "tenant 'anonymous' is over its quota" in results[BURST]
    assert settled(lambda: metric(server, "embed_tenant_requests_total", model=OPEN, tenant="anonymous", tier="batch",
                                  outcome="ok"), lambda n: n >= BURST) == BURST


@pytest.mark.parametrize("model", [REQUIRED, OPEN])
def test_a_bare_tenant_claim_is_not_trusted(http, keys_file, model):
    claim = refused(lambda: embed(http, model, {"tenant": "search-frontend"}))
    assert claim.status() == "400" and claim.message().startswith("authentication failed: ")
    # A token naming another tenant than the claim beside it is refused too.
    mismatch = refused(lambda: embed(http, model, {"tenant_token": token(keys_file, "team-b"), "tenant": "team-a"}))
    assert mismatch.status() == "400" and "the tenant token is for 'team-b'" in mismatch.message()


def test_the_header_carries_the_token_over_http_json(server, keys_file):
    body = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["hello"]}]}
    for spelling in ("tenant-token", "Tenant-Token"):
        request = urllib.request.Request(
            f"http://{server.http_url}/v2/models/{REQUIRED}/infer", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", spelling: token(keys_file, "team-c")})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200


def accepted(http, tenant_token: str) -> bool:
    try:
        embed(http, REQUIRED, {"tenant_token": tenant_token})
        return True
    except InferenceServerException as err:
        assert err.status() == "400" and "authentication failed" in err.message(), err.message()
        return False


def seconds_until(condition, timeout_s: float = 5.0) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - start


def test_keys_rotate_while_the_server_runs(http, keys_file):
    old = token(keys_file, "team-c", key_id="k1")
    add_key(keys_file, "k2")
    new = token(keys_file, "team-c")  # the newest key signs by default
    assert kid(new) == "k2"
    # Each router instance re-reads the file within a second of its next request.
    assert seconds_until(lambda: accepted(http, new)) < 3.0
    time.sleep(1.2)  # by now every instance has looked again
    assert all(accepted(http, new) and accepted(http, old) for _ in range(6))  # both keys valid at once

    # A keys file caught half-written keeps the keys that were good.
    keys_text = keys_file.read_text()
    keys_file.write_text(keys_text[: len(keys_text) // 2])
    time.sleep(1.2)
    assert all(accepted(http, new) and accepted(http, old) for _ in range(4))
    keys_file.write_text(keys_text)

    drop_key(keys_file, "k1")
    assert seconds_until(lambda: not accepted(http, old)) < 3.0
    time.sleep(1.2)
    assert not any(accepted(http, old) for _ in range(6))
    assert all(accepted(http, new) for _ in range(6))


def test_a_providers_tokens_are_verified_with_its_jwks_and_the_kits_own_are_refused(server, http, keys_file,
                                                                                   provider):
    """`embed_idp` holds only the provider's public keys: its RS256 and ES256 tokens are served;
    a token the kit signed, an HS256 token made with the provider's public key as the secret
    (algorithm confusion) and a token signed by another key under the provider's kid are not."""
    now = int(time.time())
    for key_id, (algorithm, private_key) in provider["keys"].items():
        issued = jwt.encode({"sub": "team-c", "exp": now + 600, "iss": "https://idp.example"}, private_key,
                            algorithm=algorithm, headers={"kid": key_id})
        assert embed(http, IDP, {"tenant_token": issued}).as_numpy("EMBEDDING").shape == (1, 384), algorithm
        assert embed(http, IDP, headers={"tenant-token": issued}).as_numpy("EMBEDDING").shape == (1, 384)
    # PyJWT will not take a public key as an HMAC secret, so this forgery is signed by hand.
    signing_input = f"{b64({'alg': 'HS256', 'kid': 'idp-rsa'})}.{b64({'sub': 'team-c', 'exp': now + 600})}"
    public_key = provider["jwks_file"].read_bytes()
    mac = hmac.new(public_key, signing_input.encode(), hashlib.sha256).digest()
    confused = f"{signing_input}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"
    impostor = jwt.encode({"sub": "team-c", "exp": now + 600}, ec.generate_private_key(ec.SECP256R1()),
                          algorithm="ES256", headers={"kid": "idp-ec"})
    cases = {"the kit's own": (token(keys_file, "team-c"), "key 'k"),
             "confused": (confused, "verifies RS256 only"),
             "impostor": (impostor, "signature does not match")}
    for name, (bad, reason) in cases.items():
        error = refused(lambda bad=bad: embed(http, IDP, {"tenant_token": bad}))
        assert error.status() == "400" and error.message().startswith("authentication failed: "), (name, error)
        assert reason in error.message(), (name, error.message())
    assert settled(lambda: metric(server, "embed_auth_failures_total", model=IDP, reason="bad_signature"),
                   lambda n: n >= 2) == 2
    assert settled(lambda: metric(server, "embed_auth_failures_total", model=IDP, reason="unknown_key"),
                   lambda n: n >= 1) == 1


def test_the_server_log_holds_no_request_text_token_or_secret(server, http, keys_file):
    canary = f"payload canary {time.time_ns()}"
    valid = token(keys_file, "team-c")
    forged = valid[:-43] + "C" * 43
    http.infer(REQUIRED, [text_input(httpclient, canary)], parameters={"tenant_token": valid})
    for parameters in ({"tenant_token": forged}, {}, {"tenant": "team-c"}):
        refused(lambda parameters=parameters: http.infer(REQUIRED, [text_input(httpclient, canary)],
                                                         parameters=parameters))
    time.sleep(0.5)
    log = (LOG_DIR / "tenant-auth.log").read_text(errors="replace")
    assert "GRPCInferenceService" in log  # the server's own log, at its default verbosity
    assert canary not in log and valid not in log and forged not in log and valid.rsplit(".", 1)[1] not in log
    for secret in parse_keys(keys_file.read_text()).values():
        assert encode_secret(secret) not in log


def test_the_shown_tenant_token_commands_make_a_key_sign_a_token_and_list_the_keys(tmp_path):
    """docs/security.md's `tenant-token` commands as written, in a scratch folder: `--keys` puts
    the keys file there, away from the one the checkout's servers read."""
    def run(command: str) -> subprocess.CompletedProcess:
        result = run_shown(command, tmp_path, timeout_s=60)
        assert result.returncode == 0, f"`{command}` exited {result.returncode}: {result.stderr}"
        return result

    keys_path = tmp_path / "build" / "tenant_keys.json"
    made = run(shown("docs/security.md",
                     "python -m tools tenant-token --new-key 2026-07 --keys build/tenant_keys.json"))
    assert made.stderr.startswith("added key '2026-07' to build/tenant_keys.json (1 key)"), made.stderr
    assert stat.S_IMODE(keys_path.stat().st_mode) == 0o600
    keys = parse_keys(keys_path.read_text())
    assert list(keys) == ["2026-07"]

    issued = run(shown("docs/security.md",
                       "python -m tools tenant-token team-a --ttl 1h --keys build/tenant_keys.json"))
    token = issued.stdout.strip()
    assert issued.stdout == token + "\n" and re.fullmatch(r"tenant 'team-a', key '2026-07', valid until "
                                                          r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ; .*\n", issued.stderr)
    assert verify_token(token, keys, time.time()) == "team-a"  # what the router checks
    assert 3590 <= parse_token(token).expiry_s - time.time() <= 3600

    listed = run(shown("docs/security.md", "python -m tools tenant-token --list-keys --keys build/tenant_keys.json"))
    assert listed.stdout == "2026-07   (newest: signs new tokens)\n", listed.stdout
    assert keys_path.read_text().count(encode_secret(keys["2026-07"])) == 1 and encode_secret(
        keys["2026-07"]) not in listed.stdout + listed.stderr + issued.stderr + made.stderr
