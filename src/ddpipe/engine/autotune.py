"""``auto`` on a CPU by measuring, once per machine kind (``train.auto_by: measured``; ``table``: the fixed table of
:mod:`ddpipe.engine.resolved`).

The first training on a host whose run leaves the network, the batch, the precision or the memory format to ``auto``
times optimizer steps of each candidate this CPU can run, fed as the training feeds them
(:mod:`ddpipe.engine.timing`: the training's DataLoader, its workers on the same cores), and keeps the table's pick
unless another is clearly faster:

- the candidates: the recipes known to reach the accuracy (:data:`RECIPES`: a network and its batch, BENCHMARKS.md
  "Which network `auto` picks"), or only the network the user named; each in fp32 and, where this process may run
  bf16 (``ddpipe.core.devices.cpu_supports_bf16``), bf16; each with channels_last and without; and the table's pick
  (what ``auto_by: table`` trains, the user's explicit values applied), as one process with a thread on each of the
  cores it may use;
- a screening: :data:`WARMUP_STEPS` untimed and :data:`SCREEN_STEPS` timed steps of each; a candidate below
  :data:`SCREEN_KEEP` of the fastest is not timed again (never the table's pick);
- :data:`ROUNDS` interleaved rounds over the others (each round times every one of them, in turn, so a slow spell
  of the host falls on all of them), a few steps each (:data:`ROUND_STEPS`, :data:`ROUNDS_BUDGET_S`); each one's
  median rate counts, and one replaces the table's pick only when faster by more than :data:`MARGIN`;
- where the CPUs are hyperthreads (``ddpipe.core.devices.physical_cores``: a cloud VM's two vCPUs are often one core's
  two threads), the choice again in rounds with a thread per physical core, whose threads wait for each other at
  every layer and may be slower than fewer: unless ``distributed.threads_per_process`` says, fewer threads become the
  training's only when faster by more than :data:`MARGIN`. (A container's CPU quota already bounds the CPUs counted:
  ``ddpipe.core.devices.cpu_count``.)

The process layout is not among them: timed side by side without DDP, two processes of one thread looked 10% faster
than one of two threads, and trained 35% slower (DDP's all-reduce and SyncBatchNorm's sums, which such a measurement
leaves out); one process per node stays, unless ``distributed.nproc_per_node`` says.

An explicit value of any of these keys wins over the measured one, and narrows what is measured. The choice is cached
per machine kind, in a file under ``$XDG_CACHE_HOME/ddpipe/auto`` (``~/.cache`` by default) named by
:func:`machine_key`: what was measured and how (the candidates, the table's pick, the loader, the steps and margin,
a digest of the code that builds and times them: :data:`CODE`), the CPU's model and flags, the cores and the CPU quota
unrounded, torch's, torchvision's, oneDNN's and ddpipe's versions, the instruction-set caps in force and the input;
later trainings read it, for :data:`MAX_AGE_S`. The launcher measures (or reads) it and hands it to its workers
(:data:`~ddpipe.core.environment.AUTO_CHOICE_ENV`); rank 0's choice is every rank's, on every node
(``ddpipe.engine.loop.train`` broadcasts it). The run records the key, where the choice came from (``measured in ...``
or ``cache <file>``), why (``auto_basis``), the spread of the chosen one's rounds and the table (``auto_key``,
``auto_source``, ``auto_basis``, ``auto_spread``, ``auto_table``; ``python -m ddpipe.engine.autotune`` prints this
host's).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

import ddpipe
from ddpipe.config.schema import ModelConfig
from ddpipe.core.devices import (
    ONEDNN_ISA_ENV,
    cpu_count,
    cpu_flags,
    cpu_quota_exact,
    cpu_supports_bf16,
    give_back_freed_memory,
    keep_freed_memory,
    physical_cores,
)
from ddpipe.core.environment import AUTO_CHOICE_ENV
from ddpipe.core.files import atomic_write_json
from ddpipe.core.processes import host_lock
from ddpipe.engine.timing import Candidate, Feed, Sample, StepTimer, SyntheticFeed

logger = logging.getLogger(__spec__.name)  # its dotted name under `python -m` too (there __name__ is "__main__")

# The recipes that reach the accuracy, by input: (model.name, train.batch_size_per_rank) of a one-process run. Small
# images (raw Fashion-MNIST): resnet_compact at 128 reached 0.923 test accuracy in 10 epochs, resnet_small at 256 0.92
# (BENCHMARKS.md, "Which network `auto` picks"). Larger inputs: ResNet-18 at 64.
RECIPES = {"small": (("resnet_compact", 128), ("resnet_small", 256)), "large": (("resnet18", 64),)}
WARMUP_STEPS = 2  # untimed, per candidate, before its first timed step (oneDNN makes its kernels for the shapes)
SCREEN_STEPS = 2  # timed, per candidate, once: which candidates the rounds time
# Screened out below this share of the fastest's screening rate: with noise of up to ±25% a step, a candidate within
# MARGIN of the fastest still shows 0.75 / 1.25 / (1 + MARGIN) = 0.52 of its rate, so only clear losers go
SCREEN_KEEP = 0.5
ROUNDS = 5  # interleaved rounds over the candidates the screening kept; each one's median over them counts
# Timed steps of each candidate in each round: as many as ROUNDS_BUDGET_S seconds of rounds allow at the screening's
# step times, within these bounds. The small networks get the most (on 2 cores the whole measurement took 6.4 s, the
# host's load near 3); ResNet-18 at 224 px gets one a round, at seconds a step on 2 cores (estimated, not timed): its
# screening and rounds then cost about a minute, as the earlier 6 steps of each candidate did
ROUND_STEPS = (1, 10)
ROUNDS_BUDGET_S = 4.0
# A candidate replaces the table's pick, and a thread per physical core replaces a thread per CPU, only when its
# median is faster by more than this. Under noise of ±25% a step (tests/test_autotune.py's FakeTimer, 5,000 seeds),
# 15% moved no tie and missed one 30% gain; 10% let the tied candidate win in 17 of the 5,000.
MARGIN = 0.15
CACHE_FORMAT = 3  # the cache file's "format_version"; another one is measured again (2: one sample per candidate)
MAX_AGE_S = 30 * 24 * 3600  # a cached choice older than this is measured again (a kernel, firmware or load since)
# The code a measurement ran (relative to the package): the networks, the candidates and the timed step, the loader
# and transforms that feed it; an edit to any of them measures again
CODE = ("models/nets.py", "models/catalog.py", "engine/autotune.py", "engine/timing.py", "engine/objective.py",
        "engine/optimizer.py", "core/devices.py", "data/loaders.py", "data/transforms.py", "data/augment.py")
SOURCE = Path(__file__).resolve().parents[1]  # the package's directory, where CODE's files are read
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "avx_vnni", "fma")


@dataclass(frozen=True)
class Choice:
    """What ``auto`` became on this machine kind: a network, its per-process batch, precision, memory format and
    threads per process (0: a thread on each core of the process's share); ``key``: the machine kind's
    (:func:`machine_key`); ``source``: measured now (and how long it took) or read from the cache file; ``table``: each
    candidate's images/s (its median over the rounds, or its screening rate) and ``samples`` the rates it is made of;
    ``rate``, ``spread`` and ``basis``: the choice's median, its rounds' (max - min) / median, and why it was chosen."""

    model_name: str
    batch_size_per_rank: int
    precision: str
    channels_last: bool
    threads: int
    key: str
    source: str = ""
    table: tuple[tuple[str, float], ...] = ()
    samples: tuple[tuple[float, ...], ...] = ()
    rate: float = 0.0
    spread: float = 0.0
    basis: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Choice:
        raw = json.loads(text)
        return cls(**{**raw, "table": tuple(tuple(row) for row in raw.get("table", ())),
                      "samples": tuple(tuple(row) for row in raw.get("samples", ()))})

    def summary(self) -> str:
        """The table as the run records it: each row's images/s and the range of its rounds (or: screened out)."""
        rows = []
        for i, (label, rate) in enumerate(self.table):
            got = self.samples[i] if i < len(self.samples) else ()
            extra = f" [{min(got):.0f}-{max(got):.0f}]" if len(got) > 1 else " (screened out)" if got else ""
            rows.append(f"{label}: {rate:.0f}/s{extra}")
        return "; ".join(rows)


@dataclass(frozen=True)
class Ask:
    """What is left to measure: the user's explicit values (None: ``auto``) and the input, for one training; the
    table's pick (what ``auto_by: table`` trains) and what feeds the steps."""

    network: str | None  # model.name, or None: auto (the recipes')
    model: ModelConfig  # the model section (its width, kwargs) each candidate network is built with
    batch_size_per_rank: int | None
    precision: str | None  # fp32 | bf16, or None: both where the CPU may
    channels_last: bool | None
    threads: int | None  # distributed.threads_per_process, or None: measured where the cores are hyperthreads
    channels: int
    classes: int
    side: int  # the input's side, px
    large: bool  # above the small-image side: torchvision's networks
    table_pick: Candidate | None = None  # None: the fastest wins, with no margin
    feed: str = "synthetic"  # what feeds the timed steps (the training's loader and its workers, described)

    def candidates(self) -> list[Candidate]:
        """(network, batch, precision, channels_last) of each candidate, the explicit values kept; the table's pick
        among them."""
        recipes = RECIPES["large" if self.large else "small"]
        if self.network is not None:
            recipes = tuple((n, b) for n, b in recipes if n == self.network) or ((self.network, recipes[0][1]),)
        precisions = [self.precision] if self.precision else ["fp32", *(["bf16"] if cpu_supports_bf16() else [])]
        layouts = [self.channels_last] if self.channels_last is not None else [True, False]
        every = [(name, self.batch_size_per_rank or batch, p, cl) for name, batch in recipes for p in precisions
                 for cl in layouts]
        return every + [self.table_pick] if self.table_pick and self.table_pick not in every else every


def machine_key(ask: Ask) -> tuple[str, dict[str, Any]]:
    """The machine kind's key (16 hex) and what it is made of: what is measured and how, the code that does it, the
    CPU's model and the flags that choose kernels, the cores and the CPU quota, the versions, the instruction-set caps
    in force, the input and what the user fixed."""
    flags = cpu_flags()
    parts = {"cpu": _cpu_model(), "flags": [f for f in FLAGS if f in flags], "cores": cpu_count(),
             "physical_cores": physical_cores(),  # "cores" already no more than a CPU quota (cpu_count)...
             "quota": cpu_quota_exact(),  # ...rounded up: 1.5 CPUs and 2 CPUs both count 2
             "torch": torch.__version__, "torchvision": _installed("torchvision"), "onednn": onednn_version(),
             "ddpipe": ddpipe.__version__, "machine": platform.machine(),
             "caps": {n: os.environ.get(n, "") for n in ("ATEN_CPU_CAPABILITY", *ONEDNN_ISA_ENV)},
             "method": {"recipes": RECIPES, "candidates": ask.candidates(), "warmup": WARMUP_STEPS,
                        "screen": [SCREEN_STEPS, SCREEN_KEEP], "rounds": [ROUNDS, ROUND_STEPS, ROUNDS_BUDGET_S],
                        "margin": MARGIN},
             "code": code_digest(), "ask": {**asdict(ask), "model": asdict(ask.model)}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16], parts


def code_digest() -> dict[str, str]:
    """Each of :data:`CODE`'s files, by its content's digest (12 hex)."""
    return {name: hashlib.sha256((SOURCE / name).read_bytes()).hexdigest()[:12] for name in CODE}


@functools.cache
def onednn_version() -> str:
    """The version of oneDNN (MKL-DNN) that torch was built with, as ``torch.__config__.show()`` says it; "" if none."""
    found = re.search(r"(?:MKL-DNN|oneDNN)\D*v?(\d+(?:\.\d+)+)", torch.__config__.show())
    return found.group(1) if found else ""


def _installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddpipe" / "auto"


def choose(ask: Ask, say: Any = None, feed: Callable[[], Feed] | None = None) -> Choice:
    """This machine kind's choice for ``ask``: the cache's, or measured now (said, with its cost) and cached. One
    process of this host measures at a time (trainings started together: the others then read what it cached).
    ``feed``: makes what feeds the timed steps, only when they are timed (the training's loader: its workers start);
    by default random batches of the input's shape."""
    say = say or logger.info
    key, parts = machine_key(ask)
    path = cache_dir() / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".lock").touch()
    except OSError as exc:  # a home that cannot be written: measured, not cached (said)
        say(f"note: auto's measurement cannot be cached in {path.parent} ({type(exc).__name__}: {exc})")
        choice, seconds = _measured(ask, key, feed)
        return replace(choice, source=f"measured in {seconds:.1f} s, not cached")
    with host_lock(path.with_suffix(".lock")):
        if (cached := _cached(path)) is not None:
            return cached
        choice, seconds = _measured(ask, key, feed)
        choice = replace(choice, source=f"measured in {seconds:.1f} s")
        atomic_write_json(path, {"format_version": CACHE_FORMAT, "measured_at": time.time(), "key": parts,
                                 "choice": json.loads(choice.to_json())})
    say(f"auto: measured {len(choice.table)} candidate(s) on this CPU in {seconds:.1f} s: {describe(choice)}; "
        f"{choice.basis}; cached in {path}")
    return choice


