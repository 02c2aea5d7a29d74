"""A TPE study with median pruning against random search without pruning, on Fashion-MNIST: for each study seed, the
same 24-trial budget, the same space, the same first trial (the params as they stand: today's defaults); what each
costs and what its best trial reaches.

    python bench/search_compare.py [--clone /tmp/compare-clone] [--seeds 0,1,2] [--trials 24] [--train-images 2500]

A clone of this checkout (its tracked and unignored files, a fresh git repo, this checkout's code), its params set to
COMMON (a few thousand training images, a few epochs, one thread per training, 2 trials at once), reproduced once;
``--train-images`` sets ``data.max_train_samples`` of a new clone (an epoch's length against a trial's fixed cost).
For each seed (``seed`` in params.yaml: the sampler's seed, and the data split's and the training's) the data is
prepared and committed, then the two studies run (a study already in the clone is continued: finished, it runs
nothing), one after the other, with ``ddpipe search run``.

Per study: epochs trained (deterministic: what pruning saved, whatever the host's load), train-seconds (the
``epoch_seconds`` MLflow holds for every epoch of every trial: the training loops, not validation or start-up),
trial wall-seconds (each trial's start to end in the study: its ``dvc exp run`` of the train stage), the best trial
(by the search's metric, ``val_accuracy``) and its test accuracy; trial 0 is today's defaults at the same epochs. A
trial never runs the evaluate stage (issue 47), so after each study the best trial and trial 0 are each tested once
here, outside the search: ``dvc exp apply`` of its experiment, ``dvc repro evaluate``, ``metrics/test.json`` read, the
clone's working tree put back for the next study. Prints the machine and Markdown tables; appends to
bench/results/search_compare.jsonl (each study as it ends). The clone is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from common import BenchError, append_jsonl, clone_checkout, markdown_table, print_machine, run_in_clone
from omegaconf import OmegaConf

COMMON = {"data.max_train_samples": 2500, "data.val_fraction": 0.05, "num_epochs": 6, "train.batch_size_per_rank": 64,
          "model.eval_flips": False, "mlflow.log_model": False, "train.progress_bar": False,
          "distributed.threads_per_process": 1, "search.jobs": 2, "search.startup_trials": 5,
          "search.space": {"train.base_lr": "loguniform(1e-5, 1.0)", "train.label_smoothing": "uniform(0.0, 0.3)",
                           "train.weight_decay": "loguniform(1e-6, 1e-1)"}}
ARMS = {"tpe": ("tpe", "median"), "random": ("random", "none")}


def study_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def set_seed(clone: Path, seed: int) -> None:
    """``seed`` in the clone's params.yaml, its data prepared for it, committed."""
    params = OmegaConf.load(clone / "params.yaml")
    if params.seed != seed:
        params.seed = seed
        OmegaConf.save(params, clone / "params.yaml")
    run_in_clone(["dvc", "repro", "prepare"], clone)
    add_all(clone)
    if run_in_clone(["git", "status", "--porcelain"], clone)[0].strip():
        run_in_clone(["git", "commit", "-qm", f"bench: seed {seed}"], clone)
    committed = OmegaConf.create(run_in_clone(["git", "show", "HEAD:params.yaml"], clone)[0]).seed
    if committed != seed:
        raise BenchError(f"{clone}: the commit holds seed {committed}, not {seed}")


def add_all(clone: Path) -> None:
    """Every change of the clone's working tree staged, params.yaml read afresh: rewritten within the second of the
    last commit at the same size ("seed: 1" -> "seed: 2"), git's stat check takes it for unchanged."""
    run_in_clone(["git", "add", "-A"], clone)
    run_in_clone(["git", "add", "--renormalize", "params.yaml"], clone)


def tested_once(clone: Path, experiment: str) -> float | None:
    """The test accuracy of ``experiment`` (a trial's: the train stage alone), measured once: applied, evaluated, read;
    the clone's working tree then put back as it was. None when the trial left no experiment (pruned)."""
    refs = run_in_clone(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], clone)[0].split()
    if not any(r.endswith(f"/{experiment}") for r in refs):
        return None
    run_in_clone(["dvc", "exp", "apply", experiment], clone)
    try:
        run_in_clone(["dvc", "repro", "evaluate"], clone)
        return json.loads((clone / "metrics" / "test.json").read_text())["test"]["accuracy"]
    finally:
        run_in_clone(["git", "reset", "--hard", "-q"], clone)
        run_in_clone(["dvc", "checkout", "--quiet", "--force"], clone)


