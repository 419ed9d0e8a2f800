"""Command line, environment and start-up checks of the tritonserver launcher."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tools.server.triton_server import (
    ModelControlMode,
    ServerConfig,
    ServerError,
    TritonDistribution,
    TritonServer,
    build_command,
    build_env,
    busy_ports,
    find_distribution,
    free_port,
    model_names,
)

REPO = Path(__file__).resolve().parents[2]
FAKE = TritonDistribution(Path("/d/bin/tritonserver"), Path("/d/libs"), Path("/d/backends"), Path("/d/stub"))


def test_find_distribution_locates_the_wheel_parts():
    dist = find_distribution()
    assert dist.binary.is_file() and dist.binary.name == "tritonserver"
    assert dist.stub.is_file()
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in str(dist.stub)
    assert (dist.backends_dir / "python" / "libtriton_python.so").is_file()


def test_find_distribution_names_missing_stub_version():
    with pytest.raises(ServerError, match=r"no Python backend stub for Python 2\.7"):
        find_distribution("2.7")


def test_build_command_sets_ports_mode_and_models():
    config = ServerConfig(model_repository=Path("/repo"), http_port=1, grpc_port=2, metrics_port=3,
                          model_control_mode=ModelControlMode.EXPLICIT, load_models=("embed",), log_verbose=1)
    command = build_command(config, FAKE, Path("/b"))
    assert command[0] == "/d/bin/tritonserver"
    for flag in ("--model-repository=/repo", "--backend-directory=/b", "--http-port=1", "--grpc-port=2",
                 "--metrics-port=3", "--model-control-mode=explicit", "--load-model=embed", "--log-verbose=1"):
        assert flag in command


def test_build_env_paths():
    env = build_env(FAKE, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/x", "PYTHONPATH": "/p"}, repo_root=Path("/r"))
    assert env["LD_LIBRARY_PATH"].split(":")[0] == "/d/libs"
    assert env["LD_LIBRARY_PATH"].endswith(":/x")
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert env["PYTHONPATH"] == "/r:/p"


def test_busy_ports_sees_a_listener():
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert busy_ports({"HTTP": port, "gRPC": free_port()}) == {"HTTP": port}


def test_start_refuses_a_taken_port_with_a_clear_message():
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        port = sock.getsockname()[1]
        server = TritonServer(ServerConfig(http_port=free_port(), grpc_port=port, metrics_port=free_port()))
        with pytest.raises(ServerError, match=rf"gRPC port {port} already in use"):
            server.start()
        assert server.process is None


def test_start_refuses_a_missing_repository(tmp_path):
    server = TritonServer(ServerConfig(model_repository=tmp_path / "nope"))
    with pytest.raises(ServerError, match="does not exist"):
        server.start()


def test_model_names_lists_the_repository():
    names = model_names(REPO / "model_repository")
    assert {"embed", "encoder_16", "encoder_256"} <= set(names)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "tools", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_cli_help_lists_subcommands():
    result = run_cli("--help")
    assert result.returncode == 0
    assert "serve" in result.stdout and "build-models" in result.stdout


def test_serve_help_explains_options():
    result = run_cli("serve", "--help")
    assert result.returncode == 0
    for option in ("--http-port", "--grpc-port", "--metrics-port", "--model-control-mode", "--log-verbose"):
        assert option in result.stdout


def test_serve_exits_with_message_when_port_taken():
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run_cli("serve", f"--http-port={port}", f"--grpc-port={free_port()}",
                         f"--metrics-port={free_port()}", "--model-control-mode=none")
    assert result.returncode == 2
    assert f"HTTP port {port} already in use" in result.stderr


def test_serve_refuses_explicit_model_control_without_an_admin_key():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_ADMIN_KEY"}
    result = subprocess.run([sys.executable, "-m", "tools", "serve", f"--http-port={free_port()}"], cwd=REPO,
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert "explicit model control needs an admin key" in result.stderr and "--admin-key-file" in result.stderr


def test_serve_rejects_bad_port_argument():
    result = run_cli("serve", "--http-port=70000")
    assert result.returncode == 2
    assert "not a TCP port" in result.stderr


def test_find_distribution_names_a_missing_binary(tmp_path, monkeypatch):
    import pytriton

    fake_package = tmp_path / "pytriton"
    (fake_package / "tritonserver").mkdir(parents=True)
    monkeypatch.setattr(pytriton, "__file__", str(fake_package / "__init__.py"))
    with pytest.raises(ServerError, match=r"tritonserver binary not found at .*tritonserver/bin/tritonserver"):
        find_distribution()


def test_process_group_cpu_seconds_sums_the_group_only(tmp_path):
    import os

    from tools.server.triton_server import process_group_cpu_seconds

    tick = os.sysconf("SC_CLK_TCK")

    def stat(pid, name, pgrp, utime, stime):
        (tmp_path / str(pid)).mkdir()
        fields = ["S", "1", str(pgrp)] + ["0"] * 8 + [str(utime), str(stime)] + ["0"] * 10
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) " + " ".join(fields))

    stat(100, "tritonserver", 100, 3 * tick, tick)
    stat(101, "triton python backend stub (embed)", 100, tick, 0)  # names may hold spaces and parens
    stat(200, "other", 200, 50 * tick, 0)
    (tmp_path / "self").mkdir()
    assert process_group_cpu_seconds(100, proc=tmp_path) == pytest.approx(5.0)
    assert process_group_cpu_seconds(999, proc=tmp_path) == 0.0


def test_process_group_cpu_by_part_splits_the_server_from_each_models_stubs(tmp_path):
    import os

    from tools.server.triton_server import process_group_cpu_by_part

    tick = os.sysconf("SC_CLK_TCK")

    def process(pid, pgrp, utime, argv):
        (tmp_path / str(pid)).mkdir()
        fields = ["S", "1", str(pgrp)] + ["0"] * 8 + [str(utime), "0"] + ["0"] * 10
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (x) " + " ".join(fields))
        (tmp_path / str(pid) / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")

    stub = "/opt/backends/python/triton_python_backend_stub"
    process(100, 100, 2 * tick, ["tritonserver", "--model-repository", "/repo"])
    process(101, 100, tick, [stub, "/repo/embed/1/model.py", "shm", "embed_0_0", "DEFAULT"])
    process(102, 100, tick, [stub, "/repo/embed/1/model.py", "shm", "embed_0_1", "DEFAULT"])
    process(103, 100, 3 * tick, [stub, "/repo/encoder_16/2/model.py", "shm", "encoder_16_0_0", "DEFAULT"])
    process(104, 100, tick, ["sh", "-c", "true"])
    process(200, 200, 50 * tick, [stub, "/repo/embed/1/model.py"])  # another server's group
    assert process_group_cpu_by_part(100, proc=tmp_path) == pytest.approx(
        {"tritonserver": 2.0, "embed": 2.0, "encoder_16": 3.0, "other": 1.0})
    assert process_group_cpu_by_part(999, proc=tmp_path) == {}


def test_find_distribution_with_a_triton_home_runs_its_server_with_the_wheels_stub(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "tritonserver").write_text("")
    (tmp_path / "backends" / "python").mkdir(parents=True)
    dist = find_distribution(triton_home=tmp_path)
    assert dist.binary == tmp_path / "bin" / "tritonserver"
    assert dist.backends_dir == tmp_path / "backends" and dist.libs_dir == tmp_path / "lib"
    assert dist.stub == find_distribution().stub  # the container's stub embeds Python 3.10, not this one


def test_find_distribution_says_when_a_triton_home_is_not_one(tmp_path):
    with pytest.raises(ServerError, match=r"tritonserver binary not found at .*is .* a Triton installation"):
        find_distribution(triton_home=tmp_path)


def test_pinned_memory_pool_is_off_by_default_and_settable_for_gpu_nodes():
    assert "--pinned-memory-pool-byte-size=0" in build_command(ServerConfig(), FAKE, Path("/b"))
    gpu = ServerConfig(pinned_memory_bytes=256 * 1024 * 1024)
    assert "--pinned-memory-pool-byte-size=268435456" in build_command(gpu, FAKE, Path("/b"))


REGION = "triton_python_backend_shm_region_46f79431-4ed8-427f-bc7a-a06e48063c35"
STUB = "/opt/backends/python/triton_python_backend_stub"


def test_a_stubs_shared_memory_region_is_its_third_argument():
    from tools.server.triton_server import stub_shm_region

    argv = [STUB, "/repo/encoder_16/1/model.py", REGION, "4194304", "1048576", "7098", "/opt/backends/python",
            "336", "encoder_16_0_1", "DEFAULT"]
    assert stub_shm_region(argv) == REGION
    assert stub_shm_region(["tritonserver", "--model-repository", REGION]) is None  # not a stub
    assert stub_shm_region([STUB, "/repo/embed/1/model.py"]) is None  # no region argument
    assert stub_shm_region([STUB, "/repo/embed/1/model.py", "../../etc/passwd"]) is None  # never a path
    assert stub_shm_region([STUB, "/repo/embed/1/model.py", "other_prefix_1234"]) is None


def test_the_regions_of_a_groups_stubs_are_found_and_removed_and_nothing_else(tmp_path):
    from tools.server.triton_server import process_group_shm_regions, remove_shm_regions

    proc, shm = tmp_path / "proc", tmp_path / "shm"
    proc.mkdir()
    shm.mkdir()

    def process(pid, pgrp, argv):
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "stat").write_text(f"{pid} (x) S 1 {pgrp} " + " ".join(["0"] * 20))
        (proc / str(pid) / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")

    process(100, 100, ["tritonserver", "--model-repository", "/repo"])
    process(101, 100, [STUB, "/repo/embed/1/model.py", REGION + "a", "4194304", "embed_0_0"])
    process(102, 100, [STUB, "/repo/encoder_16/1/model.py", REGION + "b", "4194304", "encoder_16_0_0"])
    process(200, 200, [STUB, "/repo/embed/1/model.py", REGION + "c", "4194304", "embed_0_0"])  # another server's
    regions = process_group_shm_regions(100, proc=proc)
    assert regions == {REGION + "a", REGION + "b"}

    for name in (REGION + "a", REGION + "c", "unrelated"):
        (shm / name).write_bytes(b"\0" * 16)
    # b was already unlinked by its server; c belongs to another server; neither is touched.
    assert remove_shm_regions(regions, shm_dir=shm) == [REGION + "a"]
    assert sorted(path.name for path in shm.iterdir()) == [REGION + "c", "unrelated"]
