"""The reader of Python backend stub processes: command lines, the pure filters over process
snapshots, and the psutil reader on real processes dressed as a server and its stubs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tools.server.stubs import (
    ProcessView,
    StubProcess,
    cpu_by_part,
    live_stubs,
    parse_stub_cmdline,
    process_group,
    scan_stubs,
    shm_regions,
    stub_shm_region,
)

SERVER_PID = 4242
REGION = "triton_python_backend_shm_region_46f79431-4ed8-427f-bc7a-a06e48063c35"
STUB = "/opt/backends/python/triton_python_backend_stub"


def stub_argv(model: str, version: str = "1", instance: str | None = None, server_pid: int = SERVER_PID,
              repo: str = "/repo", stub: str = STUB) -> list[str]:
    return [stub, f"{repo}/{model}/{version}/model.py", "triton_python_backend_shm_region_1", "1048576",
            "1048576", str(server_pid), "/x/backends/python", "1048576", instance or f"{model}_0_0", "DEFAULT"]


def test_a_stub_command_line_names_model_version_and_instance():
    stub = parse_stub_cmdline(7, stub_argv("encoder_256", "2", "encoder_256_1_0"))
    assert stub == StubProcess(pid=7, model="encoder_256", version="2", instance="encoder_256_1_0",
                               shm_region="triton_python_backend_shm_region_1")
    assert stub.key == ("encoder_256", "2", "encoder_256_1_0")


@pytest.mark.parametrize("argv", [[], ["/usr/bin/python3", "x.py"], stub_argv("m")[:5],
                                  ["/x/triton_python_backend_stub", "model.py", *["a"] * 8]])
def test_anything_else_is_not_a_stub(argv):
    assert parse_stub_cmdline(1, argv) is None


def test_a_stubs_shared_memory_region_is_its_third_argument():
    argv = [STUB, "/repo/encoder_16/1/model.py", REGION, "4194304", "1048576", "7098", "/opt/backends/python",
            "336", "encoder_16_0_1", "DEFAULT"]
    assert stub_shm_region(argv) == REGION
    assert stub_shm_region(["tritonserver", "--model-repository", REGION]) is None  # not a stub
    assert stub_shm_region([STUB, "/repo/embed/1/model.py"]) is None  # no region argument
    assert stub_shm_region([STUB, "/repo/embed/1/model.py", "../../etc/passwd"]) is None  # never a path
    assert stub_shm_region([STUB, "/repo/embed/1/model.py", "other_prefix_1234"]) is None


def test_the_servers_live_stubs_are_its_children_that_run_a_stub():
    processes = [
        ProcessView(100, SERVER_PID, cmdline=tuple(stub_argv("encoder_16", instance="encoder_16_0_0"))),
        ProcessView(101, SERVER_PID, cmdline=tuple(stub_argv("encoder_16", instance="encoder_16_0_1"))),
        # killed, not yet reaped: dead (a zombie's command line is already gone)
        ProcessView(102, SERVER_PID, status=psutil.STATUS_ZOMBIE, cmdline=tuple(stub_argv("encoder_32"))),
        ProcessView(103, 1, cmdline=tuple(stub_argv("encoder_64"))),  # another server's stub
        ProcessView(104, SERVER_PID, cmdline=("/usr/bin/sleep", "100")),  # not a stub
    ]
    stubs = live_stubs(processes, SERVER_PID)
    assert sorted(stubs) == [100, 101]
    assert stubs[101].instance == "encoder_16_0_1"


def test_cpu_by_part_splits_the_server_from_each_models_stubs():
    members = [
        ProcessView(100, 1, cmdline=("tritonserver", "--model-repository", "/repo"), cpu_s=2.0),
        ProcessView(101, 100, cmdline=(STUB, "/repo/embed/1/model.py", "shm", "embed_0_0"), cpu_s=1.0),
        ProcessView(102, 100, cmdline=(STUB, "/repo/embed/1/model.py", "shm", "embed_0_1"), cpu_s=1.0),
        ProcessView(103, 100, cmdline=(STUB, "/repo/encoder_16/2/model.py", "shm", "encoder_16_0_0"), cpu_s=3.0),
        ProcessView(104, 100, cmdline=("sh", "-c", "true"), cpu_s=1.0),
    ]
    assert cpu_by_part(members, 100) == pytest.approx(
        {"tritonserver": 2.0, "embed": 2.0, "encoder_16": 3.0, "other": 1.0})
    assert cpu_by_part([], 100) == {}


def test_the_regions_are_those_of_the_groups_stubs():
    members = [ProcessView(100, 1, cmdline=("tritonserver", "--model-repository", "/repo", REGION + "x")),
               ProcessView(101, 100, cmdline=(STUB, "/repo/embed/1/model.py", REGION + "a", "4194304")),
               ProcessView(102, 100, cmdline=(STUB, "/repo/encoder_16/1/model.py", REGION + "b", "4194304"))]
    assert shm_regions(members, 100) == {REGION + "a", REGION + "b"}


def fake_stub(tmp_path: Path, server_pid: int, model: str = "encoder_16") -> list[str]:
    """The command line of a process that looks like a stub: a Python waiting on its stdin,
    started under the stub's name with a model file as its script."""
    model_file = tmp_path / "repo" / model / "1" / "model.py"
    model_file.parent.mkdir(parents=True, exist_ok=True)
    model_file.write_text("import sys\nsys.stdin.read()\n")
    argv = stub_argv(model, server_pid=server_pid, repo=str(tmp_path / "repo"),
                     stub=str(tmp_path / "triton_python_backend_stub"))
    argv[2] = REGION
    return argv


