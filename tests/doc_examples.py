"""The examples the docs show, extracted so that the suite runs them as written.

The convention, for README.md and docs/*.md:
- a ```console block is a session: each `$ ` line is a command (a line ending in `\\` goes on
  to the next), the lines up to the next `$ ` are its expected stdout, compared as doctest
  does with ELLIPSIS and NORMALIZE_WHITESPACE (`...` stands for any text, blank lines and
  runs of spaces do not matter). A command must exit 0.
- a ```pycon block is a doctest session (`>>> ` lines and their expected output).
- either runs offline (the unit tests) unless the line before its fence is
  `<!-- run: server -->`: then the integration tests run it against their tritonserver,
  with `localhost:8000`, `:8001` and `:8002` replaced by that server's HTTP, gRPC and metrics
  ports.
- a ```bash block shows commands that are not run here (they start servers, run for minutes
  or change state); every `python -m tools ...` in it must parse with the real CLI, and
  every `make TARGET` must name a target of the Makefile.
- ```text, ```toml and ```json blocks are output or file contents, never run. No other
  language is allowed, so that no example escapes the checks.
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
RUN_MARKER = "<!-- run: server -->"
LANGUAGES = {"console", "pycon", "bash", "text", "toml", "json"}
DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
CHECKER = doctest.OutputChecker()
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[a-z]*)\n(?P<body>.*?)^(?P=indent)```$", re.DOTALL | re.MULTILINE)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    body: str
    needs_server: bool

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
            found.append(Block(path, text.count("\n", 0, match.start()) + 1, match["lang"], body,
                               before == RUN_MARKER))
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


def with_ports(text: str, ports: dict[str, int]) -> str:
    for name, default in DEFAULT_PORTS.items():
        text = text.replace(f"localhost:{default}", f"localhost:{ports[name]}")
    return text


def environment() -> dict[str, str]:
    """The shell a reader has after `source .venv/bin/activate`, in a wide terminal."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["COLUMNS"] = "120"
    env.pop("TRITON_ADMIN_KEY", None)
    return env


def run_command(command: Command, ports: dict[str, int] | None = None, timeout_s: float = 120) -> str:
    """Run one console command as written (ports substituted), and fail unless it exits 0 and
    its stdout matches what the docs show. Returns the stdout."""
    shell = with_ports(command.command, ports) if ports else command.command
    result = subprocess.run(["bash", "-c", shell], cwd=REPO, env=environment(), capture_output=True,
                            text=True, timeout=timeout_s)
    assert result.returncode == 0, (
        f"{command.block.where}: `{command.command}` exited {result.returncode}\n{result.stderr[-2000:]}")
    want = with_ports(command.expected, ports) if ports else command.expected
    if not CHECKER.check_output(want + "\n", result.stdout, OPTIONS):
        raise AssertionError(f"{command.block.where}: `{command.command}` printed what the docs do not show\n"
                             + CHECKER.output_difference(doctest.Example(command.command, want + "\n"),
                                                         result.stdout, OPTIONS))
    return result.stdout


def run_pycon(block: Block, ports: dict[str, int] | None = None) -> None:
    """Run a pycon block as a doctest (ports substituted), failing on any mismatch."""
    body = with_ports(block.body, ports) if ports else block.body
    test = doctest.DocTestParser().get_doctest(body, {}, block.where, str(block.path), block.line)
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    output: list[str] = []
    runner.run(test, out=output.append)
    assert runner.failures == 0, f"{block.where}: the example does not do what the docs show\n" + "".join(output)
