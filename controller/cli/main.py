"""The ``slotune`` command line.

Each command lives in its own module and is registered here; ``main`` turns
:class:`~controller.errors.BadInput` (and ``ValueError`` raised while parsing
user input) into one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import logging
import sys

import typer

from controller.cli import calibrate, export, observe, roofline, serve, simulate, tune
from controller.errors import BadInput, NoFeasiblePoint

app = typer.Typer(
    name="slotune",
    help="SLO-aware autotuning for LLM serving: roofline, tune, control, export.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO level."),
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


# One module per command, registered in the order `slotune --help` lists them.
for command in (roofline, calibrate, tune, export, serve, observe, simulate):
    command.register(app)


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, standalone_mode=True)
    except BadInput as e:
        print(f"slotune: error: {e}", file=sys.stderr)
        sys.exit(2)
    except NoFeasiblePoint as e:
        print(f"slotune: no feasible point: {e}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
