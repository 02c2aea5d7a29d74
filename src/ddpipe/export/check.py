"""Every exported format scored by ONNX Runtime on the whole prepared test split, image for image against the PyTorch
model it came from (the evaluate stage's code path, ``ddpipe.models.served.ImageClassifier``), and timed on the CPU.

Per format: test accuracy, the share of test images whose top-1 class equals PyTorch's (``agreement``), the largest
difference of any class probability, the file's size, and latency in milliseconds at each of
``export.latency_batch_sizes`` (images from the test split): the first call apart (``first``), then after untimed
warm-up runs the timed ones in :data:`LATENCY_ROUNDS` rounds, ``p50`` the best round's median (a burst of other work
during one round does not move it) and ``p99`` over them all. :class:`HostLoad` says what else the host ran meanwhile:
latencies taken beside other work are marked so in the metrics, not passed off as the model's."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ddpipe.models.onnx_served import OnnxClassifier
from ddpipe.models.served import ImageClassifier

WARMUP_RUNS = 3  # untimed runs before the timed ones, the first of them reported apart (``first``)
LATENCY_ROUNDS = 3  # the timed runs cut into this many rounds: p50 is the lowest of their medians
BUSY_CORES = 0.25  # other processes' mean busy cores while timing, from which the latencies are marked busy


@dataclass
class Score:
    """One format's predictions over the test split, summed as the batches come."""

    correct: int = 0
    agree: int = 0
    count: int = 0
    max_prob_diff: float = 0.0
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, probs: np.ndarray, reference: np.ndarray, labels: np.ndarray) -> None:
        self.correct += int((probs.argmax(1) == labels).sum())
        self.agree += int((probs.argmax(1) == reference.argmax(1)).sum())
        self.count += len(labels)
        self.max_prob_diff = max(self.max_prob_diff, float(np.abs(probs - reference).max(initial=0.0)))

    def metrics(self, path: Path | None) -> dict:
        out = {"accuracy": self.correct / max(1, self.count), "agreement": self.agree / max(1, self.count),
               "max_prob_diff": self.max_prob_diff}
        if path is not None:
            out["size_mb"] = round(path.stat().st_size / 1e6, 3)
        return {**out, **({"latency_ms": self.latency_ms} if self.latency_ms else {})}


def score(batches: Callable[[], object], classifier: ImageClassifier, graphs: dict[str, Path],
          threads: int) -> dict[str, Score]:
    """``pytorch`` and each of ``graphs`` (format -> file) over the batches ``batches()`` yields (uint8 images,
    labels, ...); the PyTorch model is every format's reference."""
    # a throughput run, not a latency one: threads that sleep between batches leave the cores to whoever shares them
    sessions = {name: OnnxClassifier(path, threads, spin=False) for name, path in graphs.items()}
    scores = {name: Score() for name in ("pytorch", *graphs)}
    for images, labels, *_ in batches():
        batch, y = images.numpy(), labels.numpy()
        ref = classifier.probabilities(batch)
        scores["pytorch"].add(ref, ref, y)
        for name, session in sessions.items():
            scores[name].add(session.probabilities(batch).astype(np.float64), ref, y)
    return scores


def latency(run: Callable[[np.ndarray], object], images: np.ndarray, sizes: list[int], runs: int
            ) -> dict[str, dict[str, float]]:
    """Milliseconds of ``run`` on a batch of each size in ``sizes`` (cut from ``images``, repeated when the split is
    smaller): ``first`` (the first call: allocations, kernel choice), then, after the rest of :data:`WARMUP_RUNS`,
    ``runs`` timed in :data:`LATENCY_ROUNDS` rounds: ``p50`` the lowest round median, ``p99`` over all runs."""
    out = {}
    for size in sizes:
        batch = np.ascontiguousarray(np.resize(images, (size, *images.shape[1:])))
        first = _milliseconds(run, batch)
        for _ in range(WARMUP_RUNS - 1):
            run(batch)
        times = [_milliseconds(run, batch) for _ in range(runs)]
        rounds = np.array_split(np.asarray(times), min(LATENCY_ROUNDS, runs))  # none empty: at most runs
        out[f"batch_{size}"] = {"p50": round(float(min(np.median(r) for r in rounds)), 3),
                                "p99": round(float(np.percentile(times, 99)), 3), "first": round(first, 3)}
    return out


def _milliseconds(run: Callable[[np.ndarray], object], batch: np.ndarray) -> float:
    start = time.perf_counter()
    run(batch)
    return (time.perf_counter() - start) * 1000


class HostLoad:
    """What the rest of the host ran while a block of timing ran: ``with HostLoad() as load: ...``, then
    ``load.figures()``: the 1-minute load average at the end and the cores other processes kept busy on average
    (the host's busy CPU time from ``/proc/stat`` less this process's own, over the wall time), with ``busy`` when
    that reaches :data:`BUSY_CORES`. Where ``/proc/stat`` is missing, the load average only."""

    def __enter__(self) -> HostLoad:
        self.start = (time.perf_counter(), time.process_time(), _host_busy_seconds())
        return self

    def __exit__(self, *exc: object) -> None:
        self.end = (time.perf_counter(), time.process_time(), _host_busy_seconds())

    def figures(self) -> dict:
        out = {"load_average": round(os.getloadavg()[0], 2)} if hasattr(os, "getloadavg") else {}
        (wall0, own0, host0), (wall1, own1, host1) = self.start, self.end
        if host0 is None or host1 is None or wall1 <= wall0:
            return out
        others = max(0.0, ((host1 - host0) - (own1 - own0)) / (wall1 - wall0))
        return {**out, "others_busy_cores": round(others, 2), "busy": others >= BUSY_CORES}


def _host_busy_seconds() -> float | None:
    """The CPU seconds all cores spent busy since boot (``/proc/stat``: every state but idle and iowait), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(f) for f in fields[:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
