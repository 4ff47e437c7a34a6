"""The load ``slotune tune`` offers, from its flags: request lengths, a trace, the tokenizer
and endpoint, ``ignore_eos``; checked before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from controller.cli.paths import file_error, input_file
from controller.errors import BadInput

if TYPE_CHECKING:
    from controller.load.spec import TraceItem
    from controller.targets import RequestShape
    from serving.model.config import ModelConfig
    from serving.sim.workload import LengthDist


def lengths(flag: str, spec: str) -> LengthDist:
    from serving.sim.workload import LengthDist

    try:
        return LengthDist.parse(spec)
    except ValueError as e:
        raise BadInput(f"{flag} {e}") from None


def trace(path: Path) -> tuple[TraceItem, ...]:
    from controller.load.spec import load_trace

    input_file("--trace", path)
    try:
        return load_trace(path)
    except OSError as e:
        raise file_error("--trace", path, e, "read") from None
    except ValueError as e:  # load_trace's message starts "trace PATH line N: ..."
        msg = str(e)
        msg = f"--{msg}" if msg.startswith("trace ") else f"--trace {path}: {msg}"
        raise BadInput(msg) from None


def tokenizer(path: Path | None) -> str | None:
    """``--tokenizer``: a ``tokenizer.json`` or the folder holding one (None: not given)."""
    if path is None:
        return None
    if path.is_dir():
        path = path / "tokenizer.json"
    input_file("--tokenizer", path)
    return str(path)


def _served_config(model: str, checkpoint: str | None) -> ModelConfig:
    """The built-in app's model: the preset, or the checkpoint's config.json read as the
    replica reads it (an architecture it cannot load is refused now, not after Ray starts)."""
    from serving.model.checkpoint import read_config
    from serving.model.config import ModelConfig

    if checkpoint is None:
        return ModelConfig.from_name(model)
    try:
        return read_config(checkpoint)
    except (OSError, ValueError) as e:
        raise BadInput(f"--checkpoint {checkpoint}: config.json: {e}") from None


def fits_context(
    shape: RequestShape,
    model: str,
    prompt_spec: str,
    output_spec: str,
    trace: Path | None,
    *,
    checkpoint: str | None = None,
) -> None:
    """Every request the load can send fits one KV slot of the built-in model (prompt +
    output <= its context; the ``checkpoint``'s when it serves one); else the server would
    answer each with a 400, and a whole budget would be spent measuring them."""
    from serving.engine.engine import slot_context

    ctx = slot_context(_served_config(model, checkpoint))
    who = f"the built-in {model!r} model" if checkpoint is None else f"checkpoint {checkpoint}"
    holds = f"{who} holds {ctx} tokens a request (prompt + output)"
    if shape.trace is not None:
        for i, item in enumerate(shape.trace, start=1):
            n = item.prompt_tokens
            if isinstance(item.prompt, str):
                n = len(item.prompt.encode("utf-8"))  # the byte-level tokenizer's count
            elif item.prompt is not None:
                raise BadInput(f"--trace {trace}: request {i}: prompt must be a string")
            elif not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
                raise BadInput(
                    f"--trace {trace}: request {i}: prompt_tokens={n!r}: must be an integer >= 1"
                )
            if n + item.max_tokens > ctx:
                raise BadInput(
                    f"--trace {trace}: request {i} has {n} prompt + {item.max_tokens} output "
                    f"tokens, but {holds}"
                )
        return
    p, o = shape.prompt_tokens.max_tokens, shape.output_tokens.max_tokens
    if p + o > ctx:
        cut = [
            f"{spec} draws up to {d.hi}"
            for spec, d in ((prompt_spec, shape.prompt_tokens), (output_spec, shape.output_tokens))
            if d.kind == "lognormal"
        ]
        raise BadInput(
            f"--prompt-tokens {prompt_spec} --output-tokens {output_spec}: a request can "
            f"reach {p} + {o} = {p + o} tokens, but {holds}; give smaller lengths"
            + (f" ({'; '.join(cut)})" if cut else "")
        )
