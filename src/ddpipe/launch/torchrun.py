"""How every training starts: check the params, this node and the data, then build and run torchrun.

    python -m ddpipe.launch [key=value ...]            # run it
    python -m ddpipe.launch --print [key=value ...]    # show the command only

One node (``distributed.nnodes: 1``): ``torchrun --standalone`` (a free port, so parallel experiments
never collide), as dvc.yaml's train stage runs it. N nodes: every node runs this same command with
the same ``distributed.rdzv_endpoint`` (host:port on the first node) and ``distributed.rdzv_id``;
torchrun's c10d rendezvous assigns node ranks. deploy/ has SLURM and Kubernetes launchers using it.

Run it from the repository root (it reads ./params.yaml; the workers run ``ddpipe.launch.worker``, the installed
package's), with the same checkout and prepared data on every node.

A scheduler's stop (SIGTERM, or SIGUSR1 ahead of a time limit) is passed on to torchrun, which passes
it to the workers: they stop at a step, rank 0 checkpoints it, and this command exits with 75
(``ddpipe.core.exits.EXIT_PREEMPTED``): run it again to resume. Under Kubernetes this process is the
container's PID 1, the only one the kubelet signals. A training whose checkpoints' store was away too long stops on
its own (ddpipe.engine.store_pause), and this command exits 75 for it too.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import torch

from ddpipe.config.command import CommandParser, load_or_exit, run_command
from ddpipe.config.load import user_errors
from ddpipe.config.schema import Config, ConfigError, DistributedConfig
from ddpipe.core.claims import InUse
from ddpipe.core.environment import CHECKED_ENV, CLAIM_ENV, NODES_ENV, PAUSE_NOTE_ENV
from ddpipe.core.exits import EXIT_PREEMPTED, STOP_SIGNALS
from ddpipe.core.objectstore import StoreError
from ddpipe.core.processes import alive, caller_past_shells, start_time
from ddpipe.data.encoding import SMALL_IMAGE_SIDE
from ddpipe.data.store import PreparedDataError
from ddpipe.distributed.host_leases import GpuLease, visible_gpus
from ddpipe.distributed.preemption import FOLLOW_EVERY_S, launcher_env
from ddpipe.engine.assembly import build_network
from ddpipe.engine.autotune import Choice, hand_over, handed_over
from ddpipe.engine.checkpoint import check_checkpoint_place
from ddpipe.engine.pruning import trial_config
from ddpipe.engine.resolved import Job, Resolved, measured_choice, resolve, resolve_job
from ddpipe.engine.stage_outputs import anchored_checkpoints, claim_training
from ddpipe.models.catalog import RENAMED, module_file
from ddpipe.tracking.access import check_access

# What torchrun starts on every rank: a module of the installed package (an experiment's own library where
# PYTHONPATH names it: a search trial's, a cluster job's), never a file of a checkout
WORKER_MODULE = "ddpipe.launch.worker"

# What torchrun passes on to its workers (its default, plus SLURM's warning signal)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)

logger = logging.getLogger(__spec__.name)  # its dotted name under `python -m` too (there __name__ is "__main__")


def torchrun_command(d: DistributedConfig, nproc: int, script_args: Sequence[str] = (),
                     script: str | Path | None = None) -> list[str]:
    """The torchrun argv for this node: ``nproc`` workers of :data:`WORKER_MODULE` (or of the file ``script``),
    ``script_args`` passed to every worker, restarts, stop-signal forwarding and rendezvous from ``d``. The one
    place a torchrun command is written (dvc.yaml, deploy/, the tests and the benchmarks all come here)."""
    # torchrun as a module of this interpreter: no PATH lookup, never another Python's torchrun
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--max-restarts={d.max_restarts}"]
    for flag in (f"--signals-to-handle={','.join(s.name for s in FORWARDED)}",
                 f"--shutdown-timeout={d.shutdown_timeout_s}"):
        if _torchrun_accepts(flag):
            cmd.append(flag)
        else:
            logger.warning(f"warning: torchrun of torch {torch.__version__} has no {flag.split('=')[0]}: "
                           + ("SIGUSR1 kills the job instead of stopping it at a checkpointed step" if "signals" in flag
                              else "after a stop it gives the workers its own default time"))
    if d.nnodes == "1":
        cmd.append("--standalone")  # a free port: parallel experiments never collide
    else:
        cmd += [f"--nnodes={d.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={d.rdzv_endpoint}",
                f"--rdzv-id={d.rdzv_id}"]
    return cmd + ([str(script)] if script else ["-m", WORKER_MODULE]) + list(script_args)


@functools.cache
def _torchrun_accepts(flag: str) -> bool:
    """Whether this torch's torchrun has ``flag``: --signals-to-handle and --shutdown-timeout are newer than
    some supported torch versions (torch 2.11's torchrun has no --shutdown-timeout)."""
    from torch.distributed.run import get_args_parser

    return flag.split("=")[0] in get_args_parser()._option_string_actions


def cluster_nodes(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Under a ddpipe.launch.cluster job (:data:`NODES_ENV`): the rendezvous overrides of its nodes (before ``argv``:
    the stage's own command line wins) and the command that starts this launcher on every node (empty where the
    scheduler starts them itself, as a Kubernetes Indexed Job does). Elsewhere: ``argv`` and no command."""
    spec = shlex.split(os.environ.get(NODES_ENV, ""))
    if not spec:
        return list(argv), []
    endpoint, rdzv_id, *launcher = spec
    rdzv = [f"distributed.rdzv_endpoint={endpoint}", f"distributed.rdzv_id={rdzv_id}"]
    return [*rdzv, *argv], [*launcher, sys.executable, "-m", "ddpipe.launch", *rdzv, *argv] if launcher else []


def this_device() -> torch.device:
    """The device this process trains on: under torchrun a worker's own GPU (LOCAL_RANK's, as
    ``ddpipe.distributed`` binds it), GPU 0 for the launcher, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def preflight(cfg: Config, world_size: int, choice: Choice | None = None) -> Resolved:
    """Every check that needs this node's devices, the prepared data or the network, for a job of ``world_size``
    processes, run before torchrun starts any worker (workers it started skip them: :data:`CHECKED_ENV`); the run
    resolved for this node. The network is built once here, with its pretrained
    weights (a torchvision name is downloaded into torch hub's cache here, once, not by every worker), so a wrong
    name, keyword or weights file fails now. ``choice``: what ``auto`` measured here (measured now when not given)."""
    run = resolve(cfg, this_device(), choice=choice or measured_choice(cfg, this_device()))
    build_network(run)
    note_network(run)
    run.check_world_size(world_size)
    return run


def note_network(run: Resolved) -> None:
    """What the launcher says of the network's name: an old small-image name that now means torchvision's network,
    and a network of the user's whose file dvc.yaml does not list."""
    name, side = run.model_name, run.input_size[0]
    if name in RENAMED and side <= SMALL_IMAGE_SIDE:
        logger.info(f"note: model.name = {name!r} is torchvision's network, whose stem shrinks a {side}-px "
                    f"image 4x before its first block; the small-image variant this name meant before is "
                    f"{RENAMED[name]!r} (docs/models.md, 'Any network')")
    source = module_file(name)
    if source is not None and Path("dvc.yaml").is_file() and str(source) not in Path("dvc.yaml").read_text():
        logger.warning(f"warning: model.name = {name!r} lives in {source}, which dvc.yaml does not list: add it "
                       "to the train and evaluate stages' deps, or DVC will not re-run them when it changes "
                       "(docs/models.md, 'Your own network')")


def worker_config(cfg: Config, world_size: int) -> Resolved:
    """What a training worker of a job of ``world_size`` processes trains with. Started by this launcher
    (:data:`CHECKED_ENV`): ``cfg`` resolved for its device and checked only for what the launcher could not see,
    the world size the job formed (an elastic ``MIN:MAX`` job's) against the global batch, and the prepared data
    still readable. Started otherwise (torchrun or python by hand): every check of :func:`preflight`. A search's
    trial checkpoints in its own directory (:func:`~ddpipe.engine.pruning.trial_config`), a queued experiment in the
    user's repository (:func:`~ddpipe.engine.stage_outputs.anchored_checkpoints`)."""
    cfg = anchored_checkpoints(trial_config(cfg))
    if not os.environ.get(CHECKED_ENV):
        return preflight(cfg, world_size)
    run = resolve(cfg, this_device(), choice=handed_over())  # what `auto` measured, the launcher's
    run.check_world_size(world_size)
    return run


def arguments(parser: CommandParser) -> None:
    """``ddpipe launch``'s arguments (``python -m ddpipe.launch``'s, the train stage's ``python stages/train.py``'s)."""
    parser.description = ("Check the params, this node and the data, then train under torchrun: one node, "
                          "distributed.nproc_per_node processes (--standalone), or every node of distributed.nnodes "
                          "with the same command and rendezvous. A stop (SIGTERM, SIGUSR1) checkpoints the step and "
                          "exits 75: the same command resumes.")
    parser.add_argument("--print", action="store_true",
                        help="the checks, then the torchrun command on stdout; nothing is started")
    parser.add_overrides()
    parser.set_defaults(run=launch)


def main(argv: list[str] | None = None, prog: str = "python -m ddpipe.launch") -> int:
    """``python -m ddpipe.launch [--print] [key=value ...]``: the same as ``ddpipe launch``."""
    return run_command(prog, arguments, argv)


def launch(args: argparse.Namespace) -> None:
    """Check, say the torchrun command, run it (``--print``: print it only, the result on stdout); exit with its
    code."""
    overrides, on_every_node = cluster_nodes(args.overrides)
    # a search's trial: its own checkpoints; a queued experiment: checkpoints that outlive DVC's copy of the repository
    cfg = anchored_checkpoints(trial_config(load_or_exit(overrides, "-m ddpipe.launch")))
    with user_errors(PreparedDataError, StoreError):  # fail here, before any worker starts on any node
        if cfg.distributed.nnodes != "1" and not cfg.distributed.rdzv_endpoint:
            raise ConfigError(f"distributed.rdzv_endpoint = '' is not accepted with distributed.nnodes = "
                              f"{cfg.distributed.nnodes!r}: every node needs host:port of the first node's rendezvous "
                              "(deploy/ sets it; ddpipe cluster submit sets it for queued experiments)")
        choice = measured_choice(cfg, this_device())  # `auto` measured on this machine kind, or read from its cache
        job = resolve_job(cfg.distributed)
        preflight(cfg, job.max_world_size, choice)
        check_checkpoint_place(cfg.paths.checkpoints)  # a store that is down, refuses the keys or lacks the bucket
        if note := check_access(cfg.mlflow):  # a server that refuses this user: before anything is written
            logger.info(note)
    env = {**os.environ, CHECKED_ENV: "1", **launcher_env(), **hand_over(choice)}  # they follow this process
    if on_every_node and cfg.distributed.nnodes != "1" and not args.print:
        # a cluster job's train stage runs on its first node: one launcher per node, each checks its own node
        logger.info(" ".join(on_every_node))
        _exit(supervise(on_every_node, {k: v for k, v in os.environ.items() if k != NODES_ENV}))
    if args.print:
        print(" ".join(torchrun_command(cfg.distributed, job.nproc_per_node, overrides)), flush=True)
        return
    # One host: this training's directories are its own until its last process ends (several nodes: the writing
    # rank takes them, as only the rendezvous tells which node that is)
    with user_errors(InUse):
        claim = claim_training(cfg, "launcher") if cfg.distributed.nnodes == "1" else None
    try:
        with tempfile.TemporaryDirectory(prefix="ddpipe-launch-") as notes:
            note = Path(notes) / "paused"
            code = paused(run_torchrun(cfg, job, overrides, {**env, PAUSE_NOTE_ENV: str(note),
                                                             **({CLAIM_ENV: claim.token} if claim else {})}), note)
        if claim is not None and code != 0:  # a killed torchrun's workers stop on their own: wait for them
            claim.wait_for_others(cfg.distributed.shutdown_timeout_s + 30.0, _say)
    finally:
        if claim is not None:
            claim.release()
    _exit(code)


def run_torchrun(cfg: Config, job: Job, overrides: list[str], env: dict[str, str]) -> int:
    """Run this node's torchrun and wait for it; its exit code (128 + the signal's number if a signal killed it)."""
    if not torch.cuda.is_available() or cfg.distributed.nnodes != "1":
        cmd = torchrun_command(cfg.distributed, job.nproc_per_node, overrides)
        logger.info(" ".join(cmd))
        return supervise(cmd, env)
    # GPUs on one host: leased while torchrun runs, so trainings at once split them (ddpipe.distributed.host_leases)
    nproc = job.nproc_per_node
    with GpuLease(visible_gpus(), job.gpus_requested) as lease:
        if len(lease.gpus) != nproc:  # an `auto` training's share: the job is smaller, check it again
            nproc = len(lease.gpus)
            with user_errors(PreparedDataError, context=f" (with {nproc} of this host's GPUs: {','.join(lease.gpus)})"):
                preflight(cfg, nproc)
        cmd = torchrun_command(cfg.distributed, nproc, overrides)
        logger.info(f"CUDA_VISIBLE_DEVICES={','.join(lease.gpus)} {' '.join(cmd)}")
        return supervise(cmd, {**env, "CUDA_VISIBLE_DEVICES": ",".join(lease.gpus)})


def paused(code: int, note: Path) -> int:
    """torchrun's exit ``code``, or EXIT_PREEMPTED where its workers stopped on their own for a pause they left in
    ``note`` (their checkpoints' store away too long: ddpipe.launch.worker.paused), said again here."""
    if code == 0 or not note.is_file():
        return code
    _say(note.read_text().strip())
    return EXIT_PREEMPTED


def _say(text: str) -> None:
    logger.warning(f"ddpipe.launch: {text}")


def _exit(code: int) -> NoReturn:
    """Exit with torchrun's code. Once stopped (75), later stop signals are ignored: on several nodes the
    scheduler cancels the other nodes' tasks as soon as one exits (SLURM's srun --kill-on-bad-exit), and
    that SIGTERM, arriving while this interpreter shuts down, would turn this node's 75 into a kill and
    the job would not be requeued."""
    if code == EXIT_PREEMPTED:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(code)


def supervise(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Run torchrun (``cmd``), passing on the signals a scheduler stops jobs with; its exit code, or
    EXIT_PREEMPTED if a stop (SIGTERM, SIGUSR1) ended it: the workers checkpointed their step.

    SIGINT is not passed on: Ctrl-C reaches torchrun from the terminal itself, in the same process group.
    """
    stopped: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum: int, frame: object) -> None:
        stopped.append(signum)
        if child is not None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED if sig != signal.SIGINT}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = subprocess.Popen(cmd, env=env)
        for signum in stopped:  # arrived while it was starting
            child.send_signal(signum)
        follow_dvc(lambda: None if stopped else forward(signal.SIGTERM, None))  # once: a stop already passed on
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code != 0 and any(sig in STOP_SIGNALS for sig in stopped):
        _say(f"stopped by {signal.Signals(stopped[0]).name}; the workers checkpointed their step: run the same "
             f"command to resume (exit code {EXIT_PREEMPTED})")
        return EXIT_PREEMPTED
    if code < 0:  # torchrun itself was killed (SIGKILL: the OOM killer, kill -9): its workers stop on their own
        _say(f"torchrun (pid {child.pid}) was killed by {signal.Signals(-code).name}; its workers follow it: each "
             "stops at its next step after a checkpoint; run the same command to resume")
        return 128 - code
    return code


def follow_dvc(stop: Callable[[], None]) -> threading.Thread | None:
    """Run by DVC (``$DVC_STAGE`` set: the train stage of `dvc repro` or `dvc exp run`, queued or not): a daemon
    thread that calls ``stop`` (a scheduler's SIGTERM to this training: the workers checkpoint their step) once the
    DVC process that started this one has ended. `dvc queue kill --force` SIGKILLs that process alone: without
    this, its training would go on, orphaned, in the copy of the repository that DVC removes (the shell DVC runs the
    stage's command in, when it forks, lives on too). Otherwise None."""
    parent = caller_past_shells()
    if not os.environ.get("DVC_STAGE") or parent <= 1:  # 0: a parent outside this PID namespace (docker exec)
        return None
    started = start_time(parent)

    def follow() -> None:
        while alive(parent, started):
            time.sleep(FOLLOW_EVERY_S)
        _say(f"the DVC process that ran this stage (pid {parent}) has ended (`dvc queue kill --force`, or a kill): "
             "stopping the training at its next step, after a checkpoint")
        stop()

    thread = threading.Thread(target=follow, name="ddpipe-follow-dvc", daemon=True)
    thread.start()
    return thread


if __name__ == "__main__":
    raise SystemExit(main())
