"""The examples the docs show, extracted so that the suite runs them as written.

The convention, for README.md and docs/*.md:
- a ```console block is a shell session, run in one bash process (so a variable set by one
  command is there for the next): each `$ ` line is a command (a line ending in `\\` goes on
  to the next), the lines up to the next `$ ` are its expected stdout, compared as doctest
  does with ELLIPSIS and NORMALIZE_WHITESPACE (`...` stands for any text, blank lines and
  runs of spaces do not matter). Every command must exit 0.
- a ```pycon block is a doctest session (`>>> ` lines and their expected output).
- either runs offline (the unit tests) unless the line before its fence says where it runs:
  `<!-- run: server -->`, against the integration tests' tritonserver, with `localhost:8000`,
  `:8001` and `:8002` replaced by its HTTP, gRPC and metrics ports; `<!-- run: batch -->`,
  against a batch API (`python -m tools batch serve`) in front of that server, with
  `localhost:8080` replaced by the API's port too (`--port N` is substituted like
  `localhost:N`; the LLM API's shown port is 9000).
- a ```bash block shows commands that start servers, run for minutes or wait for another
  process: an integration test runs each as written, its own way (it starts the server,
  waits for it, makes its requests and stops it), taking the command from the docs with
  `shown(document, command)`, so that the two cannot drift apart. Such a test may point a
  command at its own server or make a run shorter only through what the shown command leaves
  to the environment (make variables such as `SERVE_ARGS`, Locust's `LOCUST_*` variables), by
  substituting ports as above, by standing in for a placeholder host (`queue-host`), or by
  running it in a scratch folder where what it writes under `build/` stays out of the
  checkout. A command is a line (one ending in `\\` goes on to the next, joined by one
  space) without its trailing `  # comment`; lines that are only comments are prose.
  tests/unit/test_docs.py fails when a shown command is taken by no test; every
  `python -m tools ...` must also parse with the real CLI and every `make TARGET` name a
  target of the Makefile.
- ```text, ```toml and ```json blocks are output or file contents, never run. No other
  language is allowed, so that no example escapes the checks.
"""

from __future__ import annotations

import doctest
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from tools.server.triton_server import busy_ports

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
RUN_MARKER = re.compile(r"<!-- run: (?P<where>server|batch) -->")
LANGUAGES = {"console", "pycon", "bash", "text", "toml", "json"}
DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002, "batch": 8080, "llm_api": 9000}
SEPARATOR = "@@doc-example-exit"
CHECKER = doctest.OutputChecker()
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[a-z]*)\n(?P<body>.*?)^(?P=indent)```$", re.DOTALL | re.MULTILINE)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    body: str
    runs_on: str  # "offline", "server" or "batch"

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


@dataclass(frozen=True)
class Command:
    block: Block
    command: str
    expected: str


def blocks(paths: tuple[Path, ...] = DOCUMENTS) -> list[Block]:
    found = []
    for path in paths:
        text = path.read_text()
        for match in FENCE.finditer(text):
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            indent = match["indent"]
            body = "\n".join(line[len(indent):] for line in match["body"].splitlines())
            marker = RUN_MARKER.fullmatch(before)
            found.append(Block(path, text.count("\n", 0, match.start()) + 1, match["lang"], body,
                               marker["where"] if marker else "offline"))
    return found


def console_commands(block: Block) -> list[Command]:
    commands: list[Command] = []
    command: list[str] = []
    expected: list[str] = []
    continuing = False
    for line in block.body.splitlines():
        if continuing:
            command.append(line)
            continuing = line.endswith("\\")
        elif line.startswith("$ "):
            if command:
                commands.append(Command(block, "\n".join(command), "\n".join(expected)))
            command, expected = [line[2:]], []
            continuing = line.endswith("\\")
        elif command:
            expected.append(line)
        else:
            raise AssertionError(f"{block.where}: a console block starts with a `$ ` command")
    if command:
        commands.append(Command(block, "\n".join(command), "\n".join(expected)))
    return commands


def bash_commands(block: Block) -> list[str]:
    """A ```bash block's commands: its logical lines (continuations joined by one space)
    without their trailing comments."""
    lines = (re.split(r"\s{2,}# |^# ", line, maxsplit=1)[0].rstrip()
             for line in re.sub(r"\s*\\\n\s*", " ", block.body).splitlines())
    return [line for line in lines if line]


def shown_commands(document: str) -> list[str]:
    """Every command the ```bash blocks of `document` (a path from the repository root) show."""
    return [c for b in blocks((REPO / document,)) if b.language == "bash" for c in bash_commands(b)]


def shown(document: str, command: str) -> str:
    """`command`, failing unless `document` shows it word for word in a ```bash block: an
    integration test that runs a shown command takes it from here (tests/unit/test_docs.py
    finds these calls, so every shown command must be taken by a test)."""
    commands = shown_commands(document)
    if command not in commands:
        raise AssertionError(f"{document} does not show `{command}`; its commands: {commands}")
    return command


def shell(command: str, ports: dict[str, int] | None = None, **env: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run a shown command as a reader's shell would (ports
    substituted; `env` adds variables the command leaves to the environment)."""
    return ["bash", "-c", with_ports(command, ports)], {**environment(), **env}


