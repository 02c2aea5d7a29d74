"""`auto` by measuring (issue 62, item 1): each candidate timed once per machine kind and cached, explicit values
winning, the launcher's choice what its workers train, global rank 0's on every rank, and the run saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ddpipe.config.load import load_config
from ddpipe.config.schema import ModelConfig
from ddpipe.core.devices import cpu_supports_bf16
from ddpipe.engine import autotune
from ddpipe.engine.resolved import measured_choice, resolve
from tests.conftest import PARAMS, args_for, spawn, subprocess_env

TINY = ModelConfig(name="auto", width=8)


def _ask(**given) -> autotune.Ask:  # noqa: ANN003
    fields = {"network": None, "model": TINY, "batch_size_per_rank": None, "precision": None, "channels_last": None,
              "threads": None, "channels": 1, "classes": 10, "side": 28, "large": False, **given}
    return autotune.Ask(**fields)


def test_the_candidates_are_the_recipes_in_each_precision_and_layout_and_explicit_values_narrow_them() -> None:
    precisions = ["fp32", "bf16"] if cpu_supports_bf16() else ["fp32"]
    every = _ask().candidates()
    assert {(n, b) for n, b, _, _ in every} == {("resnet_compact", 128), ("resnet_small", 256)}
    assert sorted({p for _, _, p, _ in every}) == sorted(precisions) and {c for *_, c in every} == {True, False}
    assert len(every) == 2 * len(precisions) * 2
    fixed = _ask(network="resnet_small", batch_size_per_rank=64, precision="fp32", channels_last=False).candidates()
    assert fixed == [("resnet_small", 64, "fp32", False)]
    assert _ask(network="my_net").candidates()[0][:2] == ("my_net", 128)  # a network of the user's: measured too


def test_measured_once_per_machine_kind_then_read_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """The first choice times every candidate and writes the cache; the second reads it; another input shape is
    another machine kind's key."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(autotune, "TIMED_STEPS", 1)
    said: list[str] = []
    ask = _ask(batch_size_per_rank=16, precision="fp32")
    first = autotune.choose(ask, said.append)
    assert first.source.startswith("measured in ") and said and "cached in" in said[0], said
    rows = [label for label, _ in first.table]
    threads = autotune.cpu_count()
    extra = len(autotune.thread_counts(ask)) - 1  # the fastest again with fewer threads, where they are fewer
    assert len(rows) == 2 * 2 + extra and all(label.endswith(f"1 process x {threads} thread(s)")
                                              for label in rows[:4]), rows
    assert all(rate > 0 for _, rate in first.table)
    assert (first.model_name, first.batch_size_per_rank, first.precision) in \
        {(n, 16, "fp32") for n in ("resnet_compact", "resnet_small")}
    assert first.threads in (0, *autotune.thread_counts(ask)[1:])  # the layout is not measured: one process per node
    second = autotune.choose(ask, said.append)
    assert second.source == f"cache {tmp_path / 'ddpipe' / 'auto' / (first.key + '.json')}" and len(said) == 1
    assert replace(second, source="") == replace(first, source="")
    assert autotune.machine_key(replace(ask, side=32))[0] != first.key


@pytest.mark.parametrize("one, kept", [(2000.0, 1), (1020.0, 0)])
def test_where_the_cores_are_hyperthreads_the_fastest_is_timed_again_with_a_thread_per_core(
        monkeypatch: pytest.MonkeyPatch, one: float, kept: int) -> None:
    """Two logical CPUs on one physical core (a cloud VM's two vCPUs): the fastest candidate is timed again with one
    thread, which the training then takes when it is more than THREADS_MARGIN faster; two threads otherwise (0: a
    thread per core of the process's share). A user's distributed.threads_per_process is all that is timed."""
    monkeypatch.setattr(autotune, "cpu_count", lambda: 2)
    monkeypatch.setattr(autotune, "physical_cores", lambda: 1)
    timed: list[tuple] = []

    def rate(ask, name, batch, precision, channels_last, threads):  # noqa: ANN001, ANN202
        timed.append((name, precision, channels_last, threads))
        return (one if threads == 1 else 1000.0) + (10.0 if (name, channels_last) == ("resnet_compact", True) else 0)

    monkeypatch.setattr(autotune, "images_per_s", rate)
    ask = _ask(precision="fp32")
    choice = autotune.measure(ask, "k")
    assert timed[:4] == [(n, "fp32", cl, 2) for n in ("resnet_compact", "resnet_small") for cl in (True, False)]
    assert timed[4:] == [("resnet_compact", "fp32", True, 1)]  # the fastest, again with a thread per core
    assert choice.threads == kept and choice.table[-1][0].endswith("1 process x 1 thread(s)")
    assert (choice.model_name, choice.channels_last) == ("resnet_compact", True)
    timed.clear()
    assert autotune.measure(replace(ask, threads=2), "k").threads == 2 and {t[-1] for t in timed} == {2}