def measure(clone: Path, name: str) -> dict:
    """What study ``name`` of the clone cost and reached."""
    import optuna
    from mlflow import MlflowClient

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(clone / "search" / name / "study.journal")))
    study = optuna.load_study(study_name=name, storage=storage)
    client = MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    trials, epochs, train_s, wall_s = [], 0, 0.0, 0.0
    for t in study.trials:
        run_id = t.user_attrs.get("mlflow_run", "")
        seconds = sum(m.value for m in client.get_metric_history(run_id, "epoch_seconds")) if run_id else 0.0
        wall = (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete else 0.0
        # epochs trained up to its last validation (validations inside epochs, with train.val_every_n_steps: fractions)
        trained = len(t.intermediate_values) / int(t.user_attrs.get("validations_per_epoch", 1))
        trials.append({"number": t.number, "state": t.state.name, "params": t.params, "value": t.value,
                       "epochs": trained, "train_s": seconds, "wall_s": wall})
        epochs += trained
        train_s += seconds
        wall_s += wall
    best = study.best_trial
    return {"study": name, "trials": trials, "states": {s: sum(t["state"] == s for t in trials)
                                                         for s in ("COMPLETE", "PRUNED", "FAIL")},
            "epochs": epochs, "train_s": train_s, "wall_s": wall_s, "best_number": best.number,
            "best_val": best.value, "best_test": tested_once(clone, f"{name}-{best.number}"),
            "defaults_val": study.trials[0].value, "defaults_test": tested_once(clone, f"{name}-0")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clone", type=Path, default=Path("/tmp/compare-clone"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--train-images", type=int, default=COMMON["data.max_train_samples"],
                        help="data.max_train_samples of a new clone (an existing clone keeps its own)")
    args = parser.parse_args()
    print_machine()
    clone = args.clone.resolve()
    if not (clone / ".git").is_dir():
        clone.mkdir(parents=True)
        clone_checkout(clone, {**COMMON, "data.max_train_samples": args.train_images},
                       "bench: TPE with pruning against random search")
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        set_seed(clone, seed)
        for arm, (sampler, pruner) in ARMS.items():
            name = study_name(arm, seed)
            out, seconds = run_in_clone(["python", "-m", "ddpipe.search", "run", f"search.study={name}",
                                         f"search.sampler={sampler}", f"search.pruner={pruner}",
                                         f"search.trials={args.trials}"], clone)
            result = {"seed": seed, "arm": arm, "run_s": seconds, **measure(clone, name)}
            results.append(result)
            append_jsonl("search_compare", [result])  # each study as it ends: a long run stopped keeps what it did
            print(f"{name}: {result['states']}, {result['epochs']} epochs, {result['train_s']:.0f} train-s, "
                  f"best trial {result['best_number']} val {result['best_val']:.4f} test {result['best_test']}",
                  flush=True)

    rows = []
    for r in results:
        rows.append([r["seed"], r["arm"], f"{r['states']['COMPLETE']} / {r['states']['PRUNED']}", r["epochs"],
                     f"{r['train_s']:.0f}", f"{r['wall_s']:.0f}", f"{r['run_s']:.0f}",
                     f"{r['best_number']}: {r['best_val']:.4f} / {r['best_test']:.4f}",
                     f"{r['defaults_val']:.4f} / {r['defaults_test']:.4f}"])
    print("\n" + markdown_table(["seed", "study", "completed / pruned", "epochs", "train-s", "trial wall-s",
                                 "run wall-s", "best trial: val / test acc", "defaults (trial 0): val / test"], rows))
    by = {arm: [r for r in results if r["arm"] == arm] for arm in ARMS}
    ratio = {k: sum(r[k] for r in by["tpe"]) / sum(r[k] for r in by["random"]) for k in ("epochs", "train_s",
                                                                                          "wall_s")}
    gap = [t["best_test"] - r["best_test"] for t, r in zip(by["tpe"], by["random"])]
    print(f"\nTPE + median pruning against random without pruning, {len(by['tpe'])} seeds: epochs "
          f"{ratio['epochs']:.0%}, train-seconds {ratio['train_s']:.0%}, trial wall-seconds {ratio['wall_s']:.0%}; "
          f"best test accuracy TPE - random: {', '.join(f'{g * 100:+.2f}' for g in gap)} points "
          f"(mean {statistics.mean(gap) * 100:+.2f})")


if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parents[1])
    main()
