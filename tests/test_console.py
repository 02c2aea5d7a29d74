"""The ``ddpipe`` command (ddpipe.console.subcommands): one command with subcommands, each the main() of a module."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

import pytest

import ddpipe
from ddpipe.config.schema import DistributedConfig
from ddpipe.console.subcommands import SUBCOMMANDS, main
from ddpipe.core.environment import LOG_LEVEL_ENV
from ddpipe.core.logs import configure
from ddpipe.launch.torchrun import torchrun_command
from tests.conftest import ROOT, args_for, make_imagefolder, run


def test_ddpipe_help_lists_every_subcommand_and_a_wrong_one_is_refused_naming_the_accepted() -> None:
    shown = run(["ddpipe", "--help"]).stdout
    assert all(f"  {name} " in shown for name in ("launch", "search", "cluster", "sweeps", "outbox", "config")), shown
    wrong = run(["ddpipe", "serach", "run"], check=False)
    assert wrong.returncode == 2 and "no subcommand 'serach'" in wrong.stderr and "search" in wrong.stderr
    assert run(["ddpipe"], check=False).returncode == 2  # no subcommand: the usage, and a failure


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_each_subcommand_has_its_help(name: str) -> None:
    shown = run(["ddpipe", name, "--help"], cwd=ROOT)
    assert shown.returncode == 0 and "usage" in shown.stdout.lower(), shown.stdout + shown.stderr


# Commands that start no training import no torch (a second of every start): the cluster's submit, wait and status on a
# login node and its jobs' own process on a node, which run dvc exp run; config, outbox and sweeps; a search's driver
# and its status, best and remove, whose trials are dvc exp runs (issue 72)
NO_TORCH = ("ddpipe.config.__main__", "ddpipe.launch.cluster.submission", "ddpipe.launch.cluster.job",
            "ddpipe.tracking.outbox", "ddpipe.tracking.sweeps", "ddpipe.search.__main__", "ddpipe.search.driver",
            "ddpipe.search.report", "ddpipe.search.experiments")


def test_the_commands_that_train_nothing_import_no_torch() -> None:
    code = f"import importlib, sys\nfor m in {NO_TORCH!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    assert run([sys.executable, "-c", code], cwd=ROOT).stdout.strip() == "False"


def test_python_dash_m_ddpipe_is_the_same_command_and_the_package_commands_still_answer() -> None:
    via_script = run(["ddpipe", "config", "num_epochs=3"], cwd=ROOT).stdout
    assert via_script == run([sys.executable, "-m", "ddpipe", "config", "num_epochs=3"], cwd=ROOT).stdout
    assert via_script == run([sys.executable, "-m", "ddpipe.config", "num_epochs=3"], cwd=ROOT).stdout
    assert "num_epochs: 3" in via_script


# What each subcommand's --help must name: the command as typed, and its options (a nested command's own options in
# its own --help)
OPTIONS = {
    ("launch",): ["--print", "key=value", "-q", "-v"],
    ("search",): ["run", "status", "best", "remove", "-q", "-v"],
    ("search", "run"): ["--cluster", "key=value"],
    ("search", "best"): ["--json", "--apply", "key=value"],
    ("search", "remove"): ["--keep", "--dry-run", "key=value"],
    ("cluster",): ["submit", "status", "cancel", "wait", "-q", "-v"],
    ("cluster", "submit"): ["--dry-run", "--scheduler", "--partition", "--account", "--time", "--gpus-per-node",
                            "--cpus-per-node", "--mem", "--max-running", "--storage", "key=value"],
    ("cluster", "wait"): ["--timeout", "--poll"],
    ("sweeps",): ["SWEEP_NAME", "key=value", "-q", "-v"],
    ("outbox",): ["deliver", "status", "-q", "-v"],
    ("outbox", "deliver"): ["key=value"],
    ("config",): ["--schema", "--docs", "key=value", "-q", "-v"],
}


@pytest.mark.parametrize("words", sorted(OPTIONS), ids=" ".join)
def test_help_names_the_command_as_typed_and_every_option(words: tuple[str, ...],
                                                          capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as done:
        main([*words, "--help"])
    shown = capsys.readouterr().out
    assert done.value.code == 0 and shown.startswith(f"usage: ddpipe {' '.join(words)} "), shown
    assert [o for o in OPTIONS[words] if o not in shown] == [], shown


@pytest.mark.parametrize("argv", ["launch --no-such-flag", "search best --no-such-flag", "search status --no-such-flag",
                                  "search run --no-such-flag", "search remove --keep 1 --no-such-flag",
                                  "cluster status --no-such-flag", "sweeps SWEEP --no-such-flag",
                                  "outbox status --no-such-flag", "config num_epochs=3 --no-such-flag"])
def test_an_unknown_option_exits_2_naming_it_before_anything_runs(argv: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as refused:
        main(argv.split())
    said = capsys.readouterr()
    assert refused.value.code == 2 and said.out == ""
    command = " ".join(w for w in argv.split()[:2] if w.islower() and w.isalpha())  # "search best", "sweeps"
    assert f"ddpipe {command}: error: unrecognized arguments: --no-such-flag" in said.err, said.err


def test_overrides_stay_positional_wherever_they_stand_and_q_or_v_go_before_or_after_the_subcommand() -> None:
    """`key=value` after an option still overrides (argparse alone would refuse it); -q before the subcommand (refused
    before argparse) and after it."""
    for argv in (["-q", "config", "num_epochs=3", "seed=7"], ["config", "num_epochs=3", "-q", "seed=7"],
                 ["config", "-v", "num_epochs=3", "seed=7"]):
        shown = run(["ddpipe", *argv], cwd=ROOT).stdout
        assert "num_epochs: 3" in shown and "seed: 7" in shown, (argv, shown)


def test_version_is_the_installed_distributions() -> None:
    installed = importlib.metadata.version("ddpipe")
    assert run(["ddpipe", "--version"]).stdout.strip() == f"ddpipe {installed}"
    assert ddpipe.__version__ == installed  # one home: pyproject.toml


def test_the_copy_a_logged_model_carries_says_its_version_is_unknown_without_raising() -> None:
    """The package's face imported under another name (a logged model's ddpipe_<digest>, where ddpipe may not be
    installed, or another version is): no distribution of that name, so "unknown", not the installed one's."""
    spec = importlib.util.spec_from_file_location("ddpipe_0123456789abcdef", Path(ddpipe.__file__))
    carried = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(carried)
    assert carried.__version__ == "unknown"