def test_a_choice_fills_only_what_is_auto(tmp_path: Path, prepared: Path) -> None:
    choice = autotune.Choice("resnet_small", 48, "fp32", False, 2, "k", "cache x", (("row", 1.0),))
    cfg = load_config(args_for(tmp_path, prepared, "train.batch_size_per_rank=auto"), params_file=PARAMS)
    run = resolve(cfg, torch.device("cpu"), choice=choice)
    assert (run.model_name, run.batch_size_per_rank, run.precision, run.channels_last) == \
        ("resnet_small", 48, "fp32", False)
    assert run.eval_batch_size_per_rank == 100  # tiny_overrides sets it
    assert run.params()["auto_key"] == "k" and run.params()["auto_source"] == "cache x"
    assert run.trajectory()["train.batch_size_per_rank"] == 48  # what it took, not `auto`
    assert run.threads_per_process == 1  # args_for's distributed.threads_per_process wins over the choice's 2
    unpinned = resolve(replace(cfg, distributed=replace(cfg.distributed, threads_per_process=None)),
                       torch.device("cpu"), choice=choice)
    assert unpinned.threads_per_process == 2
    assert resolve(unpinned.cfg, torch.device("cpu"), choice=replace(choice, threads=0)).threads_per_process is None
    explicit = load_config(args_for(tmp_path, prepared, "model.name=resnet_compact", "train.batch_size_per_rank=32",
                                    "train.precision=bf16", "train.channels_last=on"), params_file=PARAMS)
    run = resolve(explicit, torch.device("cpu"), choice=choice)
    assert (run.model_name, run.batch_size_per_rank, run.precision, run.channels_last) == \
        ("resnet_compact", 32, "bf16", True)
    assert measured_choice(cfg, torch.device("cpu")) is None  # train.auto_by=table (tiny_overrides): the table


def _agree(rank: int, world_size: int, tmp: Path, prepared: Path, out: Path) -> None:
    from ddpipe.core.ranks import DistInfo
    from ddpipe.engine.loop import agreed_auto

    mine = autotune.Choice("resnet_small" if rank else "resnet_compact", 32 + rank, "fp32", rank == 0, 1, f"k{rank}")
    cfg = load_config(args_for(tmp, prepared), params_file=PARAMS)
    run = agreed_auto(resolve(cfg, torch.device("cpu"), choice=mine),
                      DistInfo(distributed=True, rank=rank, world_size=world_size, local_rank=rank,
                               local_world_size=world_size, backend="gloo", sums="gloo"))
    (out / f"{rank}.json").write_text(json.dumps([run.model_name, run.batch_size_per_rank, run.channels_last]))


def test_every_rank_trains_global_rank_0s_choice(tmp_path: Path, prepared: Path) -> None:
    """Two nodes whose launchers chose differently (each its own machine's measurement): rank 1 takes rank 0's."""
    spawn(_agree, 2, tmp_path, prepared, tmp_path)
    assert [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)] == [["resnet_compact", 32, True]] * 2


def test_a_training_measures_hands_the_choice_to_its_workers_and_records_why(tmp_path: Path, prepared: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``train.auto_by=measured`` through the launcher: it measures (said, cached under XDG_CACHE_HOME), its worker
    trains that choice, and the MLflow run's params say it (auto_key, auto_source, the table); the next training on
    this machine kind reads the cache."""
    from mlflow import MlflowClient

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = args_for(tmp_path, prepared, "train.auto_by=measured", "train.precision=fp32", "train.channels_last=off",
                    "distributed.nproc_per_node=1", "num_epochs=1")
    done = subprocess.run([sys.executable, "-m", "ddpipe.launch", *args], env=subprocess_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "auto: measured 2 candidate(s) on this CPU in" in log, log[-3000:]
    (cached,) = (tmp_path / "cache" / "ddpipe" / "auto").glob("*.json")
    choice = json.loads(cached.read_text())["choice"]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (r,) = client.search_runs([client.get_experiment_by_name("ddpipe").experiment_id])
    assert r.data.params["auto_key"] == choice["key"] and r.data.params["auto_source"].startswith("measured in ")
    assert r.data.params["model.name"] == choice["model_name"] and "1 process x 1 thread(s)" in \
        r.data.params["auto_table"]  # args_for pins distributed.threads_per_process=1: no thread count measured
    assert f"network {choice['model_name']}" in log
    again = measured_choice(load_config(args, params_file=PARAMS), torch.device("cpu"))
    assert again is not None and again.source == f"cache {cached}" and again.key == choice["key"]


def test_a_cgroups_cpu_quota_bounds_the_cpus_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's CPU limit (cgroup v2's cpu.max, v1's CFS quota, rounded up) bounds the CPUs a process counts (its
    threads, its loader workers, its share of the host); no limit, none; hyperthreads are timed with fewer threads."""
    from ddpipe.core import devices

    v2 = tmp_path / "v2"
    (v2 / "pod").mkdir(parents=True)
    (v2 / "pod" / "cpu.max").write_text("150000 100000\n")
    real_read = Path.read_text

    def cgroup(line: str):  # noqa: ANN202
        return lambda self, *a, **k: line if str(self) == "/proc/self/cgroup" else real_read(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", cgroup("0::/pod\n"))
    assert devices.cpu_quota(v2) == 2  # 1.5 CPUs: two threads' worth, rounded up
    (v2 / "pod" / "cpu.max").write_text("max 100000\n")
    assert devices.cpu_quota(v2) is None
    v1 = tmp_path / "v1" / "cpu,cpuacct" / "job"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    monkeypatch.setattr(Path, "read_text", cgroup("4:cpu,cpuacct:/job\n"))
    assert devices.cpu_quota(tmp_path / "v1") == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert devices.cpu_quota(tmp_path / "v1") is None
    monkeypatch.setattr(devices, "_own_quota", lambda: 3)
    assert devices.cpu_count() == min(3, len(os.sched_getaffinity(0)))  # no more CPUs than the quota's
    monkeypatch.setattr(autotune, "cpu_count", lambda: 8)
    monkeypatch.setattr(autotune, "physical_cores", lambda: 4)
    assert autotune.thread_counts(_ask()) == [8, 4] and autotune.thread_counts(_ask(threads=3)) == [3]
