"""sharddemo: see, on real ranks, how torch and accelerate split a dataset across processes."""

__version__ = "0.1.0"