def wait_for(condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := condition()):
            return value
        time.sleep(0.05)
    return condition()


def test_scan_finds_this_processs_running_stub_and_not_once_it_is_killed(tmp_path):
    stub = subprocess.Popen(fake_stub(tmp_path, os.getpid()), executable=sys.executable, stdin=subprocess.PIPE)
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        stubs = wait_for(lambda: scan_stubs(os.getpid()))
        assert list(stubs) == [stub.pid]  # the other child is no stub
        assert stubs[stub.pid] == StubProcess(stub.pid, "encoder_16", "1", "encoder_16_0_0", REGION)
        assert scan_stubs(stub.pid) == {}  # a process without stubs
        os.kill(stub.pid, signal.SIGKILL)  # not reaped yet: a zombie, already dead
        assert wait_for(lambda: psutil.Process(stub.pid).status() == psutil.STATUS_ZOMBIE)
        assert scan_stubs(os.getpid()) == {}
    finally:
        for process in (stub, other):
            process.kill()
            process.wait()
    assert scan_stubs(2 ** 22 + 1) == {}  # beyond pid_max: runs nothing


@contextlib.contextmanager
def server_like_group(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """(leader pid, child pid) of a new session: a leader that spins 0.3 s of CPU, standing for
    the server, and its child, started as a stub of encoder_16 with REGION. Gone on exit."""
    leader_script = ("import subprocess, sys, time\n"
                     "child = subprocess.Popen(sys.argv[1:], executable=sys.executable, stdin=subprocess.PIPE)\n"
                     "end = time.process_time() + 0.3\n"
                     "while time.process_time() < end: pass\n"
                     "print(child.pid, flush=True)\n"
                     "sys.stdin.read()\n"
                     "child.kill()\n"
                     "child.wait()\n")
    leader = subprocess.Popen([sys.executable, "-c", leader_script, *fake_stub(tmp_path, 0)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        yield leader.pid, int(leader.stdout.readline())
    finally:
        leader.communicate("")


def test_a_process_group_is_its_leader_and_the_leaders_stub_and_nothing_else(tmp_path):
    with server_like_group(tmp_path) as (leader_pid, child_pid):
        members = {view.pid: view for view in process_group(leader_pid)}
        assert sorted(members) == sorted([leader_pid, child_pid])  # not this process, in another group
        assert members[leader_pid].cpu_s >= 0.3
        assert shm_regions(members.values(), leader_pid) == {REGION}
    assert process_group(leader_pid) == []