@pytest.mark.slow
def test_messages_go_to_stderr_at_the_level_asked_results_to_stdout(prepared: Path, tmp_path: Path) -> None:
    """`ddpipe launch --print`: its result (the torchrun command) alone on stdout whatever the level; its note on
    stderr, gone under -q; -v adds the debug lines (the config's sources). DDPIPE_LOG_LEVEL, which DVC's stages read,
    sets the same levels; an error shows under -q."""
    args = args_for(tmp_path, prepared, "distributed.nproc_per_node=1", "model.name=resnet18")
    note = "the small-image variant this name meant before is 'resnet18_cifar'"
    said = {name: run(["ddpipe", *flags, "launch", "--print", *args], env=env) for name, flags, env in (
        ("default", [], None), ("-q", ["-q"], None), ("-v", ["-v"], None),
        ("env WARNING", [], {LOG_LEVEL_ENV: "warning"}))}
    command = " ".join(torchrun_command(DistributedConfig(), 1, args))
    assert {name: done.stdout for name, done in said.items()} == {name: f"{command}\n" for name in said}
    assert {name: note in done.stderr for name, done in said.items()} == {
        "default": True, "-q": False, "-v": True, "env WARNING": False}
    assert {name: "config: command line sets" in done.stderr for name, done in said.items()} == {
        "default": False, "-q": False, "-v": True, "env WARNING": False}
    assert said["-q"].stderr == said["env WARNING"].stderr == ""
    wrong = run(["ddpipe", "-q", "config", "num_epochs=abc"], check=False)
    assert wrong.returncode == 2 and "error: command line: num_epochs" in wrong.stderr and wrong.stdout == ""


def test_a_stage_says_at_dvc_s_level_and_a_bad_level_is_said_once(tmp_path: Path) -> None:
    """The stage scripts (what `dvc repro` runs) read DDPIPE_LOG_LEVEL: their line on stderr at INFO, nothing at
    WARNING; a level that is none is named, with what is accepted, and INFO holds."""
    folder = make_imagefolder(tmp_path / "folder")
    fetch = ["python", "stages/fetch.py", "data.dataset=imagefolder", f"data.source_dir={folder}",
             f"paths.raw={tmp_path}/raw"]
    shown, quiet, wrong = (run(fetch, env=env) for env in ({}, {LOG_LEVEL_ENV: "WARNING"}, {LOG_LEVEL_ENV: "loud"}))
    assert shown.stdout == quiet.stdout == quiet.stderr == "" and shown.stderr.startswith("fetched imagefolder from")
    assert wrong.stderr.splitlines()[0] == (f"warning: {LOG_LEVEL_ENV} = 'loud' is not a level; accepted: DEBUG, "
                                            "INFO, WARNING, ERROR (case does not matter); INFO it is")
    assert wrong.stderr.splitlines()[1:] == shown.stderr.splitlines()


def test_a_commands_level_reaches_the_processes_it_starts_and_ranks_past_0_say_warnings_only(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """-q or -v goes into the environment (torchrun's workers, a search's trials inherit it); a worker off global rank 0
    shows no INFO, as print0 did, but its warnings."""
    assert main(["-v", "config", "num_epochs=3"]) == 0
    assert os.environ[LOG_LEVEL_ENV] == "DEBUG"  # undone after the test (conftest)
    capsys.readouterr()
    somewhere = logging.getLogger("ddpipe.engine.loop")
    for rank, level in (("0", logging.DEBUG), ("1", logging.WARNING)):
        monkeypatch.setenv("RANK", rank)
        assert configure() == level
        somewhere.info("an epoch's line")
        somewhere.warning("warning: a rank's own trouble")
        shown = capsys.readouterr().err
        assert shown == ("an epoch's line\n" if rank == "0" else "") + "warning: a rank's own trouble\n", shown


def test_a_module_run_with_python_m_says_its_messages_under_ddpipes_logger(tmp_path: Path) -> None:
    """A module torchrun or a scheduler runs as ``python -m`` (the worker, a cluster job) is ``__main__`` there: its
    logger must still be ddpipe's, or its INFO lines vanish (Python's last-resort handler shows warnings only)."""
    mains = [p for p in (ROOT / "src" / "ddpipe").rglob("*.py") if 'if __name__ == "__main__"' in p.read_text()]
    assert mains
    for path in mains:
        assert "getLogger(__name__)" not in path.read_text(), f"{path}: logging.getLogger(__spec__.name) instead"
    # the job as a scheduler runs it: `python -m ddpipe.launch.cluster.job MANIFEST INDEX`, its first line at INFO
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"experiments": [{"workspace": "ws", "name": "x", "log": str(tmp_path / "x.log"),
                                                     "storage": "shared"}], "scheduler": "slurm",
                                    "state": str(tmp_path / "state")}))
    run([sys.executable, "-m", "ddpipe.launch.cluster.job", str(manifest), "0"], cwd=tmp_path, check=False)
    assert "experiment x, job" in (tmp_path / "x.log").read_text(), (tmp_path / "x.log").read_text()
