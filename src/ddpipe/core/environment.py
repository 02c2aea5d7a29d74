"""The environment variables ddpipe sets for the processes it starts, and reads back in them: every name in one place.

Each is set by one part of ddpipe and read by another part, in a process started below it; a user never sets one but
the level of the messages (:data:`LOG_LEVEL_ENV`).
"""

from __future__ import annotations

import json
import os
from typing import Any

# The claim's token on a training's directories (ddpipe.core.claims), passed by whoever took it to the processes that
# join it: a launcher to its torchrun's workers.
CLAIM_ENV = "DDPIPE_TRAINING_CLAIM"

# "PID START" of the launcher (its start time, as ddpipe.core.processes.start_time gives it), set by ddpipe.launch
# for the torchrun it starts: every worker follows it (ddpipe.distributed.preemption).
LAUNCHER_ENV = "DDPIPE_LAUNCHER"

# A file the launcher names for its torchrun's workers (ddpipe.launch.torchrun): a worker that stops with exit code 75
# for a reason no signal told the launcher (the checkpoints' store away too long: ddpipe.launch.worker) writes it
# there, and the launcher, whose torchrun exits 1 whatever its workers' codes, exits 75 too, saying it.
PAUSE_NOTE_ENV = "DDPIPE_PAUSE_NOTE"

# In the environment of the workers of a job the launcher checked (ddpipe.launch.torchrun.preflight): they skip those
# checks.
CHECKED_ENV = "DDPIPE_LAUNCH_CHECKED"

# Set by a cluster job (ddpipe.launch.cluster.job) for its train stage: "HOST:PORT RDZV_ID [LAUNCHER ...]", the
# rendezvous of the job's nodes and, under SLURM, the srun that starts the launcher once on each of them.
NODES_ENV = "DDPIPE_CLUSTER_NODES"

# A cluster job's id and the log a person reads, set by the job for its stages: tags of the run (ddpipe.cluster.job,
# ddpipe.cluster.log).
CLUSTER_JOB_ENV, CLUSTER_LOG_ENV = "DDPIPE_CLUSTER_JOB", "DDPIPE_CLUSTER_LOG"

# A Kubernetes job's name, set in its pods' spec (ddpipe.launch.cluster.kubernetes): the job id its stages read.
K8S_JOB_ENV = "DDPIPE_K8S_JOB"

# The user's repository, set for an experiment that runs in a workspace of its own (a cluster job's, a search trial's):
# its MLflow store and outbox are the repository's, not the workspace's (ddpipe.tracking.run_store.repo_root).
REPO_ROOT_ENV = "DDPIPE_REPO_ROOT"

# A search trial, set by the search's driver for the training it runs (JSON: storage, study, trial (number),
# trial_id, metric, pruner, startup_trials, checkpoints (the trial's own directory, beside the experiment's
# workspace), attempt (the driver's count), stage (the one stage a trial runs) and held_out (the evaluate and export
# stages' tracked files, kept out of its experiment)); read by trial_spec (ddpipe.engine.pruning, a cluster job).
TRIAL_ENV = "DDPIPE_SEARCH_TRIAL"


def trial_spec() -> dict[str, Any] | None:
    """The search's description of the trial this process trains (:data:`TRIAL_ENV`), or None outside a search."""
    raw = os.environ.get(TRIAL_ENV)
    return json.loads(raw) if raw else None


# What `auto` became on this machine kind (JSON of ddpipe.engine.autotune.Choice), measured or read from its cache by
# the launcher and handed to the workers it starts, which resolve their run with it.
AUTO_CHOICE_ENV = "DDPIPE_AUTO_CHOICE"

# The level of ddpipe's messages (DEBUG, INFO, WARNING, ERROR; ddpipe.core.logs): the one a user may set, for the
# commands DVC runs (`DDPIPE_LOG_LEVEL=WARNING dvc repro`); a command's -q or -v sets it for the processes it starts
# (torchrun's workers, a search's trials), which say as much as it does.
LOG_LEVEL_ENV = "DDPIPE_LOG_LEVEL"
