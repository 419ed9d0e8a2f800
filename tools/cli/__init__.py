"""One entry point, one subcommand per job. Each subcommand module exposes
`add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from tools.cli import (
    admin_key,
    autoscale,
    batch,
    bench,
    build_models,
    capacity,
    explain,
    gen_config,
    profile,
    report,
    rollout,
    serve,
    sweep,
    tenant_token,
    top,
)

# verb -> its module in tools/cli/, named as the verb
COMMANDS = {
    "serve": serve,
    "build-models": build_models,
    "profile": profile,
    "gen-config": gen_config,
    "sweep": sweep,
    "bench": bench,
    "report": report,
    "rollout": rollout,
    "top": top,
    "explain": explain,
    "autoscale": autoscale,
    "capacity": capacity,
    "batch": batch,
    "admin-key": admin_key,
    "tenant-token": tenant_token,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools",
        description="Serve and operate the model repository on Triton Inference Server.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        summary = (module.__doc__ or "").strip().splitlines()[0]
        sub = subparsers.add_parser(name, help=summary, description=module.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)
