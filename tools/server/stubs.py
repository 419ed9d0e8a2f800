"""The Python backend stub processes of a tritonserver: the one reader of them.

Triton runs one stub process per model instance, as a child of the server and in its process
group, with a command line that names the model file, the shared-memory region it talks
through and the instance. The supervisor (which instances died), the server's CPU accounting
(CPU seconds by model) and the cleanup at stop (the regions a killed server left) all learn
about the stubs here.

`stub_model_name`, `stub_shm_region`, `parse_stub_cmdline`, `live_stubs`, `cpu_by_part` and
`shm_regions` are pure, over `ProcessView` snapshots; `children_of`, `process_group` and
`scan_stubs` read the running processes through psutil.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

STUB_BINARY = "triton_python_backend_stub"  # the Python backend's stub executable, one process per instance
SHM_REGION_PREFIX = "triton_python_backend_shm_region_"  # the Python backend's default region name prefix
SERVER_PART = "tritonserver"  # the server process itself, in `cpu_by_part`
_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)  # a killed stub stays a zombie until its server reaps it


@dataclass(frozen=True)
class ProcessView:
    """One process as read at one moment."""

    pid: int
    ppid: int = 0  # its parent's pid
    status: str = psutil.STATUS_SLEEPING  # psutil.STATUS_*
    cmdline: tuple[str, ...] = ()  # empty for a zombie, whose command line is gone
    cpu_s: float = 0.0  # user + system CPU seconds so far (its own, not its children's)


@dataclass(frozen=True)
class StubProcess:
    """One Python backend stub: one model instance of one model version."""

    pid: int
    model: str  # model name, e.g. encoder_256
    version: str  # model version folder, e.g. "1"
    instance: str  # Triton's instance name, e.g. encoder_256_0_1
    shm_region: str | None = None  # its shared-memory region under /dev/shm (argv[2]), if named as usual

    @property
    def key(self) -> tuple[str, str, str]:
        return self.model, self.version, self.instance


def stub_model_name(cmdline: Sequence[str]) -> str | None:
    """The model a Python backend stub serves, from its command line (argv[1] is
    `<repository>/<model>/<version>/model.py`); None for any other process."""
    if len(cmdline) < 2 or not cmdline[0].endswith(STUB_BINARY):
        return None
    parts = Path(cmdline[1]).parts
    return parts[-3] if len(parts) >= 3 else None


def stub_shm_region(cmdline: Sequence[str]) -> str | None:
    """The shared-memory region (a file under /dev/shm) through which a Python backend stub
    and its server talk: argv[2] of the stub; None for any other process."""
    if stub_model_name(cmdline) is None or len(cmdline) < 3:
        return None
    name = cmdline[2]
    return name if name.startswith(SHM_REGION_PREFIX) and "/" not in name else None


def parse_stub_cmdline(pid: int, argv: Sequence[str]) -> StubProcess | None:
    """The stub's command line: binary, <repo>/<model>/<version>/model.py, shm region, sizes,
    parent pid, backend dir, ipc size, instance name, runtime. None for anything else."""
    if len(argv) < 9 or stub_model_name(argv) is None:
        return None
    model_file = Path(argv[1])
    return StubProcess(pid=pid, model=model_file.parent.parent.name, version=model_file.parent.name,
                       instance=argv[8], shm_region=stub_shm_region(argv))


def live_stubs(processes: Iterable[ProcessView], server_pid: int) -> dict[int, StubProcess]:
    """The stubs among `processes` whose parent is the server `server_pid` and that still run."""
    stubs = {}
    for process in processes:
        if process.ppid != server_pid or process.status in _GONE:
            continue
        stub = parse_stub_cmdline(process.pid, process.cmdline)
        if stub is not None:
            stubs[stub.pid] = stub
    return stubs


def cpu_by_part(members: Iterable[ProcessView], server_pid: int) -> dict[str, float]:
    """CPU seconds of a server's process group by part: `tritonserver` (the server process) and
    one entry per model (all of its stubs); other members of the group count as `other`."""
    parts: dict[str, float] = {}
    for process in members:
        part = SERVER_PART if process.pid == server_pid else stub_model_name(process.cmdline) or "other"
        parts[part] = parts.get(part, 0.0) + process.cpu_s
    return parts


def shm_regions(members: Iterable[ProcessView], server_pid: int) -> set[str]:
    """The shared-memory regions of the stubs among a server's process group `members`."""
    regions = (stub_shm_region(p.cmdline) for p in members if p.pid != server_pid)
    return {region for region in regions if region is not None}


def _view(process: psutil.Process) -> ProcessView | None:
    """What `process` is now; None once it has ended."""
    try:
        with process.oneshot():
            status = process.status()
            times = process.cpu_times()
            try:
                cmdline = tuple(process.cmdline())
            except psutil.ZombieProcess:
                cmdline = ()
            return ProcessView(pid=process.pid, ppid=process.ppid(), status=status, cmdline=cmdline,
                               cpu_s=times.user + times.system)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None  # it ended while we looked, or is not ours to read


def children_of(server_pid: int) -> list[ProcessView]:
    """The processes whose parent is `server_pid` now; none when it does not run."""
    try:
        children = psutil.Process(server_pid).children()
    except psutil.Error:
        return []
    return [view for view in map(_view, children) if view is not None]


def process_group(pgid: int) -> list[ProcessView]:
    """The live processes of process group `pgid` (psutil has no process-group call: the group
    of each process comes from getpgid)."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) != pgid:
                continue
        except OSError:
            continue  # it ended while we looked
        view = _view(process)
        if view is not None:
            members.append(view)
    return members


def scan_stubs(server_pid: int) -> dict[int, StubProcess]:
    """The running stub processes of the tritonserver `server_pid`."""
    return live_stubs(children_of(server_pid), server_pid)
