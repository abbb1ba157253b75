"""Preflight checks and micro-benchmarks (a later release)."""
