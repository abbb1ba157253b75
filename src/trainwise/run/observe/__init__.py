"""Observability: step telemetry, trackers, profiling, hang dumps, events, the comm timer, the
wall clock."""
