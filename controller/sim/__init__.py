"""The simulator as a tuning target: scenarios and their step-time functions."""
