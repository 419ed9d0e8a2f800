"""Launch and stop the tritonserver 2.51 that ships inside the `nvidia-pytriton` wheel.

No Docker: the wheel carries the server binary, its shared libraries
(`nvidia_pytriton.libs`), the Python backend, and one backend stub per Python version.
`prepare_backends` copies the backend with the stub for the running interpreter into a
build folder; `build_command` / `build_env` are pure; `TritonServer` owns the process. Its
stub processes (CPU by model, shared-memory regions) are read by `tools.server.stubs`, its
readiness asked through `tools.server.control`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.common.shared_files import shared_dir, sweep_stale
from tools.paths import DEFAULT_MODEL_REPOSITORY, REPO_ROOT
from tools.server.admin_key import restricted_api_args
from tools.server.control import ServerControl
from tools.server.stubs import STUB_BINARY, cpu_by_part, process_group, shm_regions

DEFAULT_BUILD_DIR = REPO_ROOT / "build" / "triton"
# RE2, matched against header names: `tenant` and `tenant-token` reach the models as request
# parameters of the same names, and `x-request-start` (when a proxy or the client accepted the
# request: `python_backends.common.request_start`). Nothing else is forwarded (an
# `authorization` header belongs to whatever proxy sits in front, not to the tenant).
FORWARDED_HEADER_PATTERN = "(?i)^(tenant(-token)?|x-request-start)$"


class ServerError(RuntimeError):
    """tritonserver could not be found, started, or made ready; the message says why."""


class ModelControlMode(StrEnum):
    NONE = "none"  # load everything at start, never change
    POLL = "poll"  # reload when the repository changes on disk
    EXPLICIT = "explicit"  # load / unload only through the repository API


@dataclass(frozen=True)
class TritonDistribution:
    """Where the wheel's server parts are."""

    binary: Path  # tritonserver executable
    libs_dir: Path  # bundled shared libraries (LD_LIBRARY_PATH)
    backends_dir: Path  # backends/ with python/libtriton_python.so
    stub: Path  # triton_python_backend_stub for this Python version


def find_distribution(python_version: str | None = None, triton_home: Path | None = None) -> TritonDistribution:
    """Locate tritonserver inside the installed `nvidia-pytriton` wheel, or the server of a
    Triton installation at `triton_home` (the 24.10 container's /opt/tritonserver, the same
    2.51 release) with the wheel's Python backend stub for this interpreter: the container's
    own stub embeds its Python 3.10."""
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    try:
        import pytriton
    except ImportError:
        raise ServerError(
            "nvidia-pytriton is not installed in this environment, so there is no tritonserver binary; "
            "run `make setup` (or `pip install nvidia-pytriton==0.7.0`)"
        ) from None
    package_dir = Path(pytriton.__file__).resolve().parent
    dist_dir = package_dir / "tritonserver"
    dist = TritonDistribution(
        binary=dist_dir / "bin" / "tritonserver",
        libs_dir=package_dir.parent / "nvidia_pytriton.libs",
        backends_dir=dist_dir / "backends",
        stub=dist_dir / "python_backend_stubs" / version / STUB_BINARY,
    )
    for what, path in (("tritonserver binary", dist.binary), ("Python backend", dist.backends_dir / "python"),
                       ("bundled libraries", dist.libs_dir)):
        if not path.exists():
            raise ServerError(f"{what} not found at {path}; reinstall nvidia-pytriton==0.7.0")
    if not dist.stub.is_file():
        available = sorted(p.name for p in (dist_dir / "python_backend_stubs").iterdir())
        raise ServerError(f"no Python backend stub for Python {version} in the wheel (it has {available})")
    if triton_home is None:
        return dist
    home = Path(triton_home)
    installed = TritonDistribution(binary=home / "bin" / "tritonserver", libs_dir=home / "lib",
                                   backends_dir=home / "backends", stub=dist.stub)
    for what, path in (("tritonserver binary", installed.binary),
                       ("Python backend", installed.backends_dir / "python")):
        if not path.exists():
            raise ServerError(f"{what} not found at {path}: is {home} a Triton installation (e.g. /opt/tritonserver)?")
    return installed


def prepare_backends(dist: TritonDistribution, build_dir: Path = DEFAULT_BUILD_DIR) -> Path:
    """A backend directory whose Python backend carries the stub for this interpreter.

    Copied into place and renamed atomically, so concurrent servers never see a half copy.
    """
    target = build_dir / "backends"
    stub_target = target / "python" / STUB_BINARY
    if stub_target.is_file() and stub_target.stat().st_size == dist.stub.stat().st_size:
        return target
    build_dir.mkdir(parents=True, exist_ok=True)
    staging = build_dir / f"backends.tmp{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(dist.backends_dir, staging, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(dist.stub, staging / "python" / STUB_BINARY)
    shutil.rmtree(target, ignore_errors=True)
    try:
        staging.rename(target)
    except OSError:  # another process won the race; its copy is as good as ours
        shutil.rmtree(staging, ignore_errors=True)
    return target


