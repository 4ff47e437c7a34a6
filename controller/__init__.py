"""The loops, guardrails, targets, load generator, reports and the CLI."""

from serving.native import guard as _guard

_guard()  # controller/sim/decode_run.py is one of the compiled modules
