"""``auto`` on a CPU by measuring, once per machine kind (``train.auto_by: measured``; ``table``: the fixed table of
:mod:`ddpipe.engine.resolved`).

The first training on a host whose run leaves the network, the batch, the precision or the memory format to ``auto``
times a few optimizer steps of each candidate this CPU can run, on synthetic batches of the run's
input shape, and keeps the fastest (images/s):

- the recipes known to reach the accuracy (:data:`RECIPES`: a network and its batch, BENCHMARKS.md "Which network
  `auto` picks"), or only the network the user named;
- each in fp32 and, where this process may run bf16 (``ddpipe.core.devices.cpu_supports_bf16``), bf16;
- each with channels_last and without, as one process with a thread on each of the cores it may use;
- the fastest of them again with a thread per physical core where the CPUs are hyperthreads
  (``ddpipe.core.devices.physical_cores``: a cloud VM's two vCPUs are often one core's two threads), whose threads
  wait for each other at every layer and may be slower than fewer. Unless ``distributed.threads_per_process`` says,
  the faster count (by more than :data:`THREADS_MARGIN`) becomes the training's threads per process. (A container's
  CPU quota already bounds the CPUs counted: ``ddpipe.core.devices.cpu_count``.)

The process layout is not among them: timed side by side without DDP, two processes of one thread looked 10% faster
than one of two threads, and trained 35% slower (DDP's all-reduce and SyncBatchNorm's sums, which such a measurement
leaves out); one process per node stays, unless ``distributed.nproc_per_node`` says.

An explicit value of any of these keys wins over the measured one, and narrows what is measured. The choice is cached
per machine kind, in a file under ``$XDG_CACHE_HOME/ddpipe/auto`` (``~/.cache`` by default) named by
:func:`machine_key`: the CPU's model and flags, the cores, torch's and ddpipe's versions, the instruction-set caps in
force and the input shape; later trainings read it. The launcher measures (or reads) it and hands it to its workers
(:data:`~ddpipe.core.environment.AUTO_CHOICE_ENV`); rank 0's choice is every rank's, on every node
(``ddpipe.engine.loop.train`` broadcasts it). The run records the key, where the choice came from and the table
(``auto_key``, ``auto_source``; ``python -m ddpipe.engine.autotune`` prints this host's).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ddpipe import __version__
from ddpipe.config.schema import ModelConfig
from ddpipe.core.devices import (
    ONEDNN_ISA_ENV,
    PrecisionPolicy,
    cpu_count,
    cpu_flags,
    cpu_supports_bf16,
    physical_cores,
)
from ddpipe.core.environment import AUTO_CHOICE_ENV
from ddpipe.core.files import atomic_write_json
from ddpipe.core.processes import host_lock

# The recipes that reach the accuracy, by input: (model.name, train.batch_size_per_rank) of a one-process run. Small
# images (raw Fashion-MNIST): resnet_compact at 128 reached 0.923 test accuracy in 10 epochs, resnet_small at 256 0.92
# (BENCHMARKS.md, "Which network `auto` picks"). Larger inputs: ResNet-18 at 64.
RECIPES = {"small": (("resnet_compact", 128), ("resnet_small", 256)), "large": (("resnet18", 64),)}
WARMUP_STEPS, TIMED_STEPS = 2, 4  # per candidate: a few seconds for the whole table on two cores
CACHE_FORMAT = 2  # the cache file's "format_version"; another one is measured again (1: no thread count)
# A thread count is kept over more threads only this much faster: within it, the cores' share with other trainings
# (ddpipe.distributed.host_leases) is worth more than a measurement's noise
THREADS_MARGIN = 1.05
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "avx_vnni", "fma")


@dataclass(frozen=True)
class Choice:
    """What ``auto`` became on this machine kind: a network, its per-process batch, precision, memory format and
    threads per process (0: a thread on each core of the process's share); ``key``: the machine kind's
    (:func:`machine_key`); ``source``: measured now (and how long it took) or read from the cache file; ``table``: each
    candidate's images/s."""

    model_name: str
    batch_size_per_rank: int
    precision: str
    channels_last: bool
    threads: int
    key: str
    source: str = ""
    table: tuple[tuple[str, float], ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Choice:
        raw = json.loads(text)
        return cls(**{**raw, "table": tuple(tuple(row) for row in raw.get("table", ()))})


@dataclass(frozen=True)
class Ask:
    """What is left to measure: the user's explicit values (None: ``auto``) and the input, for one training."""

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

    def candidates(self) -> list[tuple[str, int, str, bool]]:
        """(network, batch, precision, channels_last) of each candidate, the explicit values kept."""
        recipes = RECIPES["large" if self.large else "small"]
        if self.network is not None:
            recipes = tuple((n, b) for n, b in recipes if n == self.network) or ((self.network, recipes[0][1]),)
        precisions = [self.precision] if self.precision else ["fp32", *(["bf16"] if cpu_supports_bf16() else [])]
        layouts = [self.channels_last] if self.channels_last is not None else [True, False]
        return [(name, self.batch_size_per_rank or batch, p, cl) for name, batch in recipes for p in precisions
                for cl in layouts]


def machine_key(ask: Ask) -> tuple[str, dict[str, Any]]:
    """The machine kind's key (16 hex) and what it is made of: the CPU's model and the flags that choose kernels, the
    cores, the versions, the instruction-set caps in force, the input and what the user fixed."""
    flags = cpu_flags()
    parts = {"cpu": _cpu_model(), "flags": [f for f in FLAGS if f in flags], "cores": cpu_count(),
             "physical_cores": physical_cores(),  # "cores" already no more than a CPU quota (cpu_count)
             "torch": torch.__version__, "ddpipe": __version__, "machine": platform.machine(),
             "caps": {n: os.environ.get(n, "") for n in ("ATEN_CPU_CAPABILITY", *ONEDNN_ISA_ENV)},
             "ask": {**asdict(ask), "model": asdict(ask.model)}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16], parts


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddpipe" / "auto"


def choose(ask: Ask, say: Any = None) -> Choice:
    """This machine kind's choice for ``ask``: the cache's, or measured now (said, with its cost) and cached. One
    process of this host measures at a time (trainings started together: the others then read what it cached)."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    key, parts = machine_key(ask)
    path = cache_dir() / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".lock").touch()
    except OSError as exc:  # a home that cannot be written: measured, not cached (said)
        say(f"note: auto's measurement cannot be cached in {path.parent} ({type(exc).__name__}: {exc})")
        start = time.perf_counter()
        return replace(measure(ask, key), source=f"measured in {time.perf_counter() - start:.1f} s, not cached")
    with host_lock(path.with_suffix(".lock")):
        if (cached := _cached(path)) is not None:
            return cached
        start = time.perf_counter()
        choice = measure(ask, key)
        seconds = time.perf_counter() - start
        choice = replace(choice, source=f"measured in {seconds:.1f} s")
        atomic_write_json(path, {"format_version": CACHE_FORMAT, "key": parts,
                                 "choice": json.loads(choice.to_json())})
    say(f"auto: measured {len(choice.table)} candidate(s) on this CPU in {seconds:.1f} s: {describe(choice)}; cached "
        f"in {path}")
    return choice


def _cached(path: Path) -> Choice | None:
    """The choice a cache file holds, or None (none yet, unreadable or of another format: measured again)."""
    try:
        cached = json.loads(path.read_text())
        if cached.get("format_version") == CACHE_FORMAT:
            return replace(Choice.from_json(json.dumps(cached["choice"])), source=f"cache {path}")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def describe(choice: Choice) -> str:
    best = max(rate for _, rate in choice.table) if choice.table else 0.0
    threads = f"{choice.threads} thread(s)" if choice.threads else "a thread per core"
    return (f"{choice.model_name}, batch {choice.batch_size_per_rank}, {choice.precision}, "
            f"{'channels_last' if choice.channels_last else 'contiguous'}, {threads} ({best:,.0f} images/s)")


def measure(ask: Ask, key: str) -> Choice:
    """Time every candidate of ``ask`` as one process with a thread per CPU it may use, then the fastest with the
    fewer threads of :func:`thread_counts`; the fastest. The process layout is not
    measured (one process per node, as the table says, unless ``distributed.nproc_per_node`` is set): N processes
    timed side by side without DDP ran 6,581 images/s here against 5,953 for one, and trained at 3,455 (DDP's
    all-reduce and SyncBatchNorm's sums are what a layout costs; BENCHMARKS.md, "`auto` by measuring")."""
    every, *fewer = thread_counts(ask)
    candidates = ask.candidates()
    table = [(_label(cand, every), images_per_s(ask, *cand, threads=every)) for cand in candidates]
    best = max(range(len(table)), key=lambda i: table[i][1])
    name, batch, precision, channels_last = candidates[best]
    rate, threads = table[best][1], 0 if ask.threads is None else ask.threads
    for count in fewer:
        measured = images_per_s(ask, name, batch, precision, channels_last, threads=count)
        table.append((_label((name, batch, precision, channels_last), count), measured))
        if measured > rate * THREADS_MARGIN:
            rate, threads = measured, count
    return Choice(name, batch, precision, channels_last, threads, key, table=tuple(table))


def thread_counts(ask: Ask) -> list[int]:
    """The thread counts a measurement times: the user's (``distributed.threads_per_process``), or a thread per
    CPU this process may use (its affinity, no more than its cgroup's quota: ``ddpipe.core.devices.cpu_count``),
    then a thread per physical core where hyperthreads make that fewer."""
    if ask.threads is not None:
        return [ask.threads]
    logical, physical = cpu_count(), physical_cores()
    return [logical, physical] if physical < logical else [logical]


def _label(cand: tuple[str, int, str, bool], threads: int) -> str:
    name, batch, precision, channels_last = cand
    return (f"{name} batch {batch} {precision} {'channels_last' if channels_last else 'contiguous'}, 1 process x "
            f"{threads} thread(s)")


def images_per_s(ask: Ask, name: str, batch: int, precision: str, channels_last: bool, threads: int) -> float:
    """Optimizer steps (SGD with momentum, cross-entropy) of ``name`` on random batches of the input's shape with
    ``threads`` intra-op threads, timed after :data:`WARMUP_STEPS`: images per second."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _timed_images_per_s(ask, name, batch, precision, channels_last)
    finally:
        torch.set_num_threads(before)


def _timed_images_per_s(ask: Ask, name: str, batch: int, precision: str, channels_last: bool) -> float:
    from ddpipe.models.catalog import build_model

    torch.manual_seed(0)
    policy = PrecisionPolicy(torch.device("cpu"), precision, channels_last)
    model = policy.place(build_model(replace(ask.model, name=name), ask.channels, ask.classes)).train()
    x = torch.randn(batch, ask.channels, ask.side, ask.side)
    x = x.to(memory_format=torch.channels_last) if channels_last else x
    y = torch.randint(0, ask.classes, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step in range(WARMUP_STEPS + TIMED_STEPS):
        if step == WARMUP_STEPS:
            start = time.perf_counter()
        with policy.autocast():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return batch * TIMED_STEPS / (time.perf_counter() - start)


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
        print(f"{found.name}: {describe(Choice.from_json(json.dumps(data['choice'])))}; {data['key']['cpu']}")
        for label, rate in data["choice"]["table"]:
            print(f"  {rate:10,.0f} images/s  {label}")
