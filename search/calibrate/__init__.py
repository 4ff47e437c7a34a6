"""Measure the local device at decode's shapes (torch) and turn the tables into the roofline's profile."""