@dataclass(frozen=True)
class GrpcTls:
    """The server's certificate and private key (PEM files) for gRPC over TLS."""

    cert: Path
    key: Path

    def check(self) -> None:
        for what, path in (("certificate", self.cert), ("private key", self.key)):
            if not path.is_file():
                raise ServerError(f"the gRPC TLS {what} {path} does not exist")


@dataclass(frozen=True)
class ServerConfig:
    """How to run tritonserver."""

    model_repository: Path = DEFAULT_MODEL_REPOSITORY
    # Users' own repositories served beside it (external models of the spec); a model name must
    # be unique across all of them.
    extra_repositories: tuple[Path, ...] = ()
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "0.0.0.0"  # address the endpoints bind to
    model_control_mode: ModelControlMode = ModelControlMode.NONE
    load_models: tuple[str, ...] = ()  # with explicit mode: models to load at start
    log_verbose: int = 0  # tritonserver --log-verbose level
    exit_timeout_s: int = 30  # how long tritonserver lets in-flight requests finish on stop
    # Python backend shared memory per stub process (it grows on demand). Small, because
    # containers often give /dev/shm only 64 MB and every model instance takes a region.
    python_shm_default_bytes: int = 4 * 1024 * 1024
    pinned_memory_bytes: int = 0  # CUDA pinned host memory pool; 0 where there is no GPU
    # With a key, the control endpoints (tools.server.admin_key.RESTRICTED_APIS) answer only requests
    # carrying it; without one they are open to anyone who reaches the ports.
    admin_key: str | None = field(default=None, repr=False)
    grpc_tls: GrpcTls | None = None  # serve gRPC over TLS with this certificate
    extra_args: tuple[str, ...] = field(default=())  # passed through verbatim

    @property
    def ports(self) -> dict[str, int]:
        return {"HTTP": self.http_port, "gRPC": self.grpc_port, "metrics": self.metrics_port}


def build_command(config: ServerConfig, dist: TritonDistribution, backends_dir: Path,
                  auto_complete: bool = True) -> list[str]:
    """The tritonserver command line for `config`; `auto_complete=False` turns Triton's config
    auto-completion off (`auto_complete_needed` says when it may be)."""
    command = [
        str(dist.binary),
        f"--model-repository={config.model_repository}",
        *(f"--model-repository={repository}" for repository in config.extra_repositories),
        f"--backend-directory={backends_dir}",
        f"--http-address={config.host}",
        f"--http-port={config.http_port}",
        f"--grpc-address={config.host}",
        f"--grpc-port={config.grpc_port}",
        f"--metrics-address={config.host}",
        f"--metrics-port={config.metrics_port}",
        "--allow-metrics=true",
        "--allow-cpu-metrics=true",
        f"--model-control-mode={config.model_control_mode.value}",
        f"--log-verbose={config.log_verbose}",
        f"--exit-timeout-secs={config.exit_timeout_s}",
        f"--backend-config=python,shm-default-byte-size={config.python_shm_default_bytes}",
        # 0 without a GPU: skip the pinned-memory pool instead of warning about it.
        f"--pinned-memory-pool-byte-size={config.pinned_memory_bytes}",
        # `tenant` and `tenant-token` headers reach the models as request parameters.
        f"--http-header-forward-pattern={FORWARDED_HEADER_PATTERN}",
        f"--grpc-header-forward-pattern={FORWARDED_HEADER_PATTERN}",
    ]
    if config.model_control_mode is ModelControlMode.POLL:
        command.append("--repository-poll-secs=5")
    command += [f"--load-model={name}" for name in config.load_models]
    if not auto_complete:
        command.append("--disable-auto-complete-config")
    if config.admin_key:
        command += restricted_api_args(config.admin_key)
    if config.grpc_tls is not None:
        # Triton's HTTP front end has no TLS: put a TLS-terminating proxy before the HTTP port.
        command += ["--grpc-use-ssl=true", f"--grpc-server-cert={config.grpc_tls.cert}",
                    f"--grpc-server-key={config.grpc_tls.key}"]
    command += list(config.extra_args)
    return command


