"""Every exported format scored by ONNX Runtime on the whole prepared test split, image for image against the PyTorch
model it came from (the evaluate stage's code path, ``ddpipe.models.served.ImageClassifier``), and timed on the CPU.

Per format: test accuracy, the share of test images whose top-1 class equals PyTorch's (``agreement``), the largest
difference of any class probability, the file's size, and latency p50/p99 in milliseconds at each of
``export.latency_batch_sizes`` (images from the test split, after untimed warm-up runs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ddpipe.models.onnx_served import OnnxClassifier
from ddpipe.models.served import ImageClassifier

WARMUP_RUNS = 3


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
    """p50 and p99 milliseconds of ``run`` on a batch of each size in ``sizes`` (cut from ``images``, repeated when
    the split is smaller), after :data:`WARMUP_RUNS` untimed runs."""
    out = {}
    for size in sizes:
        batch = np.ascontiguousarray(np.resize(images, (size, *images.shape[1:])))
        for _ in range(WARMUP_RUNS):
            run(batch)
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            run(batch)
            times.append((time.perf_counter() - start) * 1000)
        out[f"batch_{size}"] = {"p50": round(float(np.percentile(times, 50)), 3),
                                "p99": round(float(np.percentile(times, 99)), 3)}
    return out
