"""``ddpipe cluster submit | status | cancel | wait`` (see :mod:`ddpipe.launch.cluster`).

    submit [--dry-run DIR] [--scheduler S] [--partition P] [--account A] [--time T] [--gpus-per-node G]
           [--cpus-per-node C] [--mem M] [--max-running N] [--storage shared|remote] [key=value ...]
    status
    cancel [NAME ...]               (all that have not ended, without names)
    wait [--timeout SECONDS]        (exit 0 when every experiment came back, 1 when one failed)

Every check runs before anything is submitted; a mistake (no scheduler, an empty queue, resources the cluster
cannot give, a queued experiment whose params fail the checks) exits 2 with the queue as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import secrets
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

from ddpipe.config.command import CommandParser, run_command
from ddpipe.config.load import user_errors
from ddpipe.core.metric_names import TEST_ACCURACY
from ddpipe.launch import workspace
from ddpipe.launch.cluster import ClusterError, kubernetes, records, slurm
from ddpipe.launch.cluster.queue import Queued, exp_ref, git, pin_and_dequeue, queued
from ddpipe.tracking.run_store import is_server, redact, tracking_uri

FLAGS = {"scheduler": "cluster.scheduler", "partition": "cluster.partition", "account": "cluster.account",
         "time": "cluster.time_limit", "gpus_per_node": "cluster.gpus_per_node",
         "cpus_per_node": "cluster.cpus_per_node", "mem": "cluster.mem", "max_running": "cluster.max_running",
         "storage": "cluster.storage"}
logger = logging.getLogger(__spec__.name)  # its dotted name under `python -m` too (there __name__ is "__main__")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED", "ENDED")


def scheduler(name: str):
    return slurm if name == "slurm" else kubernetes


def repo_of(cwd: Path) -> Path:
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=cwd, capture_output=True, text=True)
    if top.returncode != 0 or not (Path(top.stdout.strip()) / "dvc.yaml").is_file():
        raise ClusterError(f"{cwd} is not inside a DVC repository of ddpipe (no git work tree with dvc.yaml)")
    return Path(top.stdout.strip())


def git_url(repo: Path, remote: str) -> str:
    """A git remote's URL (a name is looked up; a URL or path is kept)."""
    if "/" in remote or ":" in remote:
        return remote
    url = git(repo, "remote", "get-url", remote, check=False)
    if not url:
        raise ClusterError(f"cluster.git_remote = {remote!r} is not a git remote of {repo} (git remote -v lists them); "
                           "accepted: a remote's name or a URL the nodes can reach")
    return url


# -- submit -----------------------------------------------------------------------------------


def check(repo: Path, exps: list[Queued], dry_run: bool) -> None:
    """Every check of every experiment before anything is submitted."""
    for e in exps:
        if e.cfg.cluster.scheduler == "kubernetes":
            kubernetes.require_image(e.cfg.cluster.image, e.name)
    for e in exps:
        if e.cfg.cluster.storage == "remote" and int(e.cfg.distributed.nnodes) > 1:
            raise ClusterError(f"queued experiment {e.name!r}: distributed.nnodes = {e.cfg.distributed.nnodes} is not "
                               "accepted with cluster.storage = 'remote': every node of a job reads the one workspace, "
                               "which needs a filesystem they share; accepted: 1, or cluster.storage: shared")
    for name in sorted({e.cfg.cluster.scheduler for e in exps}):
        if not (dry_run and name == "kubernetes"):
            scheduler(name).available()
    slurm_exps = [e for e in exps if e.cfg.cluster.scheduler == "slurm"]
    if slurm_exps:
        parts = slurm.partitions()
        for e in slurm_exps:
            slurm.check(slurm.Resources.of(e.cfg), e.name, parts)
    for e in exps:
        uri = tracking_uri(e.cfg.mlflow)
        if e.cfg.cluster.storage == "remote":
            if not is_server(uri):
                raise ClusterError(f"queued experiment {e.name!r}: cluster.storage = 'remote' (nodes share no "
                                   f"filesystem) cannot write its runs to {redact(uri)} on this machine; set "
                                   "mlflow.tracking_uri (or MLFLOW_TRACKING_URI) to the team's tracking server")
            git_url(repo, e.cfg.cluster.git_remote)
        elif e.cfg.cluster.scheduler == "kubernetes" and not is_server(uri):
            logger.info(f"note: experiment {e.name!r} logs to {redact(uri)}: the pods reach it only on the shared "
                        "volume (a sqlite file there is not safe for pods on several nodes: a tracking server is)")


