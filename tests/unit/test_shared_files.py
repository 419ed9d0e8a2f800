"""Shared files named per server run (python_backends/shared_files.py): no server inherits a dead one's state."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from python_backends.common.shared_files import (
    ServerRun,
    current_namespace,
    parse_shared_file_name,
    process_start_ticks,
    server_run,
    shared_file_name,
    stale_files,
    sweep_stale,
)

NS = 4026531836


def stat_start_ticks(pid: int) -> int:
    """Field 22 of proc(5)'s stat line, counted after the command name, which may hold spaces and ')'."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rfind(")") + 1:].split()[19])


def test_the_start_time_is_the_kernels_ticks_since_boot_whatever_the_command_is_called():
    # A command name with spaces and parentheses does not shift what psutil reads.
    renamed = subprocess.Popen([sys.executable, "-c", "open('/proc/self/comm', 'w').write('tri ton) (x');"
                                "import sys; print(flush=True); sys.stdin.read()"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        renamed.stdout.readline()
        for pid in (os.getpid(), renamed.pid):
            assert process_start_ticks(pid) == stat_start_ticks(pid)
    finally:
        renamed.communicate("")
    assert process_start_ticks(renamed.pid) is None  # gone
    assert process_start_ticks(2 ** 22 + 1) is None  # beyond pid_max: runs nothing


def test_the_namespace_is_the_number_in_the_link():
    link = os.readlink("/proc/self/ns/pid")
    assert link == f"pid:[{current_namespace()}]"


def test_a_name_says_the_namespace_the_process_and_its_start():
    run = ServerRun(2598, NS, 2601603)
    name = shared_file_name(run, "embed", "work")
    assert name == f"triton-{NS}.2598.2601603-embed-work.bin"
    assert parse_shared_file_name(name) == run


def test_the_same_pid_started_again_gets_another_file():
    first, second = ServerRun(2598, NS, 100), ServerRun(2598, NS, 90_000)
    assert shared_file_name(first, "embed", "work") != shared_file_name(second, "embed", "work")


def test_a_model_name_with_dashes_and_digits_round_trips():
    run = ServerRun(7, NS, 8)
    assert parse_shared_file_name(shared_file_name(run, "embed-v2-1", "quotas")) == run


def test_without_proc_a_run_is_named_by_its_pid_alone():
    assert shared_file_name(ServerRun(2598), "embed", "work") == "triton-2598-embed-work.bin"
    assert parse_shared_file_name("triton-2598-embed-work.bin") == ServerRun(2598)


@pytest.mark.parametrize("name", ["micro-q.bin", "triton-x-embed-work.bin", "sem.triton-lanes-12",
                                  "triton_python_backend_shm_region_1", f"triton-{NS}.1.2-embed-work.txt"])
def test_names_this_module_did_not_make_are_not_parsed(name):
    assert parse_shared_file_name(name) is None


def test_a_kind_must_be_a_word():
    with pytest.raises(ValueError, match="lower-case letters"):
        shared_file_name(ServerRun(1, NS, 2), "embed", "work-1")


def test_files_of_a_dead_server_or_of_a_reused_pid_are_stale_and_live_ones_are_not():
    running = {10: 500, 11: 700}  # pid -> start ticks of what runs now
    names = [
        shared_file_name(ServerRun(10, NS, 500), "embed", "work"),  # its server still runs
        shared_file_name(ServerRun(10, NS, 500), "embed", "quotas"),
        shared_file_name(ServerRun(11, NS, 300), "embed", "work"),  # pid 11 reused by a later process
        shared_file_name(ServerRun(12, NS, 400), "embed", "work"),  # pid 12 runs nothing
        shared_file_name(ServerRun(12, NS + 1, 400), "embed", "work"),  # another namespace: cannot tell
        "triton-12-embed-work.bin",  # no namespace: cannot tell
        "unrelated.bin",
    ]
    assert stale_files(names, NS, running.get) == sorted([
        f"triton-{NS}.11.300-embed-work.bin", f"triton-{NS}.12.400-embed-work.bin"])


def test_this_process_is_a_live_run_and_the_sweep_keeps_its_files(tmp_path):
    run = server_run(os.getpid())
    assert run.known and run.start_ticks == process_start_ticks(os.getpid())
    mine = tmp_path / shared_file_name(run, "embed", "work")
    mine.write_bytes(b"\0" * 8)
    assert sweep_stale(tmp_path) == []
    assert mine.exists()


def test_the_sweep_removes_the_files_of_a_server_that_has_exited(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    run = server_run(child.pid)
    assert run.known
    theirs = [tmp_path / shared_file_name(run, "embed", kind) for kind in ("work", "quotas")]
    other_namespace = tmp_path / shared_file_name(ServerRun(child.pid, run.namespace + 1, run.start_ticks),
                                                  "embed", "work")
    for path in (*theirs, other_namespace):
        path.write_bytes(b"\0" * 8)
    assert sweep_stale(tmp_path) == []  # still running
    child.communicate(b"")
    assert sorted(sweep_stale(tmp_path)) == sorted(path.name for path in theirs)
    assert not any(path.exists() for path in theirs)
    assert other_namespace.exists()


def test_without_proc_nothing_is_swept(tmp_path):
    stale = tmp_path / shared_file_name(ServerRun(2 ** 22 + 1, current_namespace(), 1), "embed", "work")
    stale.write_bytes(b"\0")
    missing_proc = tmp_path / "no-proc"
    assert server_run(os.getpid(), missing_proc) == ServerRun(os.getpid())
    assert sweep_stale(tmp_path, missing_proc) == []
    assert stale.exists()
    assert sweep_stale(tmp_path) == [stale.name]  # with /proc: pid beyond pid_max runs nothing
    assert not Path(stale).exists()
