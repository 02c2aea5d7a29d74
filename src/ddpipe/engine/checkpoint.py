"""Checkpoints: written atomically by global rank 0, loaded safely, shared with every rank, resumed exactly.

A checkpoint is named after the position to resume from, ``ckpt-<fingerprint>-e<epoch>-s<step>.pt``
(step = optimizer steps already done in that epoch). The fingerprint hashes everything that
shapes the training trajectory (config, world size, data), so a run only resumes from its own
checkpoints; another experiment's files stay untouched and can be resumed when it comes back.
Loading uses ``torch.load(weights_only=True)`` only: a file carrying a pickle payload is refused
and its code never runs. A checkpoint records its format (``format_version``, :data:`CHECKPOINT_FORMAT`),
read before anything else in it; :func:`upgraded` brings older formats to today's, in one place.

``paths.checkpoints`` is a directory of this host or a prefix in an object store (``s3://BUCKET/PREFIX``, the store
found as ddpipe.core.objectstore finds it): either way a checkpoint is written whole or not at all, a reader sees the
newest whole one, and a store that fails is retried; a multi-node job needs no shared disk for them. A store that is
away is a pause, not the training's end: see :class:`Checkpointer`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ddpipe.core.errors import one_line
from ddpipe.core.exits import StoreAway
from ddpipe.core.objectstore import DiskFolder, Folder, StoreError, StoreFolder, check, folder, is_store_url
from ddpipe.core.ranks import DistInfo
from ddpipe.core.store_lease import lease_on
from ddpipe.data.transforms import IMAGENET_CROP_RATIO
from ddpipe.distributed.group import broadcast_object
from ddpipe.engine.meters import EpochProgress
from ddpipe.engine.selection import RAW
from ddpipe.engine.store_pause import StorePause
from ddpipe.tracking.run_store import repo_root

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(?P<fp>[0-9a-f]{12})-e(?P<epoch>\d{4,})-s(?P<step>\d{6,})\.pt$")
# The format of what a checkpoint holds, written into it as ``format_version``. 0: written before format versions
# existed (no key; see upgraded); 1: the trainer's state as ddpipe.engine.loop assembles it today.
CHECKPOINT_FORMAT = 1


class CheckpointError(RuntimeError):
    """No usable checkpoint although some exist, or a checkpoint cannot be written."""


@dataclass(frozen=True)
class Position:
    """Where training resumes: ``epoch`` (0-based) and optimizer steps already done in it."""

    epoch: int
    step: int


def fingerprint(trajectory: dict[str, Any]) -> str:
    """12 hex digits identifying a training trajectory (config + world size + data)."""
    blob = json.dumps(trajectory, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


# Trajectory keys added after runs were checkpointed, with the value that reproduces what those runs did: at that
# value a key stays out of the fingerprint, so a run checkpointed before the key existed still resumes. The format
# version inside a checkpoint cannot replace this table: a run finds its checkpoints by the fingerprint in their
# file names before it opens one, so the fingerprint itself must come out as it did when they were written.
ADDED_LATER: dict[str, Any] = {
    "model.weights": None, "train.body_lr_ratio": 1.0, "train.freeze_body_epochs": "0",
    # the recipe's keys (ddpipe.engine.objective's loss, ddpipe.engine.ema, ddpipe.data.augment, ddpipe.data.sampling)
    "data.eval_image_size": None, "data.eval_crop_ratio": IMAGENET_CROP_RATIO, "train.class_weights": "none",
    "train.sampler": "uniform", "train.ema_decay": None, "train.wd_norm_bias": True, "train.auto_augment": "none",
    "train.randaugment_ops": 2, "train.randaugment_magnitude": 9, "train.random_erasing": 0.0,
    "train.mixup_alpha": 0.0, "train.cutmix_alpha": 0.0, "train.mix_prob": 1.0, "train.mix_switch_prob": 0.5,
    "train.deterministic": False,  # CUDA's kernels (ddpipe.core.devices.cuda_kernels)
}


def run_fingerprint(trajectory: dict[str, Any], global_batch_size: int, effective_lr: float,
                    data: dict[str, Any]) -> str:
    """The fingerprint of a training run: every config key that shapes its trajectory, with the global batch
    and the effective lr in place of the per-rank batch and the world size (so that a run stopped at one
    world size resumes at another with the same global batch and lr), and the prepared data's meta.json."""
    keys = {k: v for k, v in trajectory.items()
            if k != "train.batch_size_per_rank" and (k not in ADDED_LATER or v != ADDED_LATER[k])}
    return fingerprint({**keys, "global_batch_size": global_batch_size, "effective_lr": effective_lr, "data": data})


