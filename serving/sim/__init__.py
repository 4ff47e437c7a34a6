"""The discrete-event simulator: the real scheduler on a virtual clock, with a step-time function handed in."""
