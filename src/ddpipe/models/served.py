"""The trained classifier as a client calls it: images in, class probabilities and names out.

One code path serves both the evaluate stage and the logged MLflow model (``mlflow models serve``), so
the served model predicts exactly what the evaluate stage measured: the same uint8 -> float
normalisation (the training's per-channel mean and std), the same network in fp32 on the CPU.

Accepted images (a NumPy array or a nested list, as JSON gives it):
- integer pixels 0-255 (any integer dtype), ``N x H x W`` or ``N x C x H x W`` (``N x H x W x C``
  too, when only the last axis matches the model's channels);
- floats in [0, 1] (a float dtype says so: there is no guessing from the values); they are rounded
  to the 0-255 grid, so ``uint8 / 255`` gives exactly the uint8 prediction.
Images of any size are brought to the size the network takes as the evaluate stage brought its test
images: for a model trained on encoded images, the centre square of the training's resolved
``data.eval_crop_ratio`` of the shorter side (recorded in the saved model) resized to its resolved
``data.eval_image_size`` (``ddpipe.data.transforms.EvalCrop``, the very function of validation
and the evaluate stage); for raw images, a resize (bilinear, antialiased) to their stored size. Grey
images are repeated to three channels for a colour model. Anything else raises ``ValueError`` saying what was
sent and what is accepted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import mlflow.models
import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from mlflow.pyfunc import PythonModelContext

from ddpipe.data.transforms import BatchTransform, EvalCrop
from ddpipe.models.carried import Carried, carry, importable, model_code
from ddpipe.models.catalog import code_paths, kind
from ddpipe.models.nets import predict_logits
from ddpipe.models.saved import SavedModel, load_model

logger = logging.getLogger(__name__)


class ImageInput:
    """A client's images as a model takes them (see the module doc): what the PyTorch classifier and the exported
    ONNX one (``ddpipe.models.onnx_served``) share, so both take the same requests."""

    predict_batch = 1000  # images per run of the model in predict()
    classes: list[str]

    def __init__(self, num_channels: int, image_size: tuple[int, int], encoding: str, eval_crop_ratio: float) -> None:
        self.num_channels, self.image_size, self.encoding = num_channels, tuple(image_size), encoding
        self.eval_crop = EvalCrop(self.image_size[0], eval_crop_ratio)  # encoded: validation's very crop

    def probabilities(self, batch: np.ndarray) -> np.ndarray:
        """``[N, classes]`` class probabilities of a uint8 ``N x C x H x W`` batch at the model's size."""
        raise NotImplementedError

    def predict(self, images: Any) -> dict[str, Any]:
        """``class_index`` and ``label`` (the most probable class), ``probabilities`` ``[N, classes]`` (float64), for
        a client's images (:meth:`to_batch`)."""
        batch, step = self.to_batch(images).numpy(), self.predict_batch
        probs = np.concatenate([self.probabilities(batch[i:i + step]) for i in range(0, len(batch), step)])
        index = probs.argmax(1)
        return {"class_index": index, "label": [self.classes[i] for i in index.tolist()],
                "probabilities": probs.astype(np.float64)}

    def to_batch(self, images: Any) -> torch.Tensor:
        """A client's images as the uint8 ``N x C x H x W`` batch the model takes (see the module doc)."""
        array = np.asarray(images)
        if array.dtype == object or array.size == 0:
            raise ValueError(f"images: got an array of dtype {array.dtype} and shape {array.shape}; expected a "
                             "non-empty rectangular array of pixels")
        array = self._to_uint8(array)
        return self._to_model_shape(torch.from_numpy(np.ascontiguousarray(self._to_nchw(array))))

    @staticmethod
    def _to_uint8(array: np.ndarray) -> np.ndarray:
        if array.dtype == np.bool_:
            raise ValueError("images: got booleans; expected integer pixels 0-255 or floats in [0, 1]")
        lo, hi = float(array.min()), float(array.max())
        if np.issubdtype(array.dtype, np.integer):
            if lo < 0 or hi > 255:
                raise ValueError(f"images: integer pixels must lie in 0-255, got values from {lo:g} to {hi:g}")
            return array.astype(np.uint8)
        if np.issubdtype(array.dtype, np.floating):
            if not (np.isfinite(lo) and np.isfinite(hi)) or lo < 0 or hi > 1:
                raise ValueError(f"images: float pixels must lie in [0, 1], got values from {lo:g} to {hi:g}; "
                                 "send 0-255 pixels as integers")
            return np.rint(array.astype(np.float64) * 255.0).astype(np.uint8)
        raise ValueError(f"images: dtype {array.dtype} is not accepted; expected integers 0-255 or floats in [0, 1]")

    def _to_nchw(self, array: np.ndarray) -> np.ndarray:
        c = self.num_channels
        if array.ndim == 3:
            return array[:, None]
        if array.ndim == 4:
            if array.shape[1] not in (1, c) and array.shape[3] in (1, c):
                return array.transpose(0, 3, 1, 2)
            if array.shape[1] in (1, c):
                return array
        raise ValueError(f"images: shape {list(array.shape)} is not accepted; expected N x H x W or N x C x H x W "
                         f"(N x H x W x C too) with C = {c}" + (" or 1" if c != 1 else ""))

    def _to_model_shape(self, batch: torch.Tensor) -> torch.Tensor:
        if batch.shape[1] != self.num_channels:  # a grey image for a colour model
            batch = batch.expand(-1, self.num_channels, -1, -1)
        if self.encoding == "encoded":  # every image, whatever its size: the evaluation crop
            return torch.stack([self.eval_crop(image) for image in batch])
        if tuple(batch.shape[2:]) != self.image_size:
            resized = F.interpolate(batch.float(), size=self.image_size, mode="bilinear", antialias=True,
                                    align_corners=False)
            batch = resized.round_().clamp_(0, 255).to(torch.uint8)
        return batch


