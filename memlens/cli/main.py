"""``memlens``: GPU memory profiling and snapshot analysis for PyTorch training.

Each subcommand lives in its own module under ``memlens.cli`` and is imported only when it
runs, so ``memlens triage`` never pays for importing dash or torch.
"""

from __future__ import annotations

import importlib
from typing import Any, NoReturn

import click

from memlens.errors import MemlensError, MemlensOutOfMemory
from memlens.printable import printable

# name -> ("module:attribute", one-line help). Each module's docstring is its full help; the
# one-liners here let ``memlens --help`` list everything without importing torch or dash.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "triage": ("memlens.cli.triage:triage", "One-screen OOM triage of one or more snapshots."),
    "diff": ("memlens.cli.diff:diff", "What grew between two snapshots, by category and by stack."),
    "budget": ("memlens.cli.budget:budget", "Theoretical training memory: weights, grads, optimizer, activations."),
    "whatif": ("memlens.cli.whatif:whatif", "Replay a snapshot through the allocator simulator with other settings."),
    "predict": ("memlens.cli.predict:predict", "Run a script on the CPU against a simulated GPU: peak memory, OOM."),
    "record": ("memlens.cli.record:record", "Run a training script unmodified and record its memory."),
    "serve": ("memlens.cli.serve:serve", "Start the web dashboard (upload snapshots, see findings)."),
    "demo": ("memlens.cli.demo:demo", "Triage the bundled sample snapshots (the README's first command)."),
    "export": ("memlens.cli.export:export", "Write a self-contained HTML report with the figures."),
    "mcp": ("memlens.cli.mcp:mcp", "Serve the analyses to an assistant: an MCP server on stdio."),
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = SUBCOMMANDS.get(cmd_name)
        if entry is None:
            return None
        module_name, attribute = entry[0].split(":")
        command = getattr(importlib.import_module(module_name), attribute)
        assert isinstance(command, click.Command)
        return command

    def invoke(self, ctx: click.Context) -> Any:
        """User mistakes (``MemlensError``) become one line on stderr and exit code 2.

        A simulated out-of-memory is a result each command reports (``memlens whatif``: "out of
        memory: yes", exit 0), never a mistake: one that escapes a command is our bug."""
        try:
            return super().invoke(ctx)
        except MemlensOutOfMemory as exc:
            if (ctx.obj or {}).get("debug"):
                raise
            _internal_error(ctx, exc)
        except MemlensError as exc:
            if (ctx.obj or {}).get("debug"):
                raise
            click.echo(f"memlens: error: {printable(exc)}", err=True)
            ctx.exit(exc.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except (MemoryError, RecursionError) as exc:
            # What a crafted file does to a reader with no defence left: still one line, exit 2.
            if (ctx.obj or {}).get("debug"):
                raise
            what = "memory" if isinstance(exc, MemoryError) else "stack depth"
            click.echo(f"memlens: error: ran out of {what} on this input ({type(exc).__name__})", err=True)
            ctx.exit(2)
        except Exception as exc:
            if (ctx.obj or {}).get("debug"):
                raise
            _internal_error(ctx, exc)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, SUBCOMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _internal_error(ctx: click.Context, exc: BaseException) -> NoReturn:
    """Never a traceback for the user: a bug of ours (or a file we did not foresee) is still one
    line, naming the exception, with --debug to see where."""
    click.echo(f"memlens: error: internal error: {type(exc).__name__}: {printable(exc, 300)} "
               "(rerun with --debug for the traceback, and please report it)", err=True)
    ctx.exit(2)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``memlens --version``: the version and the engine the allocator model runs on."""
    if not value or ctx.resilient_parsing:
        return
    from memlens._version import __version__
    from memlens.allocator.engine import engine_name

    click.echo(f"memlens, version {__version__} (engine: {engine_name()})")
    ctx.exit()


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the version and the engine (native or python), then exit.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """memlens: find out where your PyTorch training run's GPU memory went."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``memlens`` console script."""
    cli.main(args=argv, prog_name="memlens")


if __name__ == "__main__":
    main()