def _measured(ask: Ask, key: str, feed: Callable[[], Feed] | None) -> tuple[Choice, float]:
    """:func:`measure` on ``feed``'s batches (made now, closed after), and its seconds, the feed's start included."""
    start = time.perf_counter()
    keep_freed_memory()  # as the training's process will (ddpipe.distributed.group.init_distributed)
    source = feed() if feed is not None else SyntheticFeed(ask.channels, ask.classes, ask.side)
    try:
        choice = measure(ask, key, StepTimer(ask.model, ask.channels, ask.classes, source))
    finally:
        source.close()
        give_back_freed_memory()  # the candidates' steps are over (the launcher holds little while it trains)
    return choice, time.perf_counter() - start


def _cached(path: Path) -> Choice | None:
    """The choice a cache file holds, or None (none yet, unreadable, of another format or older than
    :data:`MAX_AGE_S` on this host's clock: measured again)."""
    try:
        cached = json.loads(path.read_text())
        fresh = 0 <= time.time() - float(cached.get("measured_at", 0)) <= MAX_AGE_S
        if cached.get("format_version") == CACHE_FORMAT and fresh:
            return replace(Choice.from_json(json.dumps(cached["choice"])), source=f"cache {path}")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def describe(choice: Choice) -> str:
    rate = choice.rate or (max(rate for _, rate in choice.table) if choice.table else 0.0)
    threads = f"{choice.threads} thread(s)" if choice.threads else "a thread per core"
    return (f"{choice.model_name}, batch {choice.batch_size_per_rank}, {choice.precision}, "
            f"{'channels_last' if choice.channels_last else 'contiguous'}, {threads} ({rate:,.0f} images/s)")