class ImageClassifier(ImageInput):
    """A saved model (``paths.model``) with its normalisation and class names, ready to predict."""

    def __init__(self, model: torch.nn.Module, saved: SavedModel, device: torch.device | None = None) -> None:
        super().__init__(saved.num_channels, tuple(saved.image_size), saved.encoding, saved.eval_crop_ratio)
        self.device = device or torch.device("cpu")
        self.model = model.to(self.device).eval()
        self.saved = saved
        self.classes: list[str] = saved.classes
        self.exported_epoch = saved.exported_epoch
        self.flips = saved.model.eval_flips
        # crop padding 0, no flips: evaluation's transform, never the training augmentation
        self.normalise = BatchTransform(saved.mean, saved.std, 0, False, 0, self.device, False)

    @classmethod
    def load(cls, path: str | Path, device: torch.device | None = None) -> ImageClassifier:
        model, saved = load_model(path)
        return cls(model, saved, device)

    @torch.no_grad()
    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, classes]`` (on the CPU) for a uint8 ``N x C x H x W`` batch at the model's size."""
        # Plain NCHW strides whatever the caller's view: a 1-channel view with an odd channel stride
        # passes for channels_last, and the convolutions then take other kernels (other last bits).
        images = images.to(self.device).clone(memory_format=torch.contiguous_format)
        x = self.normalise(images, torch.empty(0), None)
        return predict_logits(self.model, x, self.flips).cpu()

    def probabilities(self, batch: np.ndarray) -> np.ndarray:
        """The softmax of :meth:`logits`, in float64 (the evaluate stage's, and the export check's reference)."""
        return torch.softmax(self.logits(torch.from_numpy(batch)).double(), 1).numpy()


class MlflowImageClassifier(mlflow.pyfunc.PythonModel):
    """The MLflow pyfunc face of :class:`ImageClassifier`: a DataFrame with one row per image
    (``label``, ``class_index``, ``probability`` of that class, ``probabilities`` in class order)."""

    def load_context(self, context: PythonModelContext) -> None:
        self.classifier = ImageClassifier.load(context.artifacts["weights"])

    # np.ndarray: a hint from which MLflow infers no schema (mlflow.types.type_hints), so it neither converts
    # nor validates the input (images of any shape and dtype are ours to check) and does not warn that predict
    # has no hints. A DataFrame (one image per row) is accepted too.
    def predict(self, context: PythonModelContext, model_input: np.ndarray, params: dict | None = None
                ) -> pd.DataFrame:
        return prediction_frame(self.classifier, model_input)


