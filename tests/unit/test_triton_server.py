"""Command line, environment and start-up checks of the tritonserver launcher."""

import os
import shutil
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
    auto_complete_needed,
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


def test_auto_completion_is_off_only_for_the_kit_s_own_python_models(tmp_path):
    """Every model of the kit's repository is a Python model with every field written: no stub
    is started to complete its config. Anything Triton may have to complete keeps it on."""
    shutil.copytree(REPO / "model_repository" / "embed", tmp_path / "embed",
                    ignore=shutil.ignore_patterns("routing.json", "__pycache__"))
    kit = ServerConfig(model_repository=tmp_path)
    assert not auto_complete_needed(kit)
    assert "--disable-auto-complete-config" in build_command(kit, FAKE, Path("/b"), auto_complete=False)
    assert "--disable-auto-complete-config" not in build_command(kit, FAKE, Path("/b"))
    assert auto_complete_needed(ServerConfig(model_repository=tmp_path, extra_repositories=(Path("/users"),)))
    (tmp_path / "scorer" / "1").mkdir(parents=True)
    (tmp_path / "scorer" / "1" / "model.py").write_text("class TritonPythonModel:\n"
                                                        "    @staticmethod\n"
                                                        "    def auto_complete_config(config):\n"
                                                        "        return config\n")
    (tmp_path / "scorer" / "config.pbtxt").write_text('backend: "python"\n')
    assert auto_complete_needed(kit)  # the model asks to complete its own config
    (tmp_path / "scorer" / "1" / "model.py").unlink()
    assert not auto_complete_needed(kit)
    (tmp_path / "scorer" / "config.pbtxt").write_text('backend: "onnxruntime"\n')
    assert auto_complete_needed(kit)  # ONNX Runtime fills in the tensors a config leaves out
    (tmp_path / "scorer" / "config.pbtxt").unlink()
    assert auto_complete_needed(kit)


def test_build_env_paths():
    env = build_env(FAKE, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/x", "PYTHONPATH": "/p"}, repo_root=Path("/r"))
    assert env["LD_LIBRARY_PATH"].split(":")[0] == "/d/libs"
    assert env["LD_LIBRARY_PATH"].endswith(":/x")
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert env["PYTHONPATH"] == "/r:/p"


def test_build_env_sets_the_stubs_thread_defaults_and_keeps_the_callers():
    env = build_env(FAKE, {"PATH": "/usr/bin"}, repo_root=Path("/r"))
    assert (env["OMP_NUM_THREADS"], env["GOMP_SPINCOUNT"], env["TOKENIZERS_PARALLELISM"]) == ("1", "10000", "false")
    assert build_env(FAKE, {"GOMP_SPINCOUNT": "300000", "OMP_NUM_THREADS": "4"})["GOMP_SPINCOUNT"] == "300000"


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


def test_the_cpu_of_a_process_group_is_split_into_the_server_and_each_models_stubs(tmp_path):
    """A session leader stands for the server, its child for a stub of encoder_16; this process
    is in another group and does not count."""
    from tests.unit.test_stubs import REGION, server_like_group
    from tools.server.triton_server import (
        process_group_cpu_by_part,
        process_group_cpu_seconds,
        process_group_shm_regions,
    )

    with server_like_group(tmp_path) as (leader_pid, _):
        parts = process_group_cpu_by_part(leader_pid)
        assert sorted(parts) == ["encoder_16", "tritonserver"]
        assert parts["tritonserver"] >= 0.3
        assert process_group_cpu_seconds(leader_pid) == pytest.approx(sum(parts.values()))
        assert process_group_shm_regions(leader_pid) == {REGION}
    assert process_group_cpu_by_part(leader_pid) == {}
    assert process_group_cpu_seconds(leader_pid) == 0.0


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


def test_the_regions_still_present_are_removed_and_nothing_else(tmp_path):
    from tests.unit.test_stubs import REGION
    from tools.server.triton_server import remove_shm_regions

    shm = tmp_path / "shm"
    shm.mkdir()
    regions = {REGION + "a", REGION + "b"}  # of this server's stubs (tools.server.stubs.shm_regions)
    for name in (REGION + "a", REGION + "c", "unrelated"):
        (shm / name).write_bytes(b"\0" * 16)
    # b was already unlinked by its server; c belongs to another server; neither is touched.
    assert remove_shm_regions(regions, shm_dir=shm) == [REGION + "a"]
    assert sorted(path.name for path in shm.iterdir()) == [REGION + "c", "unrelated"]
