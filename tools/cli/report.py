"""Render the benchmark tables of the docs from results/*.json.

Rewrites the sections between `<!-- report:NAME -->` and `<!-- /report:NAME -->` in
docs/benchmarks.md (every benchmark's table, its command, hardware and plot) and README.md
(the headline table), so that no figure in the docs is typed by hand. `--check` writes
nothing and exits 1 when a document disagrees with the result files (the test suite runs it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.bench.report import Document, ReportError, load_results, update_documents
from tools.paths import REPO_ROOT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a document disagrees with the result files")
    parser.add_argument("--results", type=Path, default=REPO_ROOT / "results",
                        help="folder of the result files (default results/)")
    parser.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md",
                        help="the README, with the headline table (default README.md)")
    parser.add_argument("--benchmarks", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md",
                        help="the benchmark document (default docs/benchmarks.md)")


def run(args: argparse.Namespace) -> int:
    documents = (
        Document(args.readme, ("headline",), "results/"),
        Document(args.benchmarks, ("goodput", "goodput_models", "goodput_mixes", "derivation", "llm",
                                   "overload", "batch", "loadtest_step"), "../results/"),
    )
    try:
        problems = update_documents(documents, load_results(args.results), check=args.check)
    except ReportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        if args.check:
            print("run `python -m tools report` to render the sections from the result files", file=sys.stderr)
        return 1
    if args.check:
        print("the docs agree with the result files")
    else:
        print("rendered " + ", ".join(str(document.path) for document in documents))
    return 0