def prediction_schema() -> Any:
    """The served model's output columns, as the logged model's signature states them (written out: MLflow's
    inference from an example warns that an integer column cannot hold missing values, which ours never do)."""
    from mlflow.types import DataType
    from mlflow.types.schema import Array, ColSpec, Schema

    return Schema([ColSpec(DataType.string, "label"), ColSpec(DataType.long, "class_index"),
                   ColSpec(DataType.double, "probability"), ColSpec(Array(DataType.double), "probabilities")])


def prediction_frame(classifier: ImageClassifier, images: Any) -> pd.DataFrame:
    """The served model's answer for ``images``, as a DataFrame."""
    if isinstance(images, pd.DataFrame):  # a client that sent a table: one image per row
        images = np.stack([np.asarray(v) for v in images.iloc[:, 0]])
    out = classifier.predict(images)
    probs = out["probabilities"]
    return pd.DataFrame({
        "label": out["label"], "class_index": out["class_index"].astype(np.int64),
        "probability": probs[np.arange(len(probs)), out["class_index"]],
        "probabilities": [row.tolist() for row in probs],
    })


# The logged model is code, not a pickle (MLflow's models-from-code): MLflow copies this file into the model and
# runs it when the model loads, with the model's code_paths (the ddpipe it carries, a user's own network) on sys.path;
# nothing is unpickled. Written when logging (ddpipe.models.carried.model_code): it imports the model's class from the
# copy of ddpipe the model carries, under that copy's own name, so the model runs the code it was logged with whatever
# ddpipe is installed, and shadows none.
MODEL_CODE_FILE = "ddpipe_classifier.py"


# What the served model's code imports besides ddpipe (which it carries: ddpipe.models.carried): pinned to the
# versions that logged it, so MLflow's own environment managers (`mlflow models serve`'s default, `--env-manager uv`)
# build the same
SERVED_REQUIREMENTS = ("torch", "torchvision", "numpy", "pandas")


def pinned(*names: str) -> list[str]:
    """``name==version`` of each installed distribution (those not installed are left out)."""
    pins = []
    for name in names:
        try:
            pins.append(f"{name}=={version(name).split('+')[0]}")
        except PackageNotFoundError:
            continue
    return pins


@contextlib.contextmanager
def requirements_of_its_own() -> Iterator[None]:
    """While a model is logged: MLflow's detection of a uv project off. Left on, MLflow copies this repository's
    uv.lock and pyproject.toml into the model, and `mlflow models serve --env-manager uv` then runs `uv sync` on them,
    which builds ddpipe itself and fails; the model's own pinned requirements (:func:`pinned`) are what it needs."""
    saved = os.environ.get("MLFLOW_UV_AUTO_DETECT")
    os.environ["MLFLOW_UV_AUTO_DETECT"] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MLFLOW_UV_AUTO_DETECT", None)
        else:
            os.environ["MLFLOW_UV_AUTO_DETECT"] = saved


@contextlib.contextmanager
def model_of_run(mlflow: Any, run_id: str, name: str) -> Iterator[str]:
    """A new logged model ``name`` whose source is run ``run_id`` (with the run's params): its id, for a flavor's
    ``log_model(model_id=...)`` to fill and mark READY; then recorded as the run's output. No run is made active for
    it: handed one, MLflow's model logging reads the whole history of every metric of the run, a request per metric,
    to link the values at its step to the model, which for a run with step and system metrics took most of a
    minute against a shared server (the server sweep's export stage: 80 of its 100 s). The figures that describe the
    model (its validation and test figures, not each epoch's) are linked to it by their own records instead, one
    request each (``ddpipe.tracking.delivery``, :func:`logged_model`)."""
    from mlflow.entities import LoggedModelOutput

    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    model = mlflow.initialize_logged_model(name=name, source_run_id=run_id, params=dict(run.data.params),
                                           experiment_id=run.info.experiment_id)
    yield model.model_id
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])


