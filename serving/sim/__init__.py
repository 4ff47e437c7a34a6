"""The discrete-event simulator: the real scheduler on a virtual clock, given a step time."""
