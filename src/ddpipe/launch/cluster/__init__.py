"""DVC's experiment queue on a cluster scheduler: what ``dvc exp run --queue`` holds, run as SLURM jobs (or
Kubernetes Indexed Jobs), back as DVC experiments of this repository.

    dvc exp run --queue -S seed=1,2 -S train.base_lr=0.003,0.01 -S mlflow.sweep=grid
    ddpipe cluster submit        # every queued experiment -> a job (an array for alike ones)
    ddpipe cluster status        # each experiment: its job, state, log, MLflow run
    ddpipe cluster wait          # until every job has ended and its experiment is back
    ddpipe cluster cancel [NAME ...]
    dvc exp show                           # the experiments, with their params and metrics

Each job runs its experiment with ``dvc exp run`` in a workspace of its own (a clone of this repository at the
experiment's baseline with its queued changes), so no repository lock is shared, and pushes the experiment's git
ref back here (``cluster.storage: shared``: the DVC cache is this repository's) or to ``cluster.git_remote`` and
the DVC remote (``remote``: nodes that share nothing). The modules, one per concern:

- :mod:`ddpipe.launch.cluster.queue`: the queued experiments, their params checked, pinned and taken off DVC's queue;
- :mod:`ddpipe.launch.cluster.records`: what was submitted and how each experiment ended (``.dvc/tmp/cluster``);
- :mod:`ddpipe.launch.cluster.slurm` and :mod:`ddpipe.launch.cluster.kubernetes`: the schedulers;
- :mod:`ddpipe.launch.cluster.job`: what runs inside a job;
- :mod:`ddpipe.launch.cluster.submission`: the command line.
"""

# The c10d rendezvous port of several-node jobs (torchrun's own default); a scheduler's job adds an offset from its
# id so that jobs sharing a node do not collide (ddpipe.launch.cluster.slurm.rendezvous_endpoint). Here, not beside
# ddpipe.launch.torchrun's command: submitting and running a cluster job start no torch.
RDZV_PORT = 29400


class ClusterError(ValueError):
    """Something the user can fix before anything is submitted (no scheduler, an empty queue, resources the
    cluster cannot give, a queued experiment whose params fail the checks)."""
