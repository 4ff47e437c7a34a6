"""The Ray Serve application: OpenAI-compatible HTTP, live knobs, metrics, deployment."""