def checkpoint_name(fp: str, pos: Position) -> str:
    return f"ckpt-{fp}-e{pos.epoch:04d}-s{pos.step:06d}.pt"


def checkpoint_words(pos: Position) -> str:
    """A checkpoint in words: "the checkpoint after epoch 2", "the checkpoint at step 8 of epoch 3" (epochs from 1)."""
    return f"the checkpoint at step {pos.step} of epoch {pos.epoch + 1}" if pos.step else \
        f"the checkpoint after epoch {pos.epoch}"


def checkpoint_path(directory: Path, fp: str, pos: Position) -> Path:
    return Path(directory) / checkpoint_name(fp, pos)


Where = str | Path | DiskFolder | StoreFolder


def checkpoint_folder(where: Where) -> Folder:
    """The folder of ``paths.checkpoints``: a directory, or a store's prefix whose store is the environment's or the
    DVC remote's on the same bucket (this repository's, the user's under DVC's copy of it)."""
    if isinstance(where, (DiskFolder, StoreFolder)):
        return where
    return folder(where, roots=(Path.cwd(), repo_root()))


def check_checkpoint_place(where: str) -> None:
    """Before any work starts: a store's ``paths.checkpoints`` answers, takes its keys and holds its bucket, else a
    StoreError naming the setting, the URL and the endpoint (one request, no retries). A directory: nothing to ask."""
    place = checkpoint_folder(where)
    if isinstance(place, StoreFolder):
        check(place.store, place.where, "paths.checkpoints")


def _checkpoints(place: Folder, fp: str | None) -> list[tuple[Position, str]]:
    found = []
    for name in place.names():
        m = _NAME.match(name)
        if m and (fp is None or m["fp"] == fp):
            found.append((Position(int(m["epoch"]), int(m["step"])), name))
    return sorted(found, key=lambda t: (t[0].epoch, t[0].step))


def list_checkpoints(directory: Path, fp: str | None = None) -> list[tuple[Position, Path]]:
    """Checkpoints in the directory ``directory`` (of fingerprint ``fp`` if given), oldest first."""
    return [(pos, Path(directory) / name) for pos, name in _checkpoints(DiskFolder(directory), fp)]


def save_checkpoint(where: Where, fp: str, pos: Position, state: dict[str, Any], keep: int) -> str | Path:
    """Write ``state`` whole or not at all (a directory's: temp file, fsync, os.replace; a store's: one object, shown
    only once complete), then keep the ``keep`` newest of this fingerprint; its path or URL. In a store whose lease
    this process holds (ddpipe.core.store_lease), the lease is renewed first, and a lease another training took
    over stops it here, with nothing written (LeaseLost). Call on global rank 0 only; the caller then meets the other
    ranks at a barrier."""
    place = checkpoint_folder(where)
    if (lease := lease_on(place.where)) is not None:  # a store's place: still this training's, renewed, or LeaseLost
        lease.check()
    payload = {**state, "position": torch.tensor([pos.epoch, pos.step]), "fingerprint": fp,
               "format_version": CHECKPOINT_FORMAT}
    written = place.write(checkpoint_name(fp, pos), lambda f: torch.save(payload, f))
    for _, old in _checkpoints(place, fp)[:-keep]:
        place.remove(old)
    return written


