"""The worker engine: process group, model build and parallelization, the training step and
loop, states, optimizer and precision."""
