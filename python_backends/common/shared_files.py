"""Files the instances of one model share within one server run, and the sweep of stale ones.

A router's instances are separate processes; admission (work in flight, the adaptive bound)
and tenant quotas live in small files they map together. A file must belong to exactly one
server run: a process id alone is not enough, because ids are reused (`pid_max` is often
32768), and a new server that inherited a dead server's file would start with its work in
flight and its spent quotas. The file name therefore carries the server's process id and
its start time (clock ticks since boot, from psutil's `create_time`), which together name one
process for as long as the machine runs.

Process ids are only unique within a pid namespace (a container has its own, and containers
may share `/dev/shm`), so the name carries the namespace too: `triton-<ns>.<pid>.<start>-`.

A server that is killed cannot remove its files, so every router sweeps at start the files
of its own namespace whose server is gone; files of other namespaces, and names without a
namespace, it leaves alone, since it cannot see their processes. `shared_file_name`,
`parse_shared_file_name` and `stale_files` are pure; `process_start_ticks` asks psutil,
`current_namespace` reads this process's namespace (psutil has no call for it), and the
others read or change the shared directory.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

PREFIX = "triton-"
_NAME = re.compile(r"^triton-(?:(\d+)\.(\d+)\.(\d+)|(\d+))-(.+)-([a-z]+)\.bin$")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # the unit of a process's start time since boot


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


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot; None when no such process runs.

    psutil's `create_time` is the start tick count divided by the tick rate plus the boot
    time (read from the system clock at each call); taking the boot time back off gives the
    kernel's integer start time again, which clock steps (NTP) do not move.
    """
    try:
        created = psutil.Process(pid).create_time()
        return round((created - psutil.boot_time()) * CLOCK_TICKS)
    except psutil.Error:
        return None


def current_namespace(proc: Path = Path("/proc")) -> int | None:
    """The pid namespace this process runs in (the inode of its `ns/pid` link, the number the
    link's text `pid:[N]` shows), or None where there is no /proc."""
    try:
        return os.stat(proc / "self" / "ns" / "pid").st_ino
    except OSError:
        return None


def server_run(pid: int, proc: Path = Path("/proc")) -> ServerRun:
    """The run of process `pid`, in this process's namespace (a backend stub and its server share one)."""
    namespace, start = current_namespace(proc), process_start_ticks(pid)
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
    for name in stale_files(names, namespace, process_start_ticks):
        try:
            (directory / name).unlink()
        except FileNotFoundError:
            pass  # another router swept it first
        except OSError:
            continue  # not ours to remove (another user's file): leave it
        removed.append(name)
    return removed