def entry(repo: Path, root: Path, e: Queued, submission: str) -> dict:
    c = e.cfg.cluster
    remote = c.storage == "remote"
    workdir = Path(c.workdir or ("/tmp/ddpipe-cluster" if remote else root / "work")) / submission
    return {"name": e.name, "stash_rev": e.stash_rev, "baseline_rev": e.baseline_rev, "pin": e.pin,
            "nnodes": int(e.cfg.distributed.nnodes), "workspace": str(workdir / e.name),
            "log": str((workdir if remote else root / "logs") / f"{e.name}.log"),  # remote: on the node that ran it
            "storage": c.storage, "git_remote": git_url(repo, c.git_remote) if remote else "",
            # the store resolved here (the default: this repository's); never a password in a file: the job's own
            # environment (sbatch passes it on) carries credentials
            "dvc_remote": c.dvc_remote or "", "tracking_uri": redact(tracking_uri(e.cfg.mlflow)),
            "run_info": e.cfg.paths.run_info, "test_metrics": e.cfg.paths.test_metrics, "job": ""}


def submit(repo: Path, overrides: list[str], dry_run: Path | None,
           names: list[str] | None = None) -> list[records.Record]:
    """Every experiment of DVC's queue (or those of ``names``: a search's trial) as a job; all or nothing."""
    if wrong := [o for o in overrides if not o.startswith("cluster.")]:
        raise ClusterError(f"{' '.join(wrong)}: only cluster.* keys are accepted here (the experiments run their own "
                           "queued params; queue them with -S instead)")
    exps = queued(repo, overrides, names)
    check(repo, exps, dry_run is not None)
    root = records.state_dir(repo)
    submission = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)
    out = dry_run or root / "submissions" / submission
    out.mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    base = {"repo": str(repo), "submission": submission, "state": str(root), "python": sys.executable,
            "cache": workspace.cache_dir(repo)}
    # alike experiments (the same scheduler and resources) share one array job
    groups: dict[tuple, list[Queued]] = {}
    for e in exps:
        key = (e.cfg.cluster.scheduler, e.cfg.cluster.storage, slurm.Resources.of(e.cfg))
        groups.setdefault(key, []).append(e)
    plans = []
    for g, ((sched, _, res), members) in enumerate(groups.items()):
        manifest = out / f"group-{g}.json"
        m = {**base, "scheduler": sched, "experiments": [entry(repo, root, e, submission) for e in members]}
        if sched == "slurm":
            path = out / f"group-{g}.sbatch"
            path.write_text(slurm.script(res, len(members), submission, sys.executable, manifest, root / "logs"))
        else:
            path, config = out / f"group-{g}.yaml", kubernetes.job_name(submission, g * 1000 + 999) + "-manifest"
            docs = []
            for i, (e, x) in enumerate(zip(members, m["experiments"])):
                x["job"] = kubernetes.job_name(submission, g * 1000 + i)
                docs += kubernetes.manifests(e.cfg, x["job"], submission, e.name, config, i)
            pods = kubernetes.in_pods(m, repo)  # what the pods read: no path of this machine
            docs.insert(0, kubernetes.config_map(config, members[0].cfg.cluster.namespace, pods))
            path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        manifest.write_text(json.dumps(pods if sched == "kubernetes" else m, indent=1))
        plans.append((sched, path, members, m))
    if dry_run:
        print(f"wrote the job scripts and manifests of {len(exps)} experiment(s) to {dry_run}; nothing was submitted "
              "and DVC's queue is as it was")
        return []
    for e in exps:  # before the jobs start: the workspaces are made from these refs
        git(repo, "update-ref", e.pin, e.stash_rev)
    for remote_url in sorted({x["git_remote"] for *_, m in plans for x in m["experiments"] if x["git_remote"]}):
        pins = [f"+{x['pin']}:{x['pin']}" for *_, m in plans for x in m["experiments"] if x["git_remote"] == remote_url]
        git(repo, "push", "--quiet", remote_url, *pins)
    submitted: list[records.Record] = []
    try:
        for sched, path, members, m in plans:
            if sched == "slurm":
                jobs = slurm.submit(path, len(members))
            else:
                kubernetes.submit(path, members[0].cfg.cluster.namespace)
                jobs = [f"{members[0].cfg.cluster.namespace}/{x['job']}" for x in m["experiments"]]
            for job, x in zip(jobs, m["experiments"]):
                records.archive(root, x["name"])
                rec = records.Record(x["name"], submission, sched, job, x["log"], x["workspace"], x["storage"],
                                     x["git_remote"], x["dvc_remote"], x["stash_rev"], x["baseline_rev"], time.time(),
                                     x["test_metrics"])
                rec.save(root)
                submitted.append(rec)
    except Exception:
        for rec in submitted:  # all or nothing: the queue stays as it was
            with contextlib.suppress(Exception):
                scheduler(rec.scheduler).cancel([rec.job])
            (root / "experiments" / f"{rec.name}.json").unlink(missing_ok=True)
        raise
    pin_and_dequeue(repo, exps)
    return submitted


