"""``memlens``: GPU memory profiling and snapshot analysis for PyTorch training.

Each subcommand lives in its own module under ``memlens.cli`` and is imported only when it
runs, so ``memlens triage`` never pays for importing dash or torch.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from typing import Any

import click

from memlens.errors import MemlensError

# name -> "module:attribute"; each module's docstring is its help text.
SUBCOMMANDS: dict[str, str] = {
    "triage": "memlens.cli.triage:triage",
    "diff": "memlens.cli.diff:diff",
    "budget": "memlens.cli.budget:budget",
    "whatif": "memlens.cli.whatif:whatif",
    "record": "memlens.cli.record:record",
    "serve": "memlens.cli.serve:serve",
    "demo": "memlens.cli.demo:demo",
    "export": "memlens.cli.export:export",
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attribute = target.split(":")
        command = getattr(importlib.import_module(module_name), attribute)
        assert isinstance(command, click.Command)
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.version_option(package_name="memlens")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """memlens: find out where your PyTorch training run's GPU memory went."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def main(argv: list[str] | None = None) -> Any:
    """Entry point: user mistakes become one line on stderr and exit code 2."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        result = cli.main(args=args, prog_name="memlens", standalone_mode=False)
    except click.exceptions.Exit as exc:  # --help, --version
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("memlens: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except MemlensError as exc:
        if debug:
            traceback.print_exc()
        click.echo(f"memlens: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("memlens: interrupted", err=True)
        sys.exit(130)
    if isinstance(result, int) and result:
        sys.exit(result)
    return result


if __name__ == "__main__":
    main()