def run_shown(command: str, cwd: Path = REPO, ports: dict[str, int] | None = None, timeout_s: float = 120,
              **env: str) -> subprocess.CompletedProcess:
    """Run a shown command to its end in `cwd` (ports substituted, `env` added), capturing
    its output; the caller judges its exit code."""
    argv, environ = shell(command, ports, **env)
    return subprocess.run(argv, cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout_s)


def require_free(ports: Mapping[str, int]) -> None:
    """Fail, saying what to stop, when a port a shown command listens on (as shown) is taken:
    `ports` maps each command to its port."""
    for command, port in busy_ports(ports).items():
        pytest.fail(f"port {port} is in use, and `{command}` listens on it as shown: stop what listens there "
                    "(a `make serve`?) and run the test again")


def setup_problem() -> str | None:
    """Why a shown `make` command must not run here, or None. Every make target first brings
    the environment up to date with the pins (`make setup`), which installs the kit editable
    from this checkout: harmless when it is this checkout's environment already, but an
    environment shared with another checkout would be re-pointed here."""
    if subprocess.run(["make", "-q", "setup"], cwd=REPO, capture_output=True).returncode == 0:
        return None
    url = json.loads(importlib.metadata.distribution("triton-slo-kit").read_text("direct_url.json") or "{}")
    if url.get("url") == REPO.as_uri():
        return None
    return (f"`make` would re-install the kit, which .venv has from {url.get('url')}, from {REPO}: "
            "run `make setup` in the checkout that owns .venv")


def with_ports(text: str, ports: dict[str, int] | None) -> str:
    for name, port in (ports or {}).items():
        text = text.replace(f"localhost:{DEFAULT_PORTS[name]}", f"localhost:{port}")
        text = text.replace(f"--port {DEFAULT_PORTS[name]}", f"--port {port}")
    return text


def environment() -> dict[str, str]:
    """The shell a reader has after `source .venv/bin/activate`, in a wide terminal; from any
    folder (a scratch one too) `python -m tools` is this checkout's kit."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    env["COLUMNS"] = "120"
    env.pop("TRITON_ADMIN_KEY", None)
    return env


def run_console(block: Block, ports: dict[str, int] | None = None, timeout_s: float = 120) -> list[str]:
    """Run a console block's commands as written (ports substituted) in one bash process, and
    fail unless each exits 0 and prints what the docs show. Returns each command's stdout."""
    commands = console_commands(block)
    script = "".join(f"{with_ports(c.command, ports)}\nprintf '\\n{SEPARATOR} %d\\n' $?\n" for c in commands)
    result = subprocess.run(["bash", "-c", script], cwd=REPO, env=environment(), capture_output=True,
                            text=True, timeout=timeout_s)
    chunks = re.split(rf"\n{SEPARATOR} (\d+)\n", result.stdout)
    outputs = []
    for index, command in enumerate(commands):
        if 2 * index + 1 >= len(chunks):
            raise AssertionError(f"{block.where}: `{command.command}` did not finish\n{result.stderr[-2000:]}")
        stdout, status = chunks[2 * index], int(chunks[2 * index + 1])
        assert status == 0, f"{block.where}: `{command.command}` exited {status}\n{result.stderr[-2000:]}"
        want = with_ports(command.expected, ports) + "\n"
        if not CHECKER.check_output(want, stdout, OPTIONS):
            raise AssertionError(f"{block.where}: `{command.command}` printed what the docs do not show\n"
                                 + CHECKER.output_difference(doctest.Example(command.command, want), stdout, OPTIONS))
        outputs.append(stdout)
    return outputs


def run_pycon(block: Block, ports: dict[str, int] | None = None) -> None:
    """Run a pycon block as a doctest (ports substituted), failing on any mismatch."""
    body = with_ports(block.body, ports)
    test = doctest.DocTestParser().get_doctest(body, {}, block.where, str(block.path), block.line)
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    output: list[str] = []
    runner.run(test, out=output.append)
    assert runner.failures == 0, f"{block.where}: the example does not do what the docs show\n" + "".join(output)
