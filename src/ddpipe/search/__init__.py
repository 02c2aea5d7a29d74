"""The search over experiments: ``ddpipe search run | status | best`` (docs/search.md).

Optuna asks for each trial, the trial runs as a DVC experiment (``dvc exp run`` with its params set, in a workspace
of its own), and its training reports every epoch to the study, which may prune it (``ddpipe.engine.pruning``).
``space`` parses and checks the ``search`` section, ``study`` opens the study, ``driver`` runs the trials,
``report`` shows them.
"""