def auto_complete_needed(config: ServerConfig) -> bool:
    """Whether a model the server may load needs Triton to complete its config.

    Loading a Python model with auto-completion on starts one more stub process per model
    version, only to ask its `TritonPythonModel` for an `auto_complete_config`: a server
    loading the kit's repository (24 stubs) was ready in 7.6 s instead of 14.5 s on 2 vCPU
    without it, and a single bucket model in 1.8 s instead of 3.3 s. The kit writes every
    field of its configs and its models define no `auto_complete_config`, so it stays on only
    where that is not known: a user's repository served beside the kit's (an ONNX model's
    config may leave its tensors to Triton), a model folder without a config.pbtxt, a backend
    other than Python, or a `model.py` that defines the method.
    """
    if config.extra_repositories:
        return True
    for folder in sorted(config.model_repository.iterdir()):
        if not folder.is_dir() or folder.name.startswith("."):
            continue
        config_path = folder / "config.pbtxt"
        if not config_path.is_file():
            return True
        try:
            model_config = text_format.Parse(config_path.read_text(), mc.ModelConfig())
        except (text_format.ParseError, UnicodeDecodeError):
            return True  # Triton says what is wrong with it; with the same settings as always
        if model_config.backend != "python":
            return True
        scripts = folder.glob("*/model.py")
        if any("def auto_complete_config" in script.read_text(errors="replace") for script in scripts):
            return True
    return False


# How long an idle OpenMP worker of a stub spins before it sleeps (libgomp's default is
# 300,000 spins). The LLM engine's forward pass runs on OpenMP workers that share the cores
# with the stub's I/O thread, the server and often a client: a worker spinning while its
# partner thread is descheduled or in Python keeps a core from them, so (likely) they preempt
# the forward pass instead. Saturated closed loops on 2 vCPU (120 streams, three pairs of
# whole runs in alternating order): 524.7 vs 506.8, 520.7 vs 483.8 and 540.7 vs 521.3
# tokens/s with 10,000 spins against the default. Passive waiting (no spin) was far slower.
STUB_OMP_SPINCOUNT = "10000"


