"""The ``slotune`` command line: one module per command."""
