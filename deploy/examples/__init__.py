"""Runnable deployments that are not slotune's own server, for slotune to tune."""