def build_env(dist: TritonDistribution, base_env: Mapping[str, str], repo_root: Path = REPO_ROOT) -> dict[str, str]:
    """Environment for tritonserver and its Python backend stubs.

    - LD_LIBRARY_PATH: the wheel's bundled libraries, and the running interpreter's
      libpython (the stub embeds it; without this the system's libpython may be taken).
    - PATH: this interpreter's bin first, so the embedded Python finds this environment's
      site-packages (the stub resolves its prefix from `python3` on PATH).
    - PYTHONPATH: the repository root, so `model.py` files import `python_backends`.
    """
    env = dict(base_env)
    lib_dirs = [str(dist.libs_dir)]
    libpython_dir = sysconfig.get_config_var("LIBDIR")
    if libpython_dir:
        lib_dirs.append(libpython_dir)
    if env.get("LD_LIBRARY_PATH"):
        lib_dirs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_dirs)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    python_path = [str(repo_root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(python_path)
    # Keep ONNX Runtime / tokenizers thread pools from each spawning one thread per core
    # in every stub process; models set their own thread counts.
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GOMP_SPINCOUNT", STUB_OMP_SPINCOUNT)
    return env


def busy_ports(ports: Mapping[str, int], host: str = "0.0.0.0") -> dict[str, int]:
    """The ports of `ports` that something already listens on."""
    taken = {}
    for name, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # As tritonserver binds: connections lingering in TIME_WAIT do not count,
            # a live listener does.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as err:
                if err.errno in (errno.EADDRINUSE, errno.EACCES):
                    taken[name] = port
                else:
                    raise
    return taken


def free_port() -> int:
    """A TCP port nobody listens on right now (for tests and side-by-side servers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_group_cpu_by_part(pgid: int) -> dict[str, float]:
    """CPU seconds used so far by the live processes of a server's process group, by part:
    `tritonserver` (the server process, whose pid is the group id) and one entry per model
    (all of its Python backend stubs); other members of the group count as `other`."""
    return cpu_by_part(process_group(pgid), pgid)


def process_group_shm_regions(pgid: int) -> set[str]:
    """The shared-memory regions of the Python backend stubs now in process group `pgid`."""
    return shm_regions(process_group(pgid), pgid)


def remove_shm_regions(names: Iterable[str], shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """Unlink the regions still present; the names removed. A server that exits cleanly
    unlinks its stubs' regions itself; one that gives up at its exit timeout, or is killed,
    leaves them behind (4 MiB or more each, in memory, until the machine restarts)."""
    removed = []
    for name in sorted(names):
        with contextlib.suppress(FileNotFoundError):
            (shm_dir / name).unlink()
            removed.append(name)
    return removed


def process_group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds used so far by the live processes of one process group
    (tritonserver and its Python backend stubs)."""
    return float(sum(process_group_cpu_by_part(pgid).values()))


def _detach_and_die_with_parent() -> None:
    """Runs in the child before exec: own process group (so stop() reaches the Python
    backend stubs too), and SIGTERM when the launching process dies, so a killed CLI or
    test run never leaves a server holding the ports."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class TritonServer:
    """One tritonserver process: `start()`, `wait_ready()`, `stop()`; also a context manager."""

    def __init__(self, config: ServerConfig, log_path: Path | None = None, dist: TritonDistribution | None = None):
        self.config = config
        self.dist = dist or find_distribution()
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file = None
        self._shm_regions: set[str] = set()  # of every stub seen, removed at stop() if the server left them

    @property
    def http_url(self) -> str:
        return f"localhost:{self.config.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.config.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.config.metrics_port}/metrics"

    def cpu_seconds(self) -> float:
        """CPU seconds the server and its backend stubs have used so far (they share a process group)."""
        assert self.process is not None, "start() first"
        return process_group_cpu_seconds(self.process.pid)

    def cpu_seconds_by_part(self) -> dict[str, float]:
        """The same, split into the server process and each model's backend stubs."""
        assert self.process is not None, "start() first"
        return process_group_cpu_by_part(self.process.pid)

    def start(self) -> None:
        for repository in (self.config.model_repository, *self.config.extra_repositories):
            if not repository.is_dir():
                raise ServerError(f"model repository {repository} does not exist")
        taken = busy_ports(self.config.ports, self.config.host)
        if taken:
            listing = ", ".join(f"{name} port {port}" for name, port in taken.items())
            raise ServerError(
                f"{listing} already in use (another tritonserver?); stop it or choose other ports "
                "with --http-port / --grpc-port / --metrics-port"
            )
        if self.config.grpc_tls is not None:
            self.config.grpc_tls.check()
        backends_dir = prepare_backends(self.dist)
        command = build_command(self.config, self.dist, backends_dir, auto_complete_needed(self.config))
        env = build_env(self.dist, os.environ)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            command,
            env=env,
            # The Python backend stub's sys.path starts with the working directory and leaves out
            # PYTHONPATH: run in the kit's root, so that a server started from a user's folder
            # runs this kit's `python_backends`, not whichever copy is installed.
            cwd=REPO_ROOT,
            stdout=self._log_file if self._log_file else None,
            stderr=subprocess.STDOUT if self._log_file else None,
            preexec_fn=_detach_and_die_with_parent,
        )

    def is_ready(self) -> bool:
        """Whether the server and all its models are ready (`/v2/health/ready`); False while it cannot be reached."""
        return ServerControl(self.http_url, timeout_s=2).is_server_ready()

    def wait_ready(self, timeout_s: float = 300.0, on_wait=None) -> None:
        """Block until the server and all its models are ready; raise with the log tail on failure."""
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(
                    f"tritonserver exited with code {self.process.returncode} before it was ready"
                    f"{self._log_tail()}"
                )
            if self.is_ready():
                self._shm_regions |= process_group_shm_regions(self.process.pid)
                return
            if on_wait is not None:
                on_wait(deadline - time.monotonic())
            time.sleep(0.5)
        raise ServerError(f"tritonserver not ready after {timeout_s:.0f} s{self._log_tail()}")

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM, let in-flight requests finish, then SIGKILL the group if still running."""
        if self.process is None:
            return None
        grace = timeout_s if timeout_s is not None else self.config.exit_timeout_s + 5
        if self.process.poll() is None:
            self._shm_regions |= process_group_shm_regions(self.process.pid)
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace)
        # The stubs exit with their server; kill any straggler in the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        code = self.process.wait()
        # Its routers' shared files are of no use to any later server: remove them now rather
        # than at the next server's start (`python_backends.common.shared_files`).
        sweep_stale(shared_dir())
        # So are its stubs' shared-memory regions, which a server that ran out of its exit
        # timeout (a client holding a connection open) or was killed did not unlink.
        remove_shm_regions(self._shm_regions)
        self._shm_regions.clear()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def _log_tail(self, num_lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        interesting = [line for line in lines if line.strip() and not line.startswith(("+", "|"))]
        return "\n--- tritonserver log (last lines) ---\n" + "\n".join(interesting[-num_lines:])

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def model_names(repository: Path) -> Sequence[str]:
    """Models in a repository: folders holding a config.pbtxt."""
    return sorted(p.parent.name for p in repository.glob("*/config.pbtxt"))
