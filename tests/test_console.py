"""The ``ddpipe`` command (ddpipe.console.subcommands): one command with subcommands, each the main() of a module."""

from __future__ import annotations

import sys

import pytest

from ddpipe.console.subcommands import SUBCOMMANDS
from tests.conftest import ROOT, run


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


def test_python_dash_m_ddpipe_is_the_same_command_and_the_package_commands_still_answer() -> None:
    via_script = run(["ddpipe", "config", "num_epochs=3"], cwd=ROOT).stdout
    assert via_script == run([sys.executable, "-m", "ddpipe", "config", "num_epochs=3"], cwd=ROOT).stdout
    assert via_script == run([sys.executable, "-m", "ddpipe.config", "num_epochs=3"], cwd=ROOT).stdout
    assert "num_epochs: 3" in via_script
