"""Metric contract, Prometheus-exact quantiles, observations and sources.

This package imports nothing else of slotune (a test enforces it).
"""
