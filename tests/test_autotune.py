"""`auto` by measuring (issue 62, item 1; issue 71): each candidate timed once per machine kind and cached under a key
that moves with what it measured, in interleaved rounds fed by the training's loader, the table's pick kept unless
another is faster by the margin, explicit values winning, the launcher's choice what its workers train, global rank
0's on every rank, and the run saying why."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
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
    another machine kind's key; a cache older than MAX_AGE_S is measured again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name, value in (("ROUND_STEPS", (1, 1)), ("ROUNDS", 3), ("WARMUP_STEPS", 1), ("SCREEN_STEPS", 1)):
        monkeypatch.setattr(autotune, name, value)
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
    assert all(len(rates) in (1, 3) for rates in first.samples[:4])  # 3 rounds, or screened out after one sample
    cached = tmp_path / "ddpipe" / "auto" / f"{first.key}.json"
    assert autotune._cached(cached) == second
    monkeypatch.setattr(autotune, "MAX_AGE_S", -1.0)  # every cache file is too old now: none is read
    assert autotune._cached(cached) is None


class FakeTimer:
    """A StepTimer whose candidates run at ``true(candidate, threads)`` images/s, each timed step's rate off by a
    uniform factor within ±``noise`` (seeded); ``burst(candidate, round)``: a factor on a whole sample (the host
    busy, or idle, for a moment). It records what it timed."""

    def __init__(self, true: Callable, noise: float = 0.0, seed: int = 0, burst: Callable | None = None) -> None:
        self.true, self.noise, self.rng, self.burst = true, noise, random.Random(seed), burst
        self.timed: list[tuple] = []

    def rates(self, plan: list) -> list[float]:
        out = []
        for s in plan:
            name, batch, precision, channels_last = s.candidate
            self.timed.append((name, precision, channels_last, s.threads))
            rate = self.true(s.candidate, s.threads) * (self.burst(s.candidate, len(self.timed)) if self.burst else 1)
            seconds = sum(batch / (rate * self.rng.uniform(1 - self.noise, 1 + self.noise)) for _ in range(s.steps))
            out.append(batch * s.steps / seconds)
        return out

    def keep_only(self, candidates: list) -> None:
        pass


@pytest.mark.parametrize("one, kept", [(2000.0, 1), (1020.0, 0)])
def test_where_the_cores_are_hyperthreads_the_fastest_is_timed_again_with_a_thread_per_core(
        monkeypatch: pytest.MonkeyPatch, one: float, kept: int) -> None:
    """Two logical CPUs on one physical core (a cloud VM's two vCPUs): the fastest candidate is timed again with one
    thread, in rounds against two, which the training then takes when it is more than MARGIN faster; two threads
    otherwise (0: a thread per core of the process's share). A user's distributed.threads_per_process is all that
    is timed."""
    monkeypatch.setattr(autotune, "cpu_count", lambda: 2)
    monkeypatch.setattr(autotune, "physical_cores", lambda: 1)
    timer = FakeTimer(lambda c, threads: (one if threads == 1 else 1000.0) + (10.0 if (c[0], c[3]) ==
                                                                              ("resnet_compact", True) else 0))
    ask = _ask(precision="fp32")
    choice = autotune.measure(ask, "k", timer)
    assert timer.timed[:4] == [(n, "fp32", cl, 2) for n in ("resnet_compact", "resnet_small") for cl in (True, False)]
    rounds = 4 * autotune.ROUNDS  # every candidate kept: none is below half the fastest
    assert timer.timed[4:4 + rounds] == timer.timed[:4] * autotune.ROUNDS  # interleaved: each round times each
    # the fastest, again with a thread per core, in rounds against itself with two
    assert timer.timed[4 + rounds:] == [("resnet_compact", "fp32", True, t) for t in (2, 1)] * autotune.ROUNDS
    assert choice.threads == kept and choice.table[-1][0].endswith("1 process x 1 thread(s)")
    assert (choice.model_name, choice.channels_last) == ("resnet_compact", True)
    timer.timed.clear()
    assert autotune.measure(replace(ask, threads=2), "k", timer).threads == 2 and {t[-1] for t in timer.timed} == {2}


TABLE_PICK = ("resnet_compact", 128, "bf16", True)


def _rates(**faster: float) -> Callable:
    """True images/s of the 8 candidates of a bf16 CPU: the table's pick and its contiguous twin 1e6 (fast enough for
    the most steps a round allows), the others 40% of that (fp32, resnet_small) unless ``faster`` names them."""
    def rate(c: tuple, threads: int) -> float:
        label = f"{c[0]}_{c[2]}_{'cl' if c[3] else 'contiguous'}"
        base = 1e6 if c[0] == "resnet_compact" and c[2] == "bf16" else 0.4e6
        return base * faster.get(label, 1.0)
    return rate


@pytest.mark.parametrize("seed", range(50))
def test_noise_of_25_percent_a_step_neither_moves_a_tie_nor_hides_a_30_percent_gain(
        monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Each timed step's rate off by up to ±25% (seeded, 50 seeds): the table's pick stays when its twin (the same
    network in the other layout) runs as fast, and the twin replaces it when 30% faster; the run records the spread
    and why."""
    monkeypatch.setattr(autotune, "cpu_supports_bf16", lambda: True)
    ask = _ask(table_pick=TABLE_PICK)
    assert len(ask.candidates()) == 8
    tie = autotune.measure(ask, "k", FakeTimer(_rates(), noise=0.25, seed=seed))
    assert (tie.model_name, tie.batch_size_per_rank, tie.precision, tie.channels_last) == TABLE_PICK, tie.basis
    assert "kept" in tie.basis or "the table's pick, the fastest" in tie.basis
    assert 0 < tie.spread < 0.6 and tie.rate > 0
    gain = autotune.measure(ask, "k", FakeTimer(_rates(resnet_compact_bf16_contiguous=1.3), noise=0.25, seed=seed))
    assert (gain.model_name, gain.precision, gain.channels_last) == ("resnet_compact", "bf16", False), gain.basis
    assert "over the table's" in gain.basis


def test_a_burst_of_load_in_one_round_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host twice as fast for one of the twin's samples (a neighbour paused) or half as fast for one of the
    table's pick's (a neighbour started): each one's median over the rounds moves little, the table's pick stays."""
    monkeypatch.setattr(autotune, "cpu_supports_bf16", lambda: True)
    ask = _ask(table_pick=TABLE_PICK)
    twin = ("resnet_compact", 128, "bf16", False)
    for candidate, factor in ((twin, 2.0), (TABLE_PICK, 0.5)):
        seen: list[int] = []

        def burst(c: tuple, n: int, candidate: tuple = candidate, factor: float = factor, seen: list = seen) -> float:
            if c == candidate and n > 8 and not seen:  # once, in a round (after the screening's 8 samples)
                seen.append(n)
                return factor
            return 1.0

        choice = autotune.measure(ask, "k", FakeTimer(_rates(), burst=burst))
        assert seen and (choice.model_name, choice.batch_size_per_rank, choice.precision, choice.channels_last) == \
            TABLE_PICK, choice.basis
        assert choice.summary().count("(screened out)") == 6  # fp32 and resnet_small, 40% as fast: not timed again


def test_the_key_moves_with_everything_the_measurement_depends_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """The candidates' definitions, the table's pick, the code of the networks and of the timed step, torch's,
    torchvision's, oneDNN's and ddpipe's versions and the CPU quota unrounded (1.5 CPUs count 2 CPUs, as 2 CPUs do):
    a change of any is another key, so it is measured again."""
    import ddpipe

    source = tmp_path / "ddpipe"
    for name in autotune.CODE:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes((autotune.SOURCE / name).read_bytes())
    monkeypatch.setattr(autotune, "SOURCE", source)
    ask = _ask(table_pick=("resnet_compact", 128, "fp32", True))
    first, parts = autotune.machine_key(ask)
    assert parts["onednn"] and parts["torchvision"] and parts["ddpipe"] == ddpipe.__version__

    def edit(name: str) -> Callable[[], int]:
        return lambda: (source / name).write_text((source / name).read_text() + "\n# changed\n")

    changes: dict[str, Callable[[], object]] = {  # each on top of the ones before
        "recipes": lambda: monkeypatch.setitem(autotune.RECIPES, "small", (("resnet_compact", 64),)),
        "margin": lambda: monkeypatch.setattr(autotune, "MARGIN", 0.2),
        "networks' code": edit("models/nets.py"),
        "network catalog's code": edit("models/catalog.py"),
        "timed step's code": edit("engine/timing.py"),
        "timed step's optimizer": edit("engine/optimizer.py"),
        "torch": lambda: monkeypatch.setattr(torch, "__version__", "9.9.9"),
        "torchvision": lambda: monkeypatch.setattr(autotune, "_installed", lambda name: "9.9.9"),
        "oneDNN": lambda: monkeypatch.setattr(autotune, "onednn_version", lambda: "9.9"),
        "ddpipe": lambda: monkeypatch.setattr(ddpipe, "__version__", "9.9.9"),
        "quota": lambda: monkeypatch.setattr(autotune, "cpu_quota_exact", lambda: 1.5),
    }
    keys = {"before": first,
            "table's pick": autotune.machine_key(replace(ask, table_pick=("resnet_small", 256, "fp32", True)))[0]}
    for what, change in changes.items():
        change()
        keys[what] = autotune.machine_key(ask)[0]
    assert len(set(keys.values())) == len(keys), keys


def test_a_choice_fills_only_what_is_auto(tmp_path: Path, prepared: Path) -> None:
    choice = autotune.Choice("resnet_small", 48, "fp32", False, 2, "k", "cache x", (("row", 1.0), ("other", 2.0)),
                             ((0.9, 1.0, 1.2), (2.0,)), 1.0, 0.3, "why")
    cfg = load_config(args_for(tmp_path, prepared, "train.batch_size_per_rank=auto"), params_file=PARAMS)
    run = resolve(cfg, torch.device("cpu"), choice=choice)
    assert (run.model_name, run.batch_size_per_rank, run.precision, run.channels_last) == \
        ("resnet_small", 48, "fp32", False)
    assert run.eval_batch_size_per_rank == 100  # tiny_overrides sets it
    assert run.params()["auto_key"] == "k" and run.params()["auto_source"] == "cache x"
    assert run.params()["auto_basis"] == "why" and run.params()["auto_spread"] == 0.3
    assert run.params()["auto_table"] == "row: 1/s [1-1]; other: 2/s (screened out)"
    assert autotune.Choice.from_json(choice.to_json()) == choice
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
    assert devices.cpu_quota_exact(v2) == 1.5  # what auto's key records: 1.5 CPUs compute unlike 2
    (v2 / "pod" / "cpu.max").write_text("max 100000\n")
    assert devices.cpu_quota(v2) is None and devices.cpu_quota_exact(v2) is None
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


def test_the_timed_steps_are_fed_by_the_trainings_loader_and_its_workers(tmp_path: Path, prepared: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """What is timed is what trains: a measurement's batches come from the training's DataLoader over paths.prepared,
    with the loader workers the training would start, normalised by its transform in each candidate's memory format,
    with its labels; the table's pick is among the candidates, and the key says what fed the steps."""
    from ddpipe.data.store import open_split
    from ddpipe.engine import resolved
    from ddpipe.engine.timing import LoaderFeed

    cfg = load_config(args_for(tmp_path, prepared, "train.auto_by=measured", "data.num_workers=1",
                               "train.precision=fp32"), params_file=PARAMS)
    table = resolve(cfg, torch.device("cpu"))
    asked: list = []
    monkeypatch.setattr(resolved, "choose", lambda ask, feed: asked.append((ask, feed)) or "chosen")
    assert measured_choice(cfg, torch.device("cpu")) == "chosen"
    ((ask, make_feed),) = asked
    assert ask.table_pick == (table.model_name, 32, "fp32", table.channels_last) and ask.table_pick in ask.candidates()
    assert "raw images, 1 loader worker(s)" in ask.feed
    feed = make_feed()
    try:
        assert isinstance(feed, LoaderFeed) and feed.data.loader.loader.num_workers == 1
        first, second = feed.serve([8, 16])
        x, labels, targets = feed.inputs(second, channels_last=False)
        assert x.shape == (16, 1, 28, 28) and x.dtype == torch.float32 and targets is None
        expected = torch.as_tensor(open_split(prepared, "train").labels[feed.order[8:24].numpy()], dtype=labels.dtype)
        assert torch.equal(labels, expected)  # the training split's samples, in a seeded shuffle
        assert abs(float(x.mean())) < 1.5 and 0.3 < float(x.std()) < 3  # normalised as the training normalises
        loss = feed.loss(torch.zeros(16, 10, requires_grad=True), labels, targets)
        assert loss.item() == pytest.approx(torch.log(torch.tensor(10.0)).item(), rel=1e-4)
    finally:
        feed.close()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_timed_step_is_the_trainings_step_its_optimizer_and_its_gradient_check(optimizer: str) -> None:
    """The timed step runs the training's own Optimization of the feed's train section (timed with plain SGD, the
    chosen candidate ran 1.21x the training's images/s): its optimizer moves the weights, and a gradient that is not
    finite stops it before the update, as in the training."""
    from dataclasses import replace

    from ddpipe.config.schema import ModelConfig, TrainConfig
    from ddpipe.engine.optimizer import Diverged
    from ddpipe.engine.timing import SyntheticFeed, _Step

    feed = SyntheticFeed(1, 10, 28)
    feed.train = replace(TrainConfig(), optimizer=optimizer)
    step = _Step(ModelConfig(name="resnet_compact", width=8), feed.train, 1, 10, ("resnet_compact", 4, "fp32", False))
    assert type(step.optim.optimizer).__name__ == {"adamw": "AdamW", "sgd": "SGD"}[optimizer]
    before = [p.detach().clone() for p in step.module.parameters()]
    step(feed, (4,))
    assert any(not torch.equal(a, b) for a, b in zip(before, step.module.parameters()))
    after = [p.detach().clone() for p in step.module.parameters()]
    feed.loss = lambda logits, labels, targets: logits.sum() * float("inf")  # a loss gone to inf
    with pytest.raises(Diverged):
        step(feed, (4,))
    assert all(torch.equal(a, b) for a, b in zip(after, step.module.parameters()))
