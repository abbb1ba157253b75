"""trainwise: plan, train, check and report distributed PyTorch training."""

__version__ = "0.1.0"
