"""The ``slotune`` command line.

Each command lives in its own module and is registered here; ``main`` turns
:class:`~controller.errors.BadInput` and click's usage errors (an unknown option, a
value that does not parse) into one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import logging
import sys

import typer

from controller.cli import (
    calibrate,
    compare,
    control,
    export,
    observe,
    roofline,
    serve,
    simulate,
    tune,
)
from controller.errors import BadInput, NoFeasiblePoint, NotComparable, Undecided, Worse

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
for command in (roofline, calibrate, tune, control, export, compare, serve, observe, simulate):
    command.register(app)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main(argv: list[str] | None = None) -> None:
    try:
        code = app(args=argv, standalone_mode=False)
    except typer.TyperException as e:  # click's errors (typer vendors click since 0.25)
        if type(e).__name__ == "NoArgsIsHelpError":  # `slotune` alone: the help
            text = e.format_message()  # (typer's rich help prints itself and returns "")
            if text.strip():
                print(text, file=sys.stderr)
        else:  # a usage error (unknown option, a value that does not parse): one line
            print(f"slotune: error: {_one_line(e.format_message())}", file=sys.stderr)
        sys.exit(e.exit_code)
    except typer.Abort:
        print("slotune: aborted", file=sys.stderr)
        sys.exit(1)
    except BadInput as e:
        print(f"slotune: error: {_one_line(str(e))}", file=sys.stderr)
        sys.exit(2)
    except NoFeasiblePoint as e:
        print(f"slotune: no feasible point: {e}", file=sys.stderr)
        sys.exit(3)
    except Undecided as e:
        print(f"slotune: undecided: {e}", file=sys.stderr)
        sys.exit(4)
    except Worse as e:
        print(f"slotune: B is worse: {e}", file=sys.stderr)
        sys.exit(5)
    except NotComparable as e:
        print(f"slotune: not comparable: {e}", file=sys.stderr)
        sys.exit(6)
    # typer.Exit(n) comes back as n outside standalone mode; a command's own return, None
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