def log_pyfunc(mlflow: Any, run_id: str, model_path: Path, input_example: Any, model_name: str,
              registered_model_name: str | None, git_commit: str) -> None:
    """``model_path`` (``paths.model``, a network ``model_name``) into run ``run_id`` as the pyfunc model ``model``,
    a :class:`MlflowImageClassifier` that a client calls with plain images, logged as code (no pickle) that runs the
    copy of ddpipe it carries (``ddpipe.models.carried``); registered as a new version of ``registered_model_name``
    when set, tagged with ``git_commit``. Nothing is logged when the run already holds this model (see
    :func:`_has_model`)."""
    classifier = ImageClassifier.load(model_path)
    if _has_model(mlflow, run_id, classifier.exported_epoch):
        logger.info(f"MLflow run {run_id} already holds this model; not logging it again")
        return
    with tempfile.TemporaryDirectory() as tmp, model_of_run(mlflow, run_id, "model") as model_id, \
            requirements_of_its_own():
        carried = carry(Path(tmp))
        code = Path(tmp) / MODEL_CODE_FILE
        code.write_text(model_code(carried, "models.served", "MlflowImageClassifier", "ddpipe's image classifier"))
        with importable(carried):
            info = _log_pyfunc(mlflow, code, model_path, input_example, model_name, registered_model_name,
                               classifier, model_id, carried)
    client = mlflow.MlflowClient()
    client.set_tag(run_id, "ddpipe.logged_model_epoch", str(classifier.exported_epoch))
    if registered_model_name and info.registered_model_version:
        for key, value in {"dvc_exp_name": os.environ.get("DVC_EXP_NAME", ""), "git_commit": git_commit,
                           "run_id": run_id}.items():
            client.set_model_version_tag(registered_model_name, str(info.registered_model_version), key, value)


def _log_pyfunc(mlflow: Any, code: Path, model_path: Path, input_example: Any, model_name: str,
                registered_model_name: str | None, classifier: ImageClassifier, model_id: str,
                carried: Carried) -> Any:
    """``mlflow.pyfunc.log_model`` of the model defined by the file ``code`` (its ``model_code``) into the logged
    model ``model_id`` (:func:`model_of_run`), carrying ``carried`` (ddpipe's source) and a user's network module; its
    ModelInfo."""
    return mlflow.pyfunc.log_model(
        name="model", model_id=model_id, python_model=str(code), artifacts={"weights": str(model_path)},
        # no input schema: N x H x W and N x C x H x W, integers or [0, 1] floats are all accepted
        signature=mlflow.models.ModelSignature(outputs=prediction_schema()), input_example=input_example,
        code_paths=[str(carried.path), *code_paths(model_name)],
        pip_requirements=pinned(*SERVED_REQUIREMENTS, *(["timm"] if kind(model_name) == "timm" else [])),
        metadata={"classes": classifier.classes, "image_size": list(classifier.image_size),
                  "num_channels": classifier.num_channels, "exported_epoch": classifier.exported_epoch,
                  "input": "uint8 pixels (N x H x W or N x C x H x W) or floats in [0, 1]",
                  "output": "label, class_index, probability, probabilities (class order)", **carried.metadata()},
        registered_model_name=registered_model_name,
    )


def _has_model(mlflow: Any, run_id: str, exported_epoch: Any) -> bool:
    """Whether run ``run_id`` already holds a completely logged ``model`` of the same exported epoch (a re-run of
    a finished training, e.g. ``dvc repro`` after a code-only change, rewrites its outputs from the last
    checkpoint and must not log a second copy; one with train.model_epoch changed must)."""
    return logged_model(mlflow.MlflowClient(), run_id, exported_epoch) is not None


def logged_model(client: Any, run_id: str, exported_epoch: Any) -> Any | None:
    """The completely logged (READY) ``model`` of run ``run_id`` whose weights are those of ``exported_epoch``, as
    MLflow's ``LoggedModel``; None when the run holds none. The run's tag ``ddpipe.logged_model_epoch`` names the
    exported epoch of its newest logged model (:func:`log_pyfunc` sets it once the model is logged), so the newest
    READY one is that epoch's."""
    run = client.get_run(run_id)
    if run.data.tags.get("ddpipe.logged_model_epoch") != str(exported_epoch):
        return None
    found = [m for m in client.search_logged_models([run.info.experiment_id],
                                                    filter_string=f"source_run_id = '{run_id}' AND name = 'model'")
             if str(m.status).upper().endswith("READY")]
    return max(found, key=lambda m: m.creation_timestamp, default=None)

