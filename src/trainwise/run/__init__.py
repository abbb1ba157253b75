"""The runtime: launch, strategy wrapping, the training loop and its telemetry."""
