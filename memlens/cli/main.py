"""``memlens``: GPU memory profiling and snapshot analysis for PyTorch training.

Each subcommand lives in its own module under ``memlens.cli`` and is imported only when it
runs, so ``memlens triage`` never pays for importing dash or torch.
"""

from __future__ import annotations

import importlib
from typing import Any, NoReturn

import click

from memlens.ops.errors import describe
from memlens.printable import MAX_SHOWN_CHARS

# name -> ("module:attribute", one-line help). Each module's docstring is its full help; the
# one-liners here let ``memlens --help`` list everything without importing torch or dash.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "triage": ("memlens.cli.triage:triage", "One-screen OOM triage of one snapshot (several ranks: fleet)."),
    "group": ("memlens.cli.group:group", "What was live at a moment or window, grouped by category, scope, file, ..."),
    "stages": ("memlens.cli.group:stages", "Memory per record_function scope: what each added, and its peak."),
    "lines": ("memlens.cli.group:lines", "Bytes live at a moment by line of one source file."),
    "fleet": ("memlens.cli.fleet:fleet", "Compare the ranks of one job: the per-rank table, the outlier rank and why."),
    "diff": ("memlens.cli.diff:diff", "What grew between two snapshots, by category and by stack."),
    "budget": ("memlens.cli.budget:budget", "Theoretical training memory: weights, grads, optimizer, activations."),
    "whatif": ("memlens.cli.whatif:whatif", "Replay a snapshot through the allocator simulator with other settings."),
    "predict": ("memlens.cli.predict:predict", "Run a script on the CPU against a simulated GPU: peak memory, OOM."),
    "plan": ("memlens.cli.plan:plan", "What fits, and the cheapest change that makes it fit (predicted)."),
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
        """Every failure becomes one line on stderr (``memlens.ops.errors``): a user's mistake
        exits with its ``exit_code`` (2); running out of memory or stack depth on an input, and
        a bug of ours (a simulated out-of-memory that escaped a command among them), exit 2.
        ``--debug`` lets the exception through, traceback and all."""
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except Exception as exc:
            if (ctx.obj or {}).get("debug"):
                raise
            _one_line_exit(ctx, exc)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, SUBCOMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _one_line_exit(ctx: click.Context, exc: BaseException) -> NoReturn:
    """Never a traceback for the user: a bug of ours (or a file we did not foresee) is still one
    line, naming the exception, with --debug to see where."""
    from memlens.files import EXIT_READER_GONE, cannot_write_stdout, discard_stdout, stdout_failure, stdout_reader_gone

    if stdout_reader_gone(exc):  # `| head` has read what it wanted: nothing to say
        discard_stdout()
        ctx.exit(EXIT_READER_GONE)
    failure = stdout_failure(exc)
    if failure is not None:  # a full disk under the report: the user's to fix, in one line
        discard_stdout()
        click.echo(f"memlens: error: {cannot_write_stdout(failure)}", err=True)
        ctx.exit(2)
    line = describe(exc, limit=MAX_SHOWN_CHARS)
    hint = " (rerun with --debug for the traceback, and please report it)" if line.kind == "bug" else ""
    click.echo(f"memlens: error: {line.text}{hint}", err=True)
    ctx.exit(line.exit_code)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``memlens --version``: the version and the engine the allocator model runs on."""
    if not value or ctx.resilient_parsing:
        return
    from memlens._version import __version__
    from memlens.ops.whatif import simulator_engine

    click.echo(f"memlens, version {__version__} (engine: {simulator_engine()})")
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