def measure(ask: Ask, key: str, timer: StepTimer | None = None) -> Choice:
    """Screen every candidate of ``ask`` as one process with a thread per CPU it may use, time the ones kept in
    interleaved rounds, keep the table's pick unless one is faster by more than :data:`MARGIN` (medians), then the
    choice against a thread per physical core (:func:`thread_counts`). ``timer``: times plans of steps
    (:class:`~ddpipe.engine.timing.StepTimer`; by default on random batches). The process layout is not measured
    (one process per node, as the table says, unless ``distributed.nproc_per_node`` is set): N processes timed side by
    side without DDP ran 6,581 images/s here against 5,953 for one, and trained at 3,455 (DDP's all-reduce and
    SyncBatchNorm's sums are what a layout costs; BENCHMARKS.md, "`auto` by measuring")."""
    timer = timer or StepTimer(ask.model, ask.channels, ask.classes, SyntheticFeed(ask.channels, ask.classes, ask.side))
    every, *fewer = thread_counts(ask)
    candidates = ask.candidates()
    screen = timer.rates([Sample(c, every, SCREEN_STEPS, WARMUP_STEPS) for c in candidates])
    kept = [c for c, rate in zip(candidates, screen) if rate >= SCREEN_KEEP * max(screen) or c == ask.table_pick]
    timer.keep_only(kept)
    rounds = dict(zip(kept, _rounds(timer, [(c, every) for c in kept], [screen[candidates.index(c)] for c in kept])))
    medians = {c: statistics.median(rates) for c, rates in rounds.items()}
    pick, basis = _pick(medians, ask.table_pick)
    table = [(_label(c, every), medians.get(c, rate)) for c, rate in zip(candidates, screen)]
    samples = [tuple(rounds.get(c, (rate,))) for c, rate in zip(candidates, screen)]
    threads, rate, spread = 0 if ask.threads is None else ask.threads, medians[pick], _spread(rounds[pick])
    timer.keep_only([pick])
    for count in fewer:
        mine, theirs = _rounds(timer, [(pick, every), (pick, count)], [medians[pick]] * 2)
        table.append((_label(pick, count), statistics.median(theirs)))
        samples.append(tuple(theirs))
        gain = statistics.median(theirs) / statistics.median(mine) - 1
        if gain > MARGIN:
            threads, rate, spread = count, statistics.median(theirs), _spread(theirs)
        basis += (f"; {count} thread(s) {gain:+.0%} against {every} (margin {MARGIN:.0%}): "
                  f"{count if threads == count else every} taken")
    timer.keep_only([])
    return Choice(*pick, threads, key, table=tuple(table), samples=tuple(samples), rate=rate, spread=spread,
                  basis=basis)


