"""Files the instances of one model share within one server run, and the sweep of stale ones.

A router's instances are separate processes; admission (work in flight, the adaptive bound)
and tenant quotas live in small files they map together. A file must belong to exactly one
server run: a process id alone is not enough, because ids are reused (`pid_max` is often
32768), and a new server that inherited a dead server's file would start with its work in
flight and its spent quotas. The file name therefore carries the server's process id and
its start time (clock ticks since boot, from `/proc/<pid>/stat`), which together name one
process for as long as the machine runs.

Process ids are only unique within a pid namespace (a container has its own, and containers
may share `/dev/shm`), so the name carries the namespace too: `triton-<ns>.<pid>.<start>-`.

A server that is killed cannot remove its files, so every router sweeps at start the files
of its own namespace whose server is gone; files of other namespaces, and names without a
namespace, it leaves alone, since it cannot see their processes. `stat_fields`,
`parse_start_ticks`, `parse_namespace`, `shared_file_name`, `parse_shared_file_name` and
`stale_files` are pure; the others read /proc or the shared directory.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

PREFIX = "triton-"
_NAME = re.compile(r"^triton-(?:(\d+)\.(\d+)\.(\d+)|(\d+))-(.+)-([a-z]+)\.bin$")
_START_FIELD = 22  # starttime in proc(5), counted from 1; fields 1 and 2 are the pid and (comm)


@dataclass(frozen=True)
class ServerRun:
    """One run of a server process: its pid namespace, its id and its start time.

    `namespace` and `start_ticks` are None where the system has no /proc; such a run is
    named by its id alone and its files are never swept.
    """

    pid: int
    namespace: int | None = None
    start_ticks: int | None = None

    @property
    def known(self) -> bool:
        return self.namespace is not None and self.start_ticks is not None

    @property
    def tag(self) -> str:
        return f"{self.namespace}.{self.pid}.{self.start_ticks}" if self.known else str(self.pid)


def shared_dir() -> Path:
    """Where processes of one server share files: memory-backed when the system has it."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def stat_fields(stat_text: str) -> list[str]:
    """The fields of a `/proc/<pid>/stat` line after the command name: field 3 (the state)
    first, so field n of proc(5) is at index n - 3.

    The command name (field 2) is in parentheses and may itself hold spaces and
    parentheses, so the fields are counted from the last closing parenthesis.
    """
    end = stat_text.rfind(")")
    if end < 0:
        raise ValueError("not a /proc/<pid>/stat line: no ')' after the command name")
    return stat_text[end + 1:].split()


def parse_start_ticks(stat_text: str) -> int:
    """The start time (clock ticks after boot) in the text of `/proc/<pid>/stat`."""
    fields = stat_fields(stat_text)
    index = _START_FIELD - 3
    if len(fields) <= index:
        raise ValueError(f"not a /proc/<pid>/stat line: {len(fields) + 2} fields, "
                         f"the start time is field {_START_FIELD}")
    return int(fields[index])


def process_start_ticks(pid: int, proc: Path = Path("/proc")) -> int | None:
    """When process `pid` started, or None when no such process runs (or there is no /proc)."""
    try:
        return parse_start_ticks((proc / str(pid) / "stat").read_text())
    except (OSError, ValueError):
        return None


def boot_id(proc: Path = Path("/proc")) -> str | None:
    """This boot of the machine (start times count from it), or None where there is no /proc."""
    try:
        return (proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip() or None
    except OSError:
        return None


def parse_namespace(link: str) -> int:
    """The namespace number in a `/proc/<pid>/ns/pid` link such as `pid:[4026531836]`."""
    match = re.fullmatch(r"pid:\[(\d+)\]", link)
    if not match:
        raise ValueError(f"not a pid namespace link: {link!r}")
    return int(match.group(1))


def current_namespace(proc: Path = Path("/proc")) -> int | None:
    """The pid namespace this process runs in, or None where there is no /proc."""
    try:
        return parse_namespace(os.readlink(proc / "self" / "ns" / "pid"))
    except (OSError, ValueError):
        return None


def server_run(pid: int, proc: Path = Path("/proc")) -> ServerRun:
    """The run of process `pid`, in this process's namespace (a backend stub and its server share one)."""
    namespace, start = current_namespace(proc), process_start_ticks(pid, proc)
    if namespace is None or start is None:
        return ServerRun(pid)
    return ServerRun(pid, namespace, start)


def shared_file_name(run: ServerRun, model: str, kind: str) -> str:
    """The name of `model`'s shared file of one kind (`work`, `quotas`) for one server run."""
    if not re.fullmatch(r"[a-z]+", kind):
        raise ValueError(f"kind must be lower-case letters, got {kind!r}")
    return f"{PREFIX}{run.tag}-{model}-{kind}.bin"


def parse_shared_file_name(name: str) -> ServerRun | None:
    """The server run a shared file belongs to, or None for a name this module did not make."""
    match = _NAME.match(name)
    if not match:
        return None
    namespace, pid, start, bare_pid = match.group(1, 2, 3, 4)
    if bare_pid is not None:
        return ServerRun(int(bare_pid))
    return ServerRun(int(pid), int(namespace), int(start))


def stale_files(names: Iterable[str], namespace: int, start_of: Callable[[int], int | None]) -> list[str]:
    """The shared files, among `names`, of server runs in `namespace` that are over.

    `start_of(pid)` gives the start time of the process running as `pid` in that namespace
    now, or None if none does. A run is over when its process is gone, or when its id now
    belongs to a process that started at another time. Files of other namespaces and
    names without one are never stale here: their processes cannot be seen.
    """
    stale = []
    for name in names:
        run = parse_shared_file_name(name)
        if run is None or not run.known or run.namespace != namespace:
            continue
        if start_of(run.pid) != run.start_ticks:
            stale.append(name)
    return sorted(stale)


def sweep_stale(directory: Path, proc: Path = Path("/proc")) -> list[str]:
    """Remove the stale shared files of this namespace in `directory`; returns the names removed."""
    namespace = current_namespace(proc)
    if namespace is None:
        return []  # no /proc: no way to tell a live server from a dead one
    try:
        names = [name for name in os.listdir(directory) if name.startswith(PREFIX)]
    except OSError:
        return []
    removed = []
    for name in stale_files(names, namespace, lambda pid: process_start_ticks(pid, proc)):
        try:
            (directory / name).unlink()
        except FileNotFoundError:
            pass  # another router swept it first
        except OSError:
            continue  # not ours to remove (another user's file): leave it
        removed.append(name)
    return removed
