"""A Ray Serve app batched by `@serve.batch`, tuned by slotune (README.md here)."""