def _rounds(timer: StepTimer, entries: list[tuple[Candidate, int]], rates: list[float]) -> list[list[float]]:
    """:data:`ROUNDS` rounds over ``entries`` ((candidate, threads)), each round timing each in turn; each entry's
    rate in each round. The steps per round: what :data:`ROUNDS_BUDGET_S` allows at ``rates`` (images/s)."""
    seconds_a_round = sum(c[1] / max(rate, 1e-9) for (c, _), rate in zip(entries, rates))
    low, high = ROUND_STEPS
    steps = max(low, min(high, int(ROUNDS_BUDGET_S / ROUNDS / max(seconds_a_round, 1e-9))))
    # the first step of all is untimed: the loader starts reading ahead again
    plan = [Sample(c, threads, steps, warmup=int(r == i == 0)) for r in range(ROUNDS)
            for i, (c, threads) in enumerate(entries)]
    timed = timer.rates(plan)
    return [timed[i::len(entries)] for i in range(len(entries))]


def _pick(medians: dict[Candidate, float], table_pick: Candidate | None) -> tuple[Candidate, str]:
    """The table's pick unless another candidate's median beats it by more than :data:`MARGIN` (no pick: the
    fastest); and why."""
    best = max(medians, key=medians.__getitem__)
    if table_pick is None:
        return best, f"the fastest: {_label(best)}"
    gain = medians[best] / medians[table_pick] - 1
    if best == table_pick:
        return best, f"the table's pick, the fastest: {_label(best)}"
    if gain > MARGIN:
        return best, f"{_label(best)} {gain:+.0%} over the table's {_label(table_pick)} (margin {MARGIN:.0%})"
    return table_pick, (f"the table's pick {_label(table_pick)} kept: the fastest, {_label(best)}, {gain:+.0%} "
                        f"(margin {MARGIN:.0%})")


