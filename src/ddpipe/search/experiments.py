"""``ddpipe search remove [--keep N] [--dry-run]``: the DVC experiments of a study's trials removed, all but
those of the best N completed trials, so that ``dvc exp show`` stays quick however many trials the study ran.

A trial's experiment is the git ref ``refs/exps/<xx>/<baseline>/<study>-<number>`` (one per baseline it was saved
under). Removed: the experiments of every finished trial that is not among the best ``N`` completed ones (a trial that
failed after its experiment was saved included), with ``dvc exp remove`` given many refs per call (DVC's start costs
about a second each time). Left alone: a RUNNING or WAITING trial's experiment (the next ``run`` records a trial whose
driver died from its experiment) and an experiment whose number is no trial of this study. The study keeps every
trial; it records which trials' experiments were removed (its user attr :data:`REMOVED`), which ``status`` shows.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpipe.config.schema import ConfigError
from ddpipe.core.metric_names import TEST_ACCURACY
from ddpipe.launch.workspace import unrun_outputs
from ddpipe.search.driver import experiment_name
from ddpipe.search.study import SearchError

logger = logging.getLogger(__name__)

KEEP = 10  # the best completed trials whose experiments stay, unless --keep says otherwise
BATCH = 200  # refs per `dvc exp remove`: 200 refs of ~70 characters are far below any command line's limit
REMOVED = "experiments_removed"  # the study's user attr: the trials whose experiments `remove` removed
TESTED = "tested"  # the study's user attr: each trial `best --apply` evaluated on the test split, and its accuracy
KEEP_ACCEPTED = "an integer >= 0: the best completed trials whose DVC experiments stay (0: remove them all)"


@dataclass(frozen=True)
class Removal:
    """What ``remove`` was asked: keep the experiments of the best ``keep`` completed trials; only list (dry run)."""

    keep: int = KEEP
    dry_run: bool = False


@dataclass
class Selection:
    """A study's experiments in this repository, sorted out: trial number -> its refs, for each kind."""

    kept: dict[int, list[str]]
    removed: dict[int, list[str]]
    left: dict[int, str]  # trial number -> why its experiment is left alone


def keep_count(text: str | None) -> int:
    """``--keep``'s N (None: the option without a value); a bad one is a ConfigError naming the option, its value and
    what is accepted."""
    if text is None:
        raise ConfigError(f"--keep without a value is not accepted; expected {KEEP_ACCEPTED}")
    if not text.isascii() or not text.isdigit():
        raise ConfigError(f"--keep = {text!r} is not accepted; expected {KEEP_ACCEPTED}")
    return int(text)


def trial_experiments(root: Path, study: str) -> dict[int, list[str]]:
    """The DVC experiments named after ``study``'s trials in the repository at ``root``: trial number -> refs."""
    listed = subprocess.run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], cwd=root, text=True,
                            capture_output=True)
    if listed.returncode != 0:
        raise SearchError(f"git for-each-ref refs/exps failed in {root}: {_tail(listed.stderr)}")
    found: dict[int, list[str]] = {}
    for ref in listed.stdout.split():
        name = ref.rsplit("/", 1)[-1]
        number = name.removeprefix(f"{study}-")
        # refs/exps/<xx>/<baseline>/<name>; the name read back by the driver's own rule (no lr-07 for trial 7)
        if ref.count("/") >= 4 and number.isdigit() and experiment_name(study, int(number)) == name:
            found.setdefault(int(number), []).append(ref)
    return found


def ranked(study: Any) -> list[Any]:
    """The completed trials, best first; equal values in trial order, so the first is Optuna's ``best_trial``."""
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return sorted(done, key=lambda t: t.value, reverse=study.direction.name == "MAXIMIZE")  # sorted() is stable


def select(study: Any, experiments: dict[int, list[str]], keep: int) -> Selection:
    """Which of ``experiments`` stay (the best ``keep`` completed trials'), go (other finished trials'), or are left
    alone (a trial still running or waiting, a number that is no trial of the study)."""
    best = {t.number for t in ranked(study)[:keep]}
    states = {t.number: t.state.name for t in study.get_trials(deepcopy=False)}
    selection = Selection({}, {}, {})
    for number, refs in sorted(experiments.items()):
        if number in best:
            selection.kept[number] = refs
        elif number not in states:
            selection.left[number] = f"no trial {number} in study {study.study_name}"
        elif states[number] in ("RUNNING", "WAITING"):
            selection.left[number] = f"trial {number} is {states[number]}"
        else:
            selection.removed[number] = refs
    return selection


