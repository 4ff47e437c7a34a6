"""Decode model, continuous-batching engine, Ray Serve app and simulator."""

from serving.native import guard as _guard

_guard()  # the compiled simulator modules only while they match their sources