def _spread(rates: list[float]) -> float:
    """(max - min) / median of one candidate's rounds."""
    return (max(rates) - min(rates)) / statistics.median(rates)


def thread_counts(ask: Ask) -> list[int]:
    """The thread counts a measurement times: the user's (``distributed.threads_per_process``), or a thread per
    CPU this process may use (its affinity, no more than its cgroup's quota: ``ddpipe.core.devices.cpu_count``),
    then a thread per physical core where hyperthreads make that fewer."""
    if ask.threads is not None:
        return [ask.threads]
    logical, physical = cpu_count(), physical_cores()
    return [logical, physical] if physical < logical else [logical]


def _label(cand: Candidate, threads: int | None = None) -> str:
    name, batch, precision, channels_last = cand
    return (f"{name} batch {batch} {precision} {'channels_last' if channels_last else 'contiguous'}"
            + (f", 1 process x {threads} thread(s)" if threads is not None else ""))


def _cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo says it (the processor's name elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def handed_over() -> Choice | None:
    """The choice the launcher made for this worker (:data:`AUTO_CHOICE_ENV`), or None."""
    text = os.environ.get(AUTO_CHOICE_ENV)
    return Choice.from_json(text) if text else None


def hand_over(choice: Choice | None) -> dict[str, str]:
    """The environment that hands ``choice`` to the workers the launcher starts."""
    return {AUTO_CHOICE_ENV: choice.to_json()} if choice is not None else {}


if __name__ == "__main__":  # this host's cached choices
    for found in sorted(cache_dir().glob("*.json")):
        data = json.loads(found.read_text())
        choice = Choice.from_json(json.dumps(data["choice"]))
        print(f"{found.name}: {describe(choice)}; {choice.basis}; {data['key']['cpu']}")
        for row in choice.summary().split("; "):
            print(f"  {row}")
