"""Roofline model, search space, objective and the Optuna tuner."""
