"""The ``slotune`` command line.

Each command lives in its own module and is registered here; ``main`` turns
:class:`~controller.errors.BadInput` (and ``ValueError`` raised while parsing
user input) into one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import logging
import sys

import typer

from controller.cli import observe as cli_metrics
from controller.cli import roofline as cli_roofline
from controller.cli import serve as cli_serve
from controller.cli import simulate as cli_simulate
from controller.cli import tune as cli_tune
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


# Command registration: one line per command module.
cli_roofline.register(app)  # roofline, calibrate
cli_tune.register(app)  # tune, export
cli_serve.register(app)  # serve
cli_metrics.register(app)  # observe
cli_simulate.register(app)  # simulate


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
