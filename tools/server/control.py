"""The server's model repository and health endpoints, over `tritonclient.http`.

`ServerControl` reads the repository index, a model's served config and readiness, and loads
(with a config override) or unloads models. The repository calls carry the admin key in their
headers (`admin_key.admin_headers`); health, readiness and model config are open endpoints.

Every call opens its own client: tritonclient's HTTP client runs on gevent, and a gevent
client belongs to the thread that made it, while the supervisor calls from a thread of its own
(control calls are rare: a rollout step, a crash, a readiness poll every half second).
Everything here does I/O, and every failure comes out as a `ControlError` whose message is
the server's own where it answered.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tools.server.admin_key import admin_headers

CONNECT_TIMEOUT_S = 10.0  # a server that does not accept a connection by then is not answering


class ControlError(RuntimeError):
    """A control call failed: the server answered with an error (its message), or could not be reached."""


def host_port(url: str) -> str:
    """`host:port` of an address given with or without its `http://` scheme (tritonclient wants none)."""
    for scheme in ("http://", "https://"):
        if url.startswith(scheme):
            url = url[len(scheme):]
    return url.rstrip("/")


@dataclass
class ServerControl:
    """One tritonserver's HTTP control and health endpoints."""

    url: str  # its HTTP address, e.g. localhost:8000 (a http:// scheme is dropped)
    admin_key: str | None = field(default=None, repr=False)  # sent to the repository endpoints
    timeout_s: float = 300.0  # longest wait for an answer: loading with warm-up can take a while

    @property
    def address(self) -> str:
        return host_port(self.url)

    @property
    def admin_headers(self) -> dict[str, str]:
        return admin_headers(self.admin_key)

    @contextmanager
    def _client(self) -> Iterator[Any]:
        # Imported here: tritonclient.http brings gevent (0.4 s), which every importer of the
        # server module (tests, `python -m tools`) would pay for without calling the server.
        import tritonclient.http as httpclient
        from tritonclient.utils import InferenceServerException

        client = httpclient.InferenceServerClient(
            self.address, connection_timeout=min(CONNECT_TIMEOUT_S, self.timeout_s), network_timeout=self.timeout_s)
        try:
            yield client
        except InferenceServerException as err:
            raise ControlError(err.message() or str(err)) from err
        except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, closed mid-answer
            raise ControlError(f"tritonserver at {self.address} is not answering ({err})") from err
        finally:
            client.close()

    def repository_index(self) -> list[dict[str, Any]]:
        """Every model version the repository knows: `name`, `version`, `state` (READY, UNAVAILABLE, ...)."""
        with self._client() as client:
            return client.get_model_repository_index(headers=self.admin_headers)

    def ready_versions(self) -> set[tuple[str, str]]:
        """(model, version) of every model version that is READY."""
        return {(entry["name"], str(entry.get("version", ""))) for entry in self.repository_index()
                if entry.get("state") == "READY"}

    def model_config(self, model: str) -> dict[str, Any]:
        """The config `model` is served with, as Triton's JSON."""
        with self._client() as client:
            return client.get_model_config(model)

    def inference_statistics(self, model: str) -> dict[str, Any]:
        """Triton's statistics of every version of `model` (`/v2/models/<model>/stats`, its JSON)."""
        with self._client() as client:
            return client.get_inference_statistics(model)

    def load(self, model: str, config: dict[str, Any] | str | None = None) -> None:
        """Load `model`, or reload it with `config` (Triton's JSON config, as a dict or text); Triton
        keeps serving the old instances until the new ones are ready."""
        text = json.dumps(config) if isinstance(config, dict) else config
        with self._client() as client:
            client.load_model(model, headers=self.admin_headers, config=text)

    def unload(self, model: str) -> None:
        with self._client() as client:
            client.unload_model(model, headers=self.admin_headers)

    def is_server_live(self) -> bool:
        """Whether `/v2/health/live` answers 200; a ControlError when nothing answers."""
        with self._client() as client:
            return client.is_server_live()

    def is_server_ready(self) -> bool:
        """Whether the server and all its models are ready; False while it cannot be reached."""
        try:
            with self._client() as client:
                return client.is_server_ready()
        except ControlError:
            return False

    def is_model_ready(self, model: str, version: int | str = "") -> bool:
        """Whether `version` of `model` (by default, the one the server picks) is ready; False when unknown."""
        try:
            with self._client() as client:
                return client.is_model_ready(model, str(version))
        except ControlError:
            return False
