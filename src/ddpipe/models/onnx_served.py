"""The exported ONNX graph as a client calls it: ONNX Runtime behind the served model's very requests and answers.

The graph (``paths.onnx``, made by ``ddpipe.export``) takes a batch of raw uint8 images at the size the evaluate stage
feeds the network (``N x C x H x W``, the batch dynamic) and does the rest inside: the training's normalisation, the
network, the evaluation's left-right flips; its first output is the class probabilities. What it needs to be called
right is in its metadata (:func:`ddpipe.models.saved.onnx_metadata`), readable by any ONNX Runtime client. This
module adds what a bare ONNX flavor cannot: requests of any size and layout, brought to that input exactly as
``ddpipe.models.served`` brings them (:class:`~ddpipe.models.served.ImageInput`), so the served ONNX model takes the
same requests as the PyTorch one and answers in the same columns.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModelContext

from ddpipe.core.devices import cpu_int8_kind
from ddpipe.models.carried import Carried, carry, importable, model_code
from ddpipe.models.saved import INPUT_NAME, INT8_CPU_KEY, INT8_WEIGHTS, OUTPUT_NAME
from ddpipe.models.served import (
    SERVED_REQUIREMENTS,
    ImageInput,
    model_of_run,
    pinned,
    prediction_frame,
    prediction_schema,
    requirements_of_its_own,
)


def ort_session(path: str | Path, threads: int | None = None, spin: bool = True) -> Any:
    """An ONNX Runtime CPU session of ``path`` (``threads``: intra-op threads; None: ONNX Runtime's choice).
    ``spin=False``: idle threads sleep instead of spinning between runs, which costs a little latency and saves the
    cores that spinning burns when other processes share them (several exports on one host)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class OnnxClassifier(ImageInput):
    """An exported graph in ONNX Runtime, with the input handling of the PyTorch classifier."""

    predict_batch = 256

    def __init__(self, path: str | Path, threads: int | None = None, spin: bool = True) -> None:
        self.session = ort_session(path, threads, spin)
        meta = self.session.get_modelmeta().custom_metadata_map
        if "classes" not in meta:
            raise ValueError(f"{path}: no ddpipe metadata (classes, image_size): not an export of ddpipe's")
        self.classes: list[str] = json.loads(meta["classes"])
        super().__init__(int(meta["num_channels"]), tuple(json.loads(meta["image_size"])), meta["encoding"],
                         float(meta["eval_crop_ratio"]))
        self.exported_epoch = json.loads(meta.get("exported_epoch", "null"))
        made_for, here = meta.get(INT8_CPU_KEY), cpu_int8_kind()
        if made_for in INT8_WEIGHTS and made_for != here:
            drifts = INT8_WEIGHTS[made_for] == "int8" and INT8_WEIGHTS[here] == "uint8"  # saturating kernels here
            warnings.warn(f"{path}: this INT8 graph was made for {made_for} CPUs and runs on a {here} CPU: " + (
                "its answers may differ from those its export checked" if drifts else
                "the same answers, slower than a copy made for this CPU") + " (export.int8_cpu makes one for it)",
                stacklevel=2)

    def probabilities(self, batch: np.ndarray) -> np.ndarray:
        """``[N, classes]`` probabilities of a uint8 ``N x C x H x W`` batch at the graph's size."""
        return self.session.run([OUTPUT_NAME], {INPUT_NAME: np.ascontiguousarray(batch, dtype=np.uint8)})[0]


class MlflowOnnxClassifier(mlflow.pyfunc.PythonModel):
    """The MLflow pyfunc face of :class:`OnnxClassifier`: the same input and output as
    ``ddpipe.models.served.MlflowImageClassifier``."""

    def load_context(self, context: PythonModelContext) -> None:
        self.classifier = OnnxClassifier(context.artifacts["graph"])

    def predict(self, context: PythonModelContext, model_input: np.ndarray, params: dict | None = None
                ) -> pd.DataFrame:
        return prediction_frame(self.classifier, model_input)


MODEL_CODE_FILE = "ddpipe_onnx_classifier.py"


def log_onnx_pyfunc(mlflow: Any, run_id: str, name: str, graph: Path, input_example: Any = None) -> Any:
    """The graph ``graph`` into run ``run_id`` as the pyfunc model ``name`` (:class:`MlflowOnnxClassifier`, logged as
    code, no pickle); its ModelInfo. ``input_example``: a request (default: one black image at the graph's size)."""
    classifier = OnnxClassifier(graph)
    if input_example is None:
        input_example = np.zeros((1, classifier.num_channels, *classifier.image_size), dtype=np.uint8)
    with tempfile.TemporaryDirectory() as tmp, model_of_run(mlflow, run_id, name) as model_id, \
            requirements_of_its_own():
        carried = carry(Path(tmp))  # the ddpipe it runs, under a name of its own: ddpipe.models.carried
        code = Path(tmp) / MODEL_CODE_FILE
        code.write_text(model_code(carried, "models.onnx_served", "MlflowOnnxClassifier", "ddpipe's ONNX classifier"))
        with importable(carried):
            return _log_model(mlflow, name, model_id, code, graph, classifier, input_example, carried)


def _log_model(mlflow: Any, name: str, model_id: str, code: Path, graph: Path, classifier: OnnxClassifier,
               input_example: Any, carried: Carried) -> Any:
    """``mlflow.pyfunc.log_model`` of the ONNX model defined by the file ``code`` into the logged model ``model_id``,
    carrying ``carried``; its ModelInfo."""
    return mlflow.pyfunc.log_model(
        name=name, model_id=model_id, python_model=str(code), artifacts={"graph": str(graph)},
        signature=mlflow.models.ModelSignature(outputs=prediction_schema()), input_example=input_example,
        code_paths=[str(carried.path)], pip_requirements=pinned("onnxruntime", *SERVED_REQUIREMENTS),
        metadata={"classes": classifier.classes, "image_size": list(classifier.image_size),
                  "num_channels": classifier.num_channels, "exported_epoch": classifier.exported_epoch,
                  "graph": os.path.basename(graph), "runtime": "onnxruntime", **carried.metadata()})
