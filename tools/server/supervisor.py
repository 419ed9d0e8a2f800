"""Bring crashed Python-backend instances back.

Triton 2.51 does not restart a Python backend stub process that dies (killed by the
kernel's OOM killer, a segfault in native code, an operator's `kill`): every request the
dead instance takes afterwards fails with "Stub process '<instance>' is not healthy",
forever. The supervisor watches the server's stub processes and, when one of a ready model
disappears without a replacement, reloads that model through the repository API. Triton
builds the new instances while the healthy ones keep serving, then swaps them in, so the
reload itself drops nothing. It needs `--model-control-mode explicit` (the default of
`python -m tools serve`).

`crashed_models` is the pure decision; `tools.server.stubs.scan_stubs` reads the stub
processes (through psutil); `Supervisor` is the loop, which talks to the server through
`tools.server.control` (tritonclient.http, the admin key in the headers); `serve_until_stopped`
keeps a served server running under its supervisor until told to stop (`python -m tools serve`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from tools.server.control import ControlError, ServerControl
from tools.server.stubs import StubProcess, scan_stubs
from tools.server.triton_server import TritonServer, remove_shm_regions

RESTART_PARAMETER = "supervisor_restarts"  # config parameter bumped on each reload: forces a real reload
QUERY_TIMEOUT_S = 30.0  # reading the repository index or a model config


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
        # e.g. http://localhost:8000; the repository endpoints may be behind the admin key
        self.control = ServerControl(http_url, admin_key=admin_key, timeout_s=timeout_s)
        # Reading the index and a config answers at once on a healthy server: a 30 s bound
        # keeps a hung server from holding the watch loop for the whole load timeout.
        self.queries = ServerControl(http_url, admin_key=admin_key, timeout_s=QUERY_TIMEOUT_S)
        self.server_pid = server_pid
        self.interval_s = interval_s
        self.log = log
        self.timeout_s = timeout_s  # a reload waits for the new instances to load
        self.restarts: list[dict] = []  # one record per reload: model, dead instances, seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ready_versions(self) -> set[tuple[str, str]]:
        return self.queries.ready_versions()

    def reload(self, model: str, dead: list[StubProcess]) -> dict:
        detected_at = time.time()
        started = time.monotonic()
        override = with_restart_marker(self.queries.model_config(model), len(self.restarts) + 1)
        error = None
        try:
            self.control.load(model, config=override)
        except ControlError as err:
            error = str(err)
        record = {"model": model, "instances": sorted(f"{s.instance} (pid {s.pid})" for s in dead),
                  "detected_at": detected_at, "reload_s": round(time.monotonic() - started, 2), "ok": error is None}
        if error is not None:
            record["error"] = error[:500]
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
            except ControlError as err:
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


def serve_until_stopped(server: TritonServer, stop: threading.Event, *, supervise: bool, admin_key: str | None = None,
                        log: Callable[[str], None] = print, poll_s: float = 1.0) -> int | None:
    """Keep a ready server running until `stop` is set, reloading crashed models meanwhile when
    `supervise` (explicit model control only). The server's exit code if it exited on its own,
    None when `stop` ended the wait: stopping the server is the caller's."""
    assert server.process is not None, "start() first"
    supervisor = None
    if supervise:
        supervisor = Supervisor(server.http_url, server.process.pid, log=log, admin_key=admin_key).start()
    try:
        while not stop.wait(poll_s):
            if server.process.poll() is not None:
                return server.process.returncode
        return None
    finally:
        if supervisor is not None:
            supervisor.stop()
