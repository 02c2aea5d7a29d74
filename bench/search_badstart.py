"""What a search finds that a bad start misses, on Fashion-MNIST: from params that are off (a learning rate 30x below
today's, a network other than ``auto``), a 12-trial TPE study with median pruning, its chosen trial tested once,
against today's defaults tested once at the same epochs, for each seed; then a task where the defaults are not the
best (a budget of 2 epochs): a 12-trial study from the defaults, its chosen trial against them, each tested once.

    python bench/search_badstart.py [--clone /tmp/badstart-clone] [--seeds 0,1,2] [--trials 12] [--few-seed 0]
                                    [--space wide|documented] [--train-images 2500]

A clone of this checkout with search_compare.py's COMMON params (2,500 training images, 3,000 validation images, 6
epochs, one thread per training, 2 trials at once), reproduced once. Per seed: the seed and the bad start committed
(the study's first trial is the params as they stand), the data prepared, the study run with ``ddpipe search run``;
today's defaults (``train.base_lr`` and ``model.name`` as this checkout's params.yaml has them) trained once as a DVC
experiment of the train stage. A trial never sees the test split: the study's best trial (by ``val_accuracy``) and
the defaults' experiment are each tested once after the study (``dvc exp apply``, ``dvc repro evaluate``). Prints the
machine and Markdown tables; appends to bench/results/search_badstart.jsonl. The clone is kept.

``--space``: the learning rate's range in the bad start's space, ``wide`` (5 decades, 1e-5 to 1) or ``documented``
(1e-4 to 1e-1, the range README and docs/search.md suggest); the network and label smoothing the same in both.
``--train-images``: ``data.max_train_samples`` of a new clone (more images: trainings whose test accuracy varies less
between near-equal params).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from common import REPO, append_jsonl, clone_checkout, markdown_table, print_machine, run_in_clone
from omegaconf import OmegaConf
from search_compare import COMMON, add_all, measure, set_seed, tested_once

TODAY = OmegaConf.load(REPO / "params.yaml")
DEFAULTS = {"train.base_lr": TODAY.train.base_lr, "model.name": TODAY.model.name}
BAD_START = {"train.base_lr": TODAY.train.base_lr / 30, "model.name": "seed_cnn", "num_epochs": COMMON["num_epochs"]}
BAD_SPACES = {"wide": {"train.base_lr": "loguniform(1e-5, 1.0)"},
              "documented": {"train.base_lr": "loguniform(1e-4, 1e-1)"}}
BAD_SPACE = {"model.name": "choice(seed_cnn, resnet_compact, resnet_small)",
             "train.label_smoothing": "uniform(0.0, 0.3)"}
STUDY_PREFIX = {"wide": "bad", "documented": "baddoc"}  # the wide space's studies keep their first names
FEW_EPOCHS = {"num_epochs": 2, **DEFAULTS}
FEW_SPACE = {"train.base_lr": "loguniform(1e-4, 1.0)", "train.warmup_epochs": "uniform(0.0, 1.0)",
             "train.label_smoothing": "uniform(0.0, 0.3)"}


def commit_params(clone: Path, params: dict, message: str) -> None:
    """``params`` (dotted keys) into the clone's params.yaml, committed when that changed anything."""
    cfg = OmegaConf.load(clone / "params.yaml")
    for key, value in params.items():
        OmegaConf.update(cfg, key, value, merge=False)
    OmegaConf.save(cfg, clone / "params.yaml")
    add_all(clone)
    if run_in_clone(["git", "status", "--porcelain"], clone)[0].strip():
        run_in_clone(["git", "commit", "-qm", message], clone)


def study(clone: Path, name: str, trials: int) -> dict:
    """Study ``name`` run (continued if it exists) with TPE and median pruning; what it cost and found."""
    _, seconds = run_in_clone(["python", "-m", "ddpipe.search", "run", f"search.study={name}", "search.sampler=tpe",
                               "search.pruner=median", f"search.trials={trials}"], clone)
    return {"run_s": seconds, **measure(clone, name)}


def defaults_tested(clone: Path, name: str) -> float | None:
    """Today's defaults trained once at the clone's other params (the train stage, a DVC experiment), tested once."""
    refs = run_in_clone(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], clone)[0].split()
    if not any(r.endswith(f"/{name}") for r in refs):
        run_in_clone(["dvc", "exp", "run", "train", "-n", name,
                      *[a for key, value in DEFAULTS.items() for a in ("-S", f"{key}={value}")]], clone)
    return tested_once(clone, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clone", type=Path, default=Path("/tmp/badstart-clone"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--few-seed", type=int, default=0, help="the seed of the 2-epoch task (-1: skip it)")
    parser.add_argument("--space", choices=sorted(BAD_SPACES), default="wide",
                        help="the bad start's learning-rate range: 1e-5 to 1 (wide) or 1e-4 to 1e-1 (documented)")
    parser.add_argument("--train-images", type=int, default=COMMON["data.max_train_samples"],
                        help="data.max_train_samples of a new clone (an existing clone keeps its own)")
    args = parser.parse_args()
    print_machine()
    clone = args.clone.resolve()
    if not (clone / ".git").is_dir():
        clone.mkdir(parents=True)
        clone_checkout(clone, {**COMMON, "data.max_train_samples": args.train_images},
                       "bench: a search from a bad start")
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        space = {**BAD_SPACES[args.space], **BAD_SPACE}
        commit_params(clone, {**BAD_START, "search.space": space}, f"bench: the bad start, {args.space} space")
        set_seed(clone, seed)
        name = f"{STUDY_PREFIX[args.space]}-s{seed}"
        result = {"task": f"bad start, {args.space} space", "seed": seed, **study(clone, name, args.trials),
                  "reference": "defaults", "reference_test": defaults_tested(clone, f"defaults-s{seed}")}
        results.append(result)
        append_jsonl("search_badstart", [result])
        print(f"{name}: best trial {result['best_number']} test {result['best_test']}, defaults "
              f"{result['reference_test']}", flush=True)
    if args.few_seed >= 0:
        commit_params(clone, {**FEW_EPOCHS, "search.space": FEW_SPACE}, "bench: a budget of 2 epochs")
        set_seed(clone, args.few_seed)
        name = f"few-s{args.few_seed}"
        result = {"task": "2 epochs", "seed": args.few_seed, **study(clone, name, args.trials)}
        result.update(reference="defaults (trial 0)", reference_test=result["defaults_test"])
        results.append(result)
        append_jsonl("search_badstart", [result])

    rows = []
    for r in results:
        best = next(t for t in r["trials"] if t["number"] == r["best_number"])
        chosen = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in best["params"].items())
        gap = (r["best_test"] - r["reference_test"]) * 100 if None not in (r["best_test"], r["reference_test"]) \
            else None
        rows.append([r["task"], r["seed"], f"{r['states']['COMPLETE']} / {r['states']['PRUNED']}", r["epochs"],
                     f"{r['run_s']:.0f}", f"{r['defaults_val']:.4f}",
                     f"{r['best_number']}: {chosen}",
                     f"{r['best_val']:.4f} / {r['best_test']:.4f}", f"{r['reference_test']:.4f}",
                     f"{gap:+.2f}" if gap is not None else "-"])
    print("\n" + markdown_table(["task", "seed", "completed / pruned", "epochs", "run wall-s", "trial 0: val",
                                 "chosen trial", "chosen: val / test", "reference: test", "chosen - reference"],
                                rows))


if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parents[1])
    main()