# -- status, wait, cancel ---------------------------------------------------------------------


def live_states(recs: list[records.Record]) -> dict[str, str]:
    """Each record's scheduler state, by name."""
    out: dict[str, str] = {}
    for sched in {r.scheduler for r in recs}:
        mine = [r for r in recs if r.scheduler == sched]
        found = scheduler(sched).states([r.job for r in mine])
        out.update({r.name: found.get(r.job, "ENDED") for r in mine})
    return out


def collect(repo: Path, root: Path, rec: records.Record, state: str) -> None:
    """An ended job's experiment: its result (written by the job on a shared filesystem; pulled back from the git
    and DVC remotes otherwise)."""
    if records.result(root, rec.name):
        return
    if rec.storage == "remote":  # its job's word is on the remotes: the experiment came back, or it did not
        remote = ["-r", rec.dvc_remote] if rec.dvc_remote else []
        pulled = subprocess.run(["dvc", "exp", "pull", *remote, rec.git_remote, rec.name], cwd=repo,
                                capture_output=True, text=True)
        if pulled.returncode == 0:
            records.write_result(root, rec.name, "succeeded", code=0, log=rec.log, exp_ref=exp_ref(repo, rec.name))
            return
        records.write_result(root, rec.name, "failed", code=1, log=rec.log,
                             reason=f"the job ended {state}; dvc exp pull: {pulled.stderr.strip()[-500:]}")
        return
    records.write_result(root, rec.name, "failed", keep=True, code=1, log=rec.log,
                         reason=f"the job ended {state} without the experiment's end (killed?)")


def accuracy(repo: Path, rec: records.Record, res: dict | None) -> str:
    ref = (res or {}).get("exp_ref")
    if not ref:
        return ""
    text = git(repo, "show", f"{ref}:{rec.test_metrics}", check=False)
    try:
        return f"{json.loads(text)['test']['accuracy']:.4f}"
    except (ValueError, KeyError, TypeError):
        return ""


def table(repo: Path, root: Path, recs: list[records.Record], states: dict[str, str]) -> str:
    rows = [("experiment", "job", "scheduler", "result", TEST_ACCURACY, "MLflow run", "log")]
    for r in recs:
        res = records.result(root, r.name)
        rows.append((r.name, r.job, states.get(r.name, "-"), (res or {}).get("state", "-"), accuracy(repo, r, res),
                     (res or {}).get("run_id", "") or "-", r.log))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def pending(root: Path) -> list[records.Record]:
    return [r for r in records.records(root) if not records.result(root, r.name)]


GRACE_SECONDS = 60  # a job SLURM calls ended, without its result file yet (a shared filesystem's delay)


def wait(repo: Path, timeout: float, poll: float) -> int:
    """Until every experiment that had not ended, and every one of the newest submission, has; 0 when they all
    succeeded. A scheduler that does not answer is waited for, never taken for an end."""
    root = records.state_dir(repo)
    every = records.records(root)
    if not every:
        raise ClusterError(f"nothing was submitted from {repo} (ddpipe cluster submit)")
    newest = every[-1].submission
    recs = [r for r in every if r.submission == newest or not records.result(root, r.name)]
    deadline = time.time() + timeout
    said, ended_at = "", {}
    states: dict[str, str] = {}
    while todo := [r for r in recs if not records.result(root, r.name)]:
        try:
            states.update(live_states(todo))
        except ClusterError as exc:
            logger.warning(f"{time.strftime('%H:%M:%S')} {exc}; asking again in {poll:.0f} s")
        for rec in todo:
            state = states.get(rec.name, "UNKNOWN")
            if state.split()[0] in ENDED:
                ended_at.setdefault(rec.name, time.time())
                if rec.storage == "remote" or time.time() - ended_at[rec.name] > GRACE_SECONDS:
                    collect(repo, root, rec, state)
        todo = [r for r in recs if not records.result(root, r.name)]
        line = ", ".join(f"{n} {s}" for s, n in Counter(states.get(r.name, "UNKNOWN") for r in todo).items())
        if line and line != said:
            logger.info(f"{time.strftime('%H:%M:%S')} waiting for {len(todo)} experiment(s): {line}")
            said = line
        if todo and time.time() > deadline:
            print(table(repo, root, recs, states))
            raise ClusterError(f"{len(todo)} experiment(s) still not ended after {timeout:.0f} s")
        if todo:
            time.sleep(poll)
    with contextlib.suppress(ClusterError):  # the table shows how the jobs ended, not the last poll
        states.update(live_states(recs))
    print(table(repo, root, recs, states))
    failed = [r.name for r in recs if records.result(root, r.name)["state"] != "succeeded"]
    if failed:
        logger.error(f"{len(failed)} of {len(recs)} experiment(s) did not succeed: {', '.join(failed)} (their logs "
                     "above)")
        return 1
    logger.info(f"all {len(recs)} experiment(s) are back: dvc exp show")
    return 0


