"""Deployment files; the Python under deploy/examples is importable from the repository root."""
