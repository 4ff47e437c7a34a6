"""Measure the local device at decode's shapes (torch); turn the tables into a roofline profile."""