def cancel(repo: Path, names: list[str]) -> int:
    root = records.state_dir(repo)
    todo = pending(root)
    known = {r.name for r in records.records(root)}
    if unknown := [n for n in names if n not in known]:
        raise ClusterError(f"not submitted from {repo}: {', '.join(unknown)}; accepted: {', '.join(sorted(known))}")
    chosen = [r for r in todo if not names or r.name in names]
    for rec in chosen:
        scheduler(rec.scheduler).cancel([rec.job])
        records.write_result(root, rec.name, "cancelled", code=1, log=rec.log)
        print(f"cancelled {rec.name} (job {rec.job})")
    if not chosen:
        print("nothing to cancel: every submitted experiment has ended")
    return 0


def arguments(parser: CommandParser) -> None:
    """``ddpipe cluster``'s arguments: submit, status, cancel and wait, each with its options."""
    parser.description = "DVC's queued experiments as SLURM or Kubernetes jobs: submit, status, cancel, wait."
    parser.epilog = __doc__.split("\n\n", 1)[1]
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    s = sub.add_parser("submit", help="every experiment in DVC's queue -> a job")
    s.add_argument("--dry-run", type=Path, metavar="DIR", help="write the job scripts and manifests only")
    for flag, key in FLAGS.items():
        s.add_argument("--" + flag.replace("_", "-"), dest=flag, help=f"{key} for these jobs")
    s.add_overrides("cluster.key=value for these jobs (the experiments run their own queued params)")
    sub.add_parser("status", help="each submitted experiment: job, state, result, log")
    c = sub.add_parser("cancel", help="stop the jobs of these (all unfinished) experiments")
    c.add_argument("names", nargs="*", metavar="NAME")
    w = sub.add_parser("wait", help="until every job has ended and its experiment is back")
    w.add_argument("--timeout", type=float, default=7 * 24 * 3600, metavar="SECONDS")
    w.add_argument("--poll", type=float, default=10.0, metavar="SECONDS", help="how often the scheduler is asked")
    for leaf in sub.choices.values():
        leaf.set_defaults(run=cluster)


def main(argv: list[str] | None = None) -> int:
    """``ddpipe cluster``: its exit code."""
    return run_command("ddpipe cluster", arguments, argv)


def cluster(args: argparse.Namespace) -> int:
    """Run ``args.command``; its results (the submitted jobs, the table) on stdout."""
    with user_errors(ClusterError, code=2):
        repo = repo_of(Path.cwd())
        if args.command == "submit":
            overrides = [f"{key}={getattr(args, f)}" for f, key in FLAGS.items() if getattr(args, f) is not None]
            recs = submit(repo, overrides + args.overrides, args.dry_run)
            if recs:
                for r in recs:
                    print(f"submitted {r.name}: {r.scheduler} job {r.job}, log {r.log}")
                logger.info("ddpipe cluster status | wait")
            return 0
        if args.command == "status":
            root = records.state_dir(repo)
            recs = records.records(root)
            if not recs:
                print(f"nothing was submitted from {repo}")
                return 0
            try:
                states = live_states(recs)
            except ClusterError as exc:
                logger.info(f"note: {exc}; the scheduler's states are not shown")
                states = {}
            print(table(repo, root, recs, states))
            return 0
        if args.command == "cancel":
            return cancel(repo, args.names)
        return wait(repo, args.timeout, args.poll)


if __name__ == "__main__":
    raise SystemExit(main())
