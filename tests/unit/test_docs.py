"""The docs as a reader meets them: every example they show runs as written (the convention is
in tests/doc_examples.py; requests to a server are run by tests/integration/test_docs_requests.py),
every command they only show parses, every link leads somewhere, and the benchmark tables agree
with the result files."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex

import pytest

from tests.doc_examples import DOCUMENTS, LANGUAGES, REPO, bash_commands, blocks, run_console, run_pycon, shown
from tools.cli import build_parser
from tools.cli import main as cli_main

BLOCKS = blocks()
OFFLINE_CONSOLE = [b for b in BLOCKS if b.language == "console" and b.runs_on == "offline"]
OFFLINE_PYCON = [b for b in BLOCKS if b.language == "pycon" and b.runs_on == "offline"]
BASH_LINES = [(b, line) for b in BLOCKS if b.language == "bash"
              for line in b.body.replace("\\\n", " ").splitlines()]
TOOLS_CALL = re.compile(r"(?:\.venv/bin/)?python -m tools (?P<args>[^|;&)\n]*)")
MAKE_CALL = re.compile(r"(?:^|[;&(]\s*)make (?P<target>[a-z][a-z-]*)")


def test_every_example_uses_a_checked_language():
    unknown = [f"{b.where}: ```{b.language}" for b in BLOCKS if b.language not in LANGUAGES]
    assert not unknown, f"fences the doc checks do not know (use one of {sorted(LANGUAGES)}): {unknown}"


def test_the_docs_run_examples_of_both_kinds():
    assert OFFLINE_CONSOLE, "no offline console example found"
    assert {b.runs_on for b in BLOCKS} >= {"server", "batch"}, "no example against a server or the batch API"


@pytest.mark.parametrize("block", OFFLINE_CONSOLE, ids=lambda b: b.where)
def test_offline_commands_run_as_shown(block):
    run_console(block)


def test_offline_python_examples_run_as_shown():
    for block in OFFLINE_PYCON:
        run_pycon(block)


@pytest.mark.parametrize(("block", "line"), [(b, line) for b, line in BASH_LINES if TOOLS_CALL.search(line)],
                         ids=lambda x: x.where if hasattr(x, "where") else "")
def test_shown_tools_command_parses(block, line):
    parser = build_parser()
    for match in TOOLS_CALL.finditer(line):
        args = shlex.split(match["args"], comments=True)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            try:
                parser.parse_args(args)
            except SystemExit as exit_:
                assert exit_.code == 0, f"{block.where}: `python -m tools {match['args'].strip()}`: {stderr.getvalue()}"


def _taken_commands() -> dict[tuple[str, str], str]:
    """Every `shown(document, command)` call in the tests, with where it is."""
    taken = {}
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "shown"
                    and len(node.args) == 2 and all(isinstance(a, ast.Constant) for a in node.args)):
                taken[(node.args[0].value, node.args[1].value)] = f"{path.relative_to(REPO)}:{node.lineno}"
    return taken


def test_every_shown_command_is_run_by_a_test():
    taken = _taken_commands()
    shown_here = {(str(b.path.relative_to(REPO)), command): b.where for b in BLOCKS if b.language == "bash"
                  for command in bash_commands(b)}
    untaken = [f"{where}: {command}" for (_, command), where in shown_here.items() if (_, command) not in taken]
    assert not untaken, f"commands the docs show that no test runs (take them with shown(...)): {untaken}"
    stale = [f"{where}: shown({document!r}, {command!r})" for (document, command), where in taken.items()
             if (document, command) not in shown_here]
    assert not stale, f"tests take commands the docs no longer show: {stale}"


def test_ci_runs_the_readme_test_command():
    """`.ci/run` is the README's test command, as written."""
    command = shown("README.md", "make test")
    lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[-1] == f"exec {command}", lines


def test_shown_make_targets_exist():
    targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), re.MULTILINE))
    missing = [f"{b.where}: make {m['target']}" for b, line in BASH_LINES for m in MAKE_CALL.finditer(line)
               if m["target"] not in targets]
    assert not missing, f"make targets the Makefile lacks: {missing}"


def test_shown_loadtest_options_exist():
    """`make loadtest LOADTEST_ARGS="..."` passes options to the locustfile: each must be one
    that loadtest/run.py adds with `option(...)` (Locust's own are not shown in LOADTEST_ARGS)."""
    declared = set(re.findall(r'option\("(--[a-z-]+)"', (REPO / "loadtest" / "run.py").read_text()))
    shown = {(b.where, option) for b, line in BASH_LINES for args in re.findall(r'LOADTEST_ARGS="([^"]*)"', line)
             for option in re.findall(r"--[a-z-]+", args)}
    assert shown, "no LOADTEST_ARGS example found"
    missing = sorted(f"{where}: {option}" for where, option in shown if option not in declared)
    assert not missing, f"load-test options the locustfile does not declare: {missing}"


def _anchors(path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_relative_links_lead_somewhere():
    broken = []
    for path in DOCUMENTS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            linked = (path.parent / target) if target else path
            if not linked.exists():
                broken.append(f"{path.relative_to(REPO)}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{path.relative_to(REPO)}: {target}#{anchor} (no such heading)")
    assert not broken, f"links that lead nowhere: {broken}"


def test_readme_stays_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_benchmark_tables_agree_with_the_result_files(capsys):
    assert cli_main(["report", "--check"]) == 0, capsys.readouterr().err
