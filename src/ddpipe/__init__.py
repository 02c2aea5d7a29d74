"""ddpipe: a DVC pipeline that prepares data, trains with PyTorch DDP under torchrun, evaluates, and tracks every run
in MLflow.

The library is a few packages, one concern each, in layers: a package imports only packages of layers below its
own (never a sibling of its layer, never one above), so each can be read, tested and changed from the floor up.
This table is the one statement of that rule; tests/test_layout.py holds every import of src/ddpipe against it.
The modules beside this file are thin entry points (``ddpipe outbox``, ...) that no package imports.
"""

import importlib.metadata


def _version() -> str:
    """The installed distribution's version, written once, in pyproject.toml. "unknown" where none is installed under
    this package's name: a source tree on the path, and the copy a logged model carries (``ddpipe_<digest>``, which
    serves where ddpipe is not installed, or another ddpipe is: ddpipe.models.carried), whose metadata records the
    version of the ddpipe that logged it."""
    try:
        return importlib.metadata.version(__name__)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


__version__ = _version()

LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),  # files written atomically, processes and host locks, devices, ranks, exit codes: nothing of ours
    ("config",),  # the schema, loading params.yaml and overrides, the checks, a command's exit on a user's mistake
    ("data",),  # sources, splits, the prepared store, transforms, loaders
    ("models", "distributed"),  # networks and the served classifier (no process group); ranks' plumbing (no loop)
    ("tracking",),  # the MLflow run, the outbox and its delivery, the store, champion, system metrics, sweeps
    ("engine",),  # the resolved run, the network's assembly, the loop, checkpoints, the evaluation
    ("export",),  # the export stage: ONNX and INT8 graphs checked against the trained model before they count
    ("launch",),  # the torchrun command, what each rank runs, the cluster
    ("search",),  # the search over experiments: Optuna asks, each trial a DVC experiment (ddpipe search)
    ("console",),  # the ddpipe command: a table of subcommands, each the main() of a module below
)