def remove(study: Any, root: Path, removal: Removal) -> str:
    """Remove the experiments ``select`` picks (unless a dry run), recording each batch's trials in the study;
    returns what was done, for the user."""
    name = study.study_name
    selection = select(study, trial_experiments(root, name), removal.keep)
    lines = [f"left alone: {experiment_name(name, n)} ({why})" for n, why in selection.left.items()]
    kept = ", ".join(experiment_name(name, n) for n in selection.kept) or "none"
    removed = [experiment_name(name, n) for n in selection.removed]
    if removal.dry_run:
        lines.append(f"search {name}: would remove {len(removed)} DVC experiment(s) (dry run: nothing removed): "
                     f"{', '.join(removed) or 'none'}")
    else:
        calls = 0
        numbers = list(selection.removed)
        for start in range(0, len(numbers), BATCH):
            batch = numbers[start:start + BATCH]
            _dvc_remove(root, [ref for n in batch for ref in selection.removed[n]])
            calls += 1
            study.set_user_attr(REMOVED, sorted({*study.user_attrs.get(REMOVED, ()), *batch}))
        lines.append(f"search {name}: removed {len(removed)} DVC experiment(s) in {calls} call(s) of dvc exp remove: "
                     f"{', '.join(removed) or 'none'}")
    lines.append(f"kept {len(selection.kept)} (the best {removal.keep} completed trials'): {kept}")
    return "\n".join(lines) + "\n"


def apply_best(best: dict[str, Any], root: Path, study: Any, test_metrics: str) -> int:
    """``best --apply``: the chosen trial evaluated once, ``dvc exp apply`` of its DVC experiment then ``dvc repro``
    in ``root`` (its train stage is up to date: a trial's experiment holds a plain training's params, no sweep of the
    study; evaluate and export run, on the test split for the first time in the search, and with
    ``mlflow.registered_model_name`` set its one version is registered and the alias decided as after any training).
    The study records the test (its user attr ``tested``: trial, experiment, test accuracy from ``test_metrics``) once
    per trial; a trial tested before is said so, and a second trial tested says how often the split has been looked
    at. Returns the first non-zero exit code, else 0; SearchError when ``remove`` removed the experiment."""
    if not best["experiment"]:
        raise SearchError(f"trial {best['number']}'s DVC experiment was removed (ddpipe search remove): "
                          "nothing to apply; run its params again with dvc exp run -S ...")
    tested = list(study.user_attrs.get(TESTED, []))
    if before := [t for t in tested if t["trial"] == best["number"]]:
        logger.info(f"note: trial {best['number']} was tested before (test accuracy {before[0][TEST_ACCURACY]:.4f}); "
                    "applied again, its test is not recorded twice")
    elif tested:
        logger.info(f"note: this study's test split was looked at before, for trial(s) "
                    f"{', '.join(str(t['trial']) for t in tested)}: each look is one more chance to fit it; the study "
                    "records this one beside")
    for cmd in (["dvc", "exp", "apply", best["experiment"]], ["dvc", "repro"]):
        logger.info(f"$ {' '.join(cmd)}")
        applying = cmd[1] == "exp"
        done = subprocess.run(cmd, cwd=root, stdin=subprocess.DEVNULL, capture_output=applying, text=True)
        if applying:  # what it said, passed on
            sys.stdout.write(done.stdout)
            sys.stderr.write(done.stderr)
        if done.returncode and not (applying and _applied_but_unrun(done, root)):
            logger.error(f"{' '.join(cmd)} exited {done.returncode}")
            return done.returncode
    if not before:
        accuracy = float(json.loads((root / test_metrics).read_text())["test"]["accuracy"])
        study.set_user_attr(TESTED, [*tested, {"trial": best["number"], "experiment": best["experiment"],
                                               TEST_ACCURACY: accuracy}])
        logger.info(f"search {study.study_name}: trial {best['number']} tested: test accuracy {accuracy:.4f} "
                    "(recorded in the study, once)")
    return 0


def _applied_but_unrun(done: subprocess.CompletedProcess, root: Path) -> bool:
    """Whether a failed ``dvc exp apply`` failed only to check out the outputs of stages the trial never ran (its
    dvc.lock has no entry for them: ddpipe.launch.workspace.drop_downstream), as in a clone whose cache never held the
    baseline's: its params and the train stage's outputs are in place, and ``dvc repro`` makes the rest."""
    failed = done.stderr.split("Checkout failed for following targets:", 1)
    if len(failed) < 2:
        return False
    targets: set[str] = set()
    for line in failed[1].strip().splitlines():  # the paths, one a line, then "Is your cache up to date?"
        if " " in line.strip() or line.startswith("<"):
            break
        targets.add(line.strip())
    if not targets or not targets <= unrun_outputs(root):
        return False
    logger.info(f"note: {', '.join(sorted(targets))}: outputs of stages the trial never ran, which no cache here "
                "holds; dvc repro makes them")
    return True


def _dvc_remove(root: Path, refs: list[str]) -> None:
    """``dvc exp remove`` of ``refs`` (full refs: a name saved under two baselines is no ambiguity)."""
    done = subprocess.run(["dvc", "exp", "remove", *refs], cwd=root, text=True, capture_output=True,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SearchError(f"dvc exp remove of {len(refs)} experiment(s) exited {done.returncode}: "
                          f"{_tail(done.stderr or done.stdout)}")


def _tail(text: str, limit: int = 500) -> str:
    """The last line a command printed (its error), cut to ``limit`` characters."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:limit] if lines else "(no output)"
