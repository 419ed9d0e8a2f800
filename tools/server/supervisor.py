"""Bring crashed Python-backend instances back.

Triton 2.51 does not restart a Python backend stub process that dies (killed by the
kernel's OOM killer, a segfault in native code, an operator's `kill`): every request the
dead instance takes afterwards fails with "Stub process '<instance>' is not healthy",
forever. The supervisor watches the server's stub processes and, when one of a ready model
disappears without a replacement, reloads that model through the repository API. Triton
builds the new instances while the healthy ones keep serving, then swaps them in, so the
reload itself drops nothing. It needs `--model-control-mode explicit` (the default of
`python -m tools serve`).

`crashed_models` is the pure decision; `scan_stubs` reads /proc; `Supervisor` is the loop.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import requests

from python_backends.common.shared_files import stat_fields
from tools.server.admin_key import admin_headers
from tools.server.triton_server import STUB_BINARY, remove_shm_regions, stub_shm_region

RESTART_PARAMETER = "supervisor_restarts"  # config parameter bumped on each reload: forces a real reload


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


def parse_stub_cmdline(pid: int, argv: list[str]) -> StubProcess | None:
    """The stub's command line: binary, <repo>/<model>/<version>/model.py, shm region, sizes,
    parent pid, backend dir, ipc size, instance name, runtime. None for anything else."""
    if not argv or not argv[0].endswith(STUB_BINARY) or len(argv) < 9:
        return None
    model_file = Path(argv[1])
    if len(model_file.parts) < 3:
        return None
    return StubProcess(pid=pid, model=model_file.parent.parent.name, version=model_file.parent.name,
                       instance=argv[8], shm_region=stub_shm_region(argv))


def scan_stubs(server_pid: int, proc: Path = Path("/proc")) -> dict[int, StubProcess]:
    """Stub processes whose parent is the tritonserver process `server_pid`."""
    stubs: dict[int, StubProcess] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # Fields 3 and 4 are the state and the parent pid. A killed stub stays a zombie (Z)
            # until the server reaps it, seconds later: it is already dead.
            state, ppid = stat_fields(stat)[:2]
            if int(ppid) != server_pid or state in ("Z", "X"):
                continue
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue  # the process went away while we looked
        stub = parse_stub_cmdline(int(entry.name), [a for a in argv if a])
        if stub is not None:
            stubs[stub.pid] = stub
    return stubs


def crashed_models(previous: Mapping[int, StubProcess], current: Mapping[int, StubProcess],
                   ready: Iterable[tuple[str, str]]) -> dict[str, list[StubProcess]]:
    """Models to reload: model -> its stubs that died.

    A stub died when its process is gone, no process has taken over its instance name (a
    reload replaces every instance under the same names before it stops the old ones), and
    its model version is still READY (an unload takes the version out of READY first, so an
    unloaded instance is never mistaken for a crash).
    """
    ready_versions = set(ready)
    live_instances = {stub.key for stub in current.values()}
    dead: dict[str, list[StubProcess]] = {}
    for pid, stub in previous.items():
        if pid in current or stub.key in live_instances:
            continue
        if (stub.model, stub.version) in ready_versions:
            dead.setdefault(stub.model, []).append(stub)
    return dead


def with_restart_marker(config: dict, restarts: int) -> dict:
    """The served config with the restart counter set: a changed config is what makes Triton
    reload a model (a load request for an unchanged model is a no-op)."""
    changed = json.loads(json.dumps(config))
    changed.setdefault("parameters", {})[RESTART_PARAMETER] = {"string_value": str(restarts)}
    return changed


class Supervisor:
    """Polls the stubs of one tritonserver and reloads models whose instances died."""

    def __init__(self, http_url: str, server_pid: int, interval_s: float = 0.5,
                 log: Callable[[str], None] = print, timeout_s: float = 300.0, admin_key: str | None = None):
        self.http_url = http_url.rstrip("/")  # e.g. http://localhost:8000
        self.admin_headers = admin_headers(admin_key)  # the repository endpoints may be behind the admin key
        self.server_pid = server_pid
        self.interval_s = interval_s
        self.log = log
        self.timeout_s = timeout_s  # a reload waits for the new instances to load
        self.restarts: list[dict] = []  # one record per reload: model, dead instances, seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ready_versions(self) -> set[tuple[str, str]]:
        response = requests.post(f"{self.http_url}/v2/repository/index", json={}, headers=self.admin_headers,
                                 timeout=30)
        response.raise_for_status()
        return {(entry["name"], str(entry.get("version", ""))) for entry in response.json()
                if entry.get("state") == "READY"}

    def reload(self, model: str, dead: list[StubProcess]) -> dict:
        detected_at = time.time()
        started = time.monotonic()
        config = requests.get(f"{self.http_url}/v2/models/{model}/config", timeout=30)
        config.raise_for_status()
        override = with_restart_marker(config.json(), len(self.restarts) + 1)
        response = requests.post(f"{self.http_url}/v2/repository/models/{model}/load",
                                 json={"parameters": {"config": json.dumps(override)}}, headers=self.admin_headers,
                                 timeout=self.timeout_s)
        record = {"model": model, "instances": sorted(f"{s.instance} (pid {s.pid})" for s in dead),
                  "detected_at": detected_at, "reload_s": round(time.monotonic() - started, 2), "ok": response.ok}
        if not response.ok:
            record["error"] = response.text[:500]
        self.restarts.append(record)
        return record

    def check(self, previous: Mapping[int, StubProcess]) -> dict[int, StubProcess]:
        """One poll: returns the stubs seen now (the next poll's `previous`)."""
        current = scan_stubs(self.server_pid)
        if not any(pid not in current for pid in previous):
            return current
        # Read the model states after the process scan, so they are at least as new as it.
        for model, dead in crashed_models(previous, current, self.ready_versions()).items():
            names = ", ".join(f"{s.instance} (pid {s.pid})" for s in dead)
            self.log(f"supervisor: {model}: instance {names} died; reloading the model")
            record = self.reload(model, dead)
            # A dead stub's region is of no use to anyone, and the server does not unlink it
            # (its mapping, if the server still holds one, stays valid until released).
            remove_shm_regions(stub.shm_region for stub in dead if stub.shm_region)
            outcome = "back" if record["ok"] else f"reload FAILED: {record.get('error')}"
            self.log(f"supervisor: {model}: {outcome} after {record['reload_s']} s")
        return scan_stubs(self.server_pid)

    def run(self) -> None:
        seen = scan_stubs(self.server_pid)
        while not self._stop.wait(self.interval_s):
            try:
                seen = self.check(seen)
            except requests.RequestException as err:
                # The server may be starting, stopping or busy: look again at the next poll.
                self.log(f"supervisor: server not answering ({err}); retrying")
                seen = scan_stubs(self.server_pid)

    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self.run, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s)
