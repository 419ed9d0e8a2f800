"""One entry point, one subcommand per job. Each subcommand module exposes
`add_arguments(parser)` and `run(args) -> int`; its docstring is its --help text. A command
that prints what a policy module decides names that module as `EXPLAINED_BY`: its --help
then tells the policy in the policy module's own words (all but the docstring's last
paragraph, which speaks of code), followed by the command's examples, so the text is kept
once."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from types import ModuleType

from tools.cli import (
    add_model,
    admin_key,
    autoscale,
    batch,
    bench,
    build_models,
    capacity,
    explain,
    gen_config,
    llm_api,
    profile,
    report,
    rollout,
    search,
    serve,
    sweep,
    tenant_token,
    top,
    tune,
    vllm_config,
)

# verb -> its module in tools/cli/, named as the verb
COMMANDS = {
    "serve": serve,
    "build-models": build_models,
    "add-model": add_model,
    "profile": profile,
    "gen-config": gen_config,
    "sweep": sweep,
    "bench": bench,
    "search": search,
    "tune": tune,
    "report": report,
    "rollout": rollout,
    "top": top,
    "explain": explain,
    "autoscale": autoscale,
    "capacity": capacity,
    "batch": batch,
    "llm-api": llm_api,
    "vllm-config": vllm_config,
    "admin-key": admin_key,
    "tenant-token": tenant_token,
}


def description(command: ModuleType) -> str:
    """A command's --help text: its docstring, or its policy's words and then its examples."""
    policy = getattr(command, "EXPLAINED_BY", None)
    if policy is None:
        return command.__doc__ or ""
    words = policy.__doc__.strip().rsplit("\n\n", 1)[0]
    examples = command.__doc__.strip().split("\n", 1)[1]
    return f"{words}\n{examples}\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools",
        description="Serve and operate the model repository on Triton Inference Server.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        summary = (module.__doc__ or "").strip().splitlines()[0]
        sub = subparsers.add_parser(name, help=summary, description=description(module),
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)
