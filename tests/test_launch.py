"""ddpipe.launch: the torchrun command it builds, and how it passes a scheduler's stop on."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from ddpipe.preemption import EXIT_PREEMPTED
from tests.conftest import ROOT


def test_launch_asks_torchrun_to_pass_on_the_stop_signals(tiny_cfg) -> None:
    from ddpipe.launch import torchrun_command

    cmd = torchrun_command(tiny_cfg(), 2, ["num_epochs=1"])
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in cmd
    assert "--shutdown-timeout=60" in cmd and "--standalone" in cmd
    assert cmd[-1] == "num_epochs=1" and cmd[-2].endswith("stages/train.py")
    dvc = (ROOT / "dvc.yaml").read_text()
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in dvc
    assert "--shutdown-timeout=${distributed.shutdown_timeout_s}" in dvc


def _signal_self_soon(signum: int, after: float) -> None:
    threading.Timer(after, os.kill, (os.getpid(), signum)).start()


def test_a_stop_signal_is_passed_on_and_the_launcher_exits_75() -> None:
    """SIGTERM to the launcher reaches its child (torchrun in real use); the child's failure after a
    stop becomes 75, "resume me"."""
    from ddpipe.launch import run_forwarding_stops

    child = [sys.executable, "-c", "import signal, sys, time; "
             "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3)); time.sleep(60); sys.exit(0)"]
    before = signal.getsignal(signal.SIGTERM)
    _signal_self_soon(signal.SIGTERM, 1.0)
    start = time.time()
    assert run_forwarding_stops(child) == EXIT_PREEMPTED
    assert time.time() - start < 30  # the child ended on the forwarded signal, not its 60 s sleep
    assert signal.getsignal(signal.SIGTERM) == before  # the launcher's handlers are gone again


def test_without_a_stop_the_child_exit_code_is_kept() -> None:
    from ddpipe.launch import run_forwarding_stops

    assert run_forwarding_stops([sys.executable, "-c", "raise SystemExit(4)"]) == 4
    assert run_forwarding_stops([sys.executable, "-c", "pass"]) == 0
