"""The pure continuous-batching scheduler: its types, per-request state and the scheduler itself."""