def load_latest(where: Where, fp: str) -> tuple[Position, dict[str, Any]] | None:
    """The newest checkpoint of this fingerprint that loads, falling back past corrupt ones.

    None if this run has no checkpoint (a fresh start). CheckpointError if it has some but none
    loads: a silent fresh start would throw away the user's progress. A store that does not answer is a StoreError
    (after its retries), never taken for a corrupt checkpoint.
    """
    place = checkpoint_folder(where)
    candidates = _checkpoints(place, fp)
    failures = []
    for pos, name in reversed(candidates):
        path = f"{place.where}/{name}"
        try:
            state = torch.load(io.BytesIO(place.read(name)), map_location="cpu", weights_only=True)
        except StoreError:
            raise
        except Exception as exc:  # truncated zip, bad pickle, refused global: all unusable
            failures.append(f"{name}: {one_line(exc, 200)}")
            logger.warning(f"warning: checkpoint {path} cannot be loaded ({failures[-1]}); trying an older one")
            continue
        # its format first: a newer ddpipe's checkpoint stops the resume, never skipped for an older one
        version = check_format(state, path) if isinstance(state, dict) else None
        if version is None or state.get("fingerprint") != fp:
            failures.append(f"{name}: not a ddpipe checkpoint of this run")
            continue
        return pos, upgraded(state, version)
    if failures:
        raise CheckpointError(
            f"{place.where}: none of this run's {len(candidates)} checkpoint(s) can be loaded "
            f"({'; '.join(failures)}). Move them away to start fresh, or restore a good copy."
        )
    return None


def check_format(state: dict[str, Any], path: str | Path) -> int:
    """The format ``state`` (loaded from ``path``) was written in; ValueError if it is newer than this code reads."""
    version = int(state.get("format_version", 0))
    if version > CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: checkpoint format {version} is newer than this ddpipe reads (formats up to "
                         f"{CHECKPOINT_FORMAT}): resume it with the ddpipe that wrote it, or move it away to start "
                         "fresh")
    return version


def upgraded(state: dict[str, Any], version: int) -> dict[str, Any]:
    """``state``, a checkpoint of format ``version`` (:func:`check_format`), in today's format
    (:data:`CHECKPOINT_FORMAT`): what older formats lacked, filled in."""
    state = dict(state)
    if version < 1:
        # Format 0: written before format versions existed. Those checkpoints gained their entries one at a time and
        # never said which step wrote them, so here, and only here, an entry's absence tells the step.
        if "selection" in state:  # before weight averaging (ddpipe.engine.ema) the raw weights were the only ones
            state["selection"] = {"best_source": RAW, "last_source": RAW, **state["selection"]}
        if "history" in state:  # and an epoch had no average's validation
            state["history"] = [{"ema_val_loss": None, "ema_val_accuracy": None, **h} for h in state["history"]]
        progress = state.get("epoch_progress")  # the interrupted epoch's sums: none before mid-epoch checkpoints,
        if not isinstance(progress, dict):  # then float64 [loss_sum, correct, count, seconds] before they were named
            done = EpochProgress() if progress is None else EpochProgress(*(float(v) for v in progress.tolist()))
            state["epoch_progress"] = done.as_state()
        state.setdefault("world_size", None)  # not recorded: the resume cannot say whether the world size moved
    return state


