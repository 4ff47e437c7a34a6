"""The loops, guardrails, targets, load generator, reports and the CLI."""
