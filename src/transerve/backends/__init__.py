"""Backends execute requests for one model version; the scheduler decides what they get."""
