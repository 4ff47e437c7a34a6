"""Decode model, continuous-batching engine, Ray Serve app and simulator."""
