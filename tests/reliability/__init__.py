"""Reliability suite: fault injection, differential testing and bad-input sweeps."""