def other_runs(where: Where, fp: str) -> list[str]:
    """Checkpoints of other configurations (reported when a run starts fresh beside them), by name."""
    return [name for _, name in _checkpoints(checkpoint_folder(where), None) if f"-{fp}-" not in name]


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class Checkpointer:
    """One run's checkpoints in ``directory`` (a directory or a store's prefix): rank 0 reads and writes them; every
    rank gets what rank 0 read, and waits until what it writes is whole where it goes. In a store, rank 0 writes through
    a :class:`~ddpipe.engine.store_pause.StorePause`: a store away is a pause (its checkpoints skipped, the training
    going on, the last one waited for: :meth:`flush`), and one away for ``ddpipe.core.objectstore.STORE_OUTAGE_S``
    stops every rank with StoreAway at the checkpoint that finds it so (exit 75)."""

    def __init__(self, directory: str | Path, fp: str, keep: int, info: DistInfo) -> None:
        self.directory, self.fp, self.keep, self.info = str(directory), fp, keep, info
        self._folder: Folder | None = None
        self._pause: StorePause | None = None

    @property
    def folder(self) -> Folder:
        if self._folder is None:
            self._folder = checkpoint_folder(self.directory)
        return self._folder

    @property
    def pause(self) -> StorePause:
        """Rank 0's writes through the store's outages (see ddpipe.engine.store_pause)."""
        if self._pause is None:
            endpoint = self.folder.store.endpoint if isinstance(self.folder, StoreFolder) else None
            self._pause = StorePause(f"the store of paths.checkpoints ({self.directory}, endpoint {endpoint or 'AWS'})")
        return self._pause

    def save(self, pos: Position, parts: dict[str, Stateful], **values: Any) -> None:
        """The checkpoint of ``pos``: each part's ``state_dict()``, the RNG states, and ``values``. A collective."""
        stop = None
        if self.info.is_main:
            state = {name: part.state_dict() for name, part in parts.items()}
            stop = self.pause.write(checkpoint_name(self.fp, pos), checkpoint_words(pos),
                                    {**state, "rng": rng_state(), **values},
                                    lambda kept: save_checkpoint(self.folder, self.fp, pos, kept, self.keep))
        self._agree(stop)

    def flush(self) -> None:
        """Before the training's outputs: its last checkpoint, if its store was away then, written once the store is
        back (StorePause.wait), or StoreAway. A collective; nothing to wait for on a disk."""
        if is_store_url(self.directory):
            self._agree(self.pause.wait() if self.info.is_main else None)

    def _agree(self, stop: str | None) -> None:
        """Rank 0's verdict on every rank, once what it wrote is whole where it goes: go on, or StoreAway."""
        if stop := broadcast_object(stop, self.info):  # type: ignore[assignment]
            raise StoreAway(stop)

    def restore(self, parts: dict[str, Stateful]) -> tuple[Position, dict[str, Any]] | None:
        """Load the newest loadable checkpoint of this run into ``parts`` and the RNGs on every rank;
        its position and the whole state (for the ``values`` saved with it), or None for a fresh start."""
        found = None
        if self.info.is_main:
            found = load_latest(self.folder, self.fp)
            self.pause.newest = checkpoint_name(self.fp, found[0]) if found is not None else None
            if found is None:
                others = other_runs(self.folder, self.fp)
                why = f"{len(others)} checkpoint(s) there belong to other configurations" if others else \
                    "no checkpoint yet"
                logger.info(f"starting fresh ({self.directory}: {why})")
        found = broadcast_object(found, self.info)
        if found is None:
            return None
        pos, state = found  # type: ignore[misc]
        for name, part in parts.items():
            part.load_state_dict(state[name])
        set_rng_state(state["rng"])
        return pos, state


# ---------------------------------------------------------------------------------------------
# RNG states as tensors (so that weights_only loading accepts them)


def rng_state() -> dict[str, torch.Tensor | list[torch.Tensor]]:
    np_state = np.random.get_state()
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
        "numpy_meta": torch.tensor([np_state[2], np_state[3]], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_state[4]], dtype=torch.float64),
        "python": torch.tensor(list(py_state[1]), dtype=torch.int64),
        "python_version": torch.tensor([py_state[0]], dtype=torch.int64),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state((
        "MT19937", state["numpy_keys"].numpy().astype(np.uint32),
        int(state["numpy_meta"][0]), int(state["numpy_meta"][1]), float(state["numpy_gauss"][0]),
    ))
    random.setstate((int(state["python_version"][0]), tuple(int(v) for v in state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
