"""``spanrl`` command line: the local stack, the main job and replay.

    spanrl stack up [--only kafka,minio]   start components, wait for health
    spanrl stack status                    table of components, health, endpoints
    spanrl stack down                      stop everything
    spanrl stack logs NAME [-n 50]         tail a component's log
    spanrl demo [--keep-up] ...            the main job (examples/math_agent/main_job.py)
    spanrl replay ...                      rebuild transitions under a new credit rule
"""
from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from infra.stack import Stack, StackError

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
stack_app = typer.Typer(no_args_is_help=True, help="Start, inspect and stop the local stack.")
app.add_typer(stack_app, name="stack")
console = Console()


def _names(only: str | None) -> list[str] | None:
    return [n.strip() for n in only.split(",") if n.strip()] if only else None


@stack_app.command("up")
def stack_up(only: str = typer.Option(None, help="comma-separated components (default: all)")) -> None:
    """Start the stack (Kafka, MinIO, vLLM, bridge, proxy, stream, trainer, reloader)."""
    stack = Stack()
    try:
        with console.status("starting") as st:
            stack.up(_names(only), progress=lambda n: st.update(f"starting {n} …"))
    except StackError as exc:
        console.print(f"[red]stack up failed[/red]: {exc}")
        raise typer.Exit(1)
    stack_status()


@stack_app.command("down")
def stack_down(only: str = typer.Option(None, help="comma-separated components (default: all)")) -> None:
    """Stop the stack (reverse order)."""
    Stack().down(_names(only))
    console.print("stack stopped")


@stack_app.command("status")
def stack_status() -> None:
    """Show each component: running, healthy, endpoint."""
    table = Table(title="spanrl stack")
    for col in ("component", "running", "healthy", "endpoint"):
        table.add_column(col)
    for name, running, healthy, where in Stack().status():
        table.add_row(name, "yes" if running else "no", "[green]yes[/green]" if healthy else "[red]no[/red]", where)
    console.print(table)


@stack_app.command("logs")
def stack_logs(name: str, lines: int = typer.Option(50, "-n")) -> None:
    """Print the last lines of a component's log."""
    console.print(Stack().tail(name, lines))


if __name__ == "__main__":
    app()
