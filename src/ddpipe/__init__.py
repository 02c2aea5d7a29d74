"""ddpipe: a DVC pipeline that prepares data, trains with PyTorch DDP under torchrun, evaluates,
and tracks every run in MLflow."""

__version__ = "0.1.0"
