"""The model a client calls: images as clients have them in, probabilities and class names out, the
same predictions as the evaluate stage; served for real by `mlflow models serve`."""

from __future__ import annotations

import importlib.machinery
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.imageset import generate
from ddpipe.config.schema import ModelConfig
from ddpipe.data.store import open_split
from ddpipe.data.transforms import IMAGENET_CROP_RATIO, EvalCrop, decode
from ddpipe.models.catalog import build_model
from ddpipe.models.nets import predict_logits
from ddpipe.models.saved import MODEL_FORMAT, load_model, save_model
from ddpipe.models.served import ImageClassifier, prediction_frame
from tests.conftest import (
    OWN_NET,
    ROOT,
    VENV_BIN,
    args_for,
    free_port,
    predict_without_ddpipe,
    run,
    subprocess_env,
    wait_for_url,
)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> ImageClassifier:
    torch.manual_seed(0)
    cfg = ModelConfig(name="resnet_small", width=8)
    meta = {"num_channels": 1, "classes": [f"c{i}" for i in range(10)], "mean": [0.3], "std": [0.35],
            "image_size": [28, 28], "encoding": "raw"}
    path = tmp_path_factory.mktemp("model") / "model.pt"
    save_model(build_model(cfg, 1, 10).state_dict(), cfg, meta, path, extra={"exported_epoch": 3})
    return ImageClassifier.load(path)


def _images(n: int = 6) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(n, 28, 28), dtype=np.uint8)


def test_every_accepted_layout_gives_the_same_answer(classifier: ImageClassifier) -> None:
    u8 = _images()
    expected = classifier.predict(u8)
    assert expected["probabilities"].shape == (6, 10)
    assert np.allclose(expected["probabilities"].sum(1), 1.0)
    assert expected["label"] == [f"c{i}" for i in expected["class_index"]]
    same = [u8[:, None], u8[:, :, :, None], u8.astype(np.int64).tolist(), u8 / 255.0, (u8 / 255.0).astype(np.float32)]
    for images in same:
        got = classifier.predict(images)
        assert np.array_equal(got["class_index"], expected["class_index"])
        assert np.array_equal(got["probabilities"], expected["probabilities"])


def test_inputs_of_another_size_are_resized(classifier: ImageClassifier) -> None:
    big = np.kron(_images(2), np.ones((2, 2), dtype=np.uint8))  # 56 x 56, every pixel doubled
    assert classifier.to_batch(big).shape == (2, 1, 28, 28)
    assert len(classifier.predict(big)["label"]) == 2


@pytest.mark.parametrize("images, message", [
    (np.full((2, 28, 28), 300), "0-255"),
    (np.full((2, 28, 28), -1), "0-255"),
    (np.full((2, 28, 28), 12.0), "floats in|float pixels must lie in"),
    (np.zeros((2, 3, 28, 28), dtype=np.uint8), "shape"),
    (np.zeros((28, 28), dtype=np.uint8), "shape"),
    (np.zeros((2, 28, 28), dtype=bool), "booleans"),
])
def test_bad_inputs_say_what_is_accepted(classifier: ImageClassifier, images: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        classifier.predict(images)


def test_the_served_frame_names_each_class(classifier: ImageClassifier) -> None:
    frame = prediction_frame(classifier, _images(3))
    assert list(frame.columns) == ["label", "class_index", "probability", "probabilities"]
    row = frame.iloc[0]
    assert row["probability"] == max(row["probabilities"]) and row["label"] == f"c{row['class_index']}"
    assert classifier.exported_epoch == 3


def _post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_the_served_model_answers_plain_images_as_the_evaluate_stage_did(tmp_path: Path, prepared: Path) -> None:
    """Train, evaluate, register; then `mlflow models serve` the logged model and send it uint8 test
    images (N x H x W, as JSON integers) and the same images as floats in [0, 1]: its predictions are
    the evaluate stage's, image for image."""
    args = args_for(tmp_path, prepared, "num_epochs=1", "mlflow.log_model=true",
                    "mlflow.registered_model_name=tiny-classifier")
    run(["python", "stages/train_worker.py", *args], env={"DVC_EXP_NAME": "served"})
    run(["python", "stages/evaluate.py", *args])
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = json.loads((tmp_path / "run.json").read_text())["run_id"]

    from mlflow import MlflowClient

    (version,) = MlflowClient(uri).search_model_versions("name = 'tiny-classifier'")
    assert version.run_id == run_id and version.tags["dvc_exp_name"] == "served"
    assert len(version.tags["git_commit"]) == 40

    _serve_and_compare(tmp_path, prepared, uri, run_id, ROOT, check_floats=True)


def _serve_and_compare(tmp_path: Path, prepared: Path, uri: str, run_id: str, cwd: Path,
                       check_floats: bool = False) -> None:
    """`mlflow models serve` the run's model from ``cwd``; its answers to the test images are the evaluate
    stage's (confusion.csv), image for image."""
    test = open_split(prepared, "test")
    evaluated = [line.split(",")[1] for line in (tmp_path / "confusion.csv").read_text().splitlines()[1:]]
    port = free_port()
    server = subprocess.Popen(
        [str(VENV_BIN / "mlflow"), "models", "serve", "-m", f"runs:/{run_id}/model", "--env-manager", "local",
         "-h", "127.0.0.1", "-p", str(port)], cwd=cwd,
        env=subprocess_env({"MLFLOW_TRACKING_URI": uri}), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_url(f"{url}/ping", 120, server)
        images = np.asarray(test.images[:, 0])
        answer = _post(f"{url}/invocations", {"inputs": images.tolist()})["predictions"]
        assert [p["label"] for p in answer] == evaluated
        assert all(abs(sum(p["probabilities"]) - 1) < 1e-6 for p in answer)
        if not check_floats:
            return
        as_floats = _post(f"{url}/invocations", {"inputs": (images[:50] / 255.0).tolist()})["predictions"]
        assert [p["label"] for p in as_floats] == evaluated[:50]
        with pytest.raises(urllib.error.HTTPError) as bad:
            _post(f"{url}/invocations", {"inputs": (images[:2] * 1.0).tolist()})  # 0-255 as floats: refused
        assert bad.value.code == 400 and b"float pixels must lie in [0, 1]" in bad.value.read()
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


@pytest.mark.slow
def test_a_network_of_ones_own_trains_evaluates_and_is_served_from_another_directory(
        tmp_path: Path, prepared: Path) -> None:
    """model.name = mynets:TinyNet (a file at the repository root, with model.kwargs): trained by one process,
    evaluated, and served by `mlflow models serve` from a directory without mynets.py: the logged model
    carries it (code_paths), and answers as the evaluate stage measured."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "mynets.py").write_text(OWN_NET)
    shutil.copy(ROOT / "params.yaml", repo / "params.yaml")
    args = args_for(tmp_path, prepared, "num_epochs=1", "model.name=mynets:TinyNet", "model.kwargs.hidden=6",
                    "mlflow.log_model=true")
    trained = run(["python", str(ROOT / "stages" / "train_worker.py"), *args], cwd=repo)
    assert "network mynets:TinyNet at 28x28" in trained.stderr
    evaluated = run(["python", str(ROOT / "stages" / "evaluate.py"), *args], cwd=repo)
    assert float(evaluated.stderr.split("test accuracy ")[1].split(",")[0]) > 0.5
    for stage in (trained, evaluated):  # MLflow has nothing to warn about the logged model
        assert "Add type hints" not in stage.stderr and "Inferred schema contains integer" not in stage.stderr
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = json.loads((tmp_path / "run.json").read_text())["run_id"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _serve_and_compare(tmp_path, prepared, uri, run_id, elsewhere)


def test_the_model_is_logged_as_code_without_a_pickle_or_a_warning(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """log_pyfunc writes MLflow's models-from-code form: no python_model.pkl, no CloudPickle warning (MLflow logs
    it through its own logger, which does not propagate); the loaded model, from another directory, answers as
    the classifier does; the registered version keeps its tags."""
    import logging
    import warnings

    import mlflow

    from ddpipe.models.served import MODEL_CODE_FILE, log_pyfunc

    experiment = _small_model_and_store(tmp_path, 0, "code")
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("mlflow").addHandler(handler)
    try:
        run = mlflow.MlflowClient().create_run(experiment)  # not made active: the outbox's delivery never does
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            logging.getLogger("mlflow.pyfunc").warning("the capture hears mlflow.pyfunc")
            log_pyfunc(mlflow, run.info.run_id, tmp_path / "m.pt", _images(2), "resnet_small", "code-model", "abc123")
    finally:
        logging.getLogger("mlflow").removeHandler(handler)
    heard = said + [str(w.message) for w in warned]
    assert "the capture hears mlflow.pyfunc" in heard
    assert not [m for m in heard if "CloudPickle" in m or "pickle" in m.lower()], heard
    local = Path(mlflow.artifacts.download_artifacts(f"runs:/{run.info.run_id}/model", dst_path=str(tmp_path / "dl")))
    assert (local / MODEL_CODE_FILE).is_file() and not list(local.rglob("*.pkl"))
    assert "model_code_path" in (local / "MLmodel").read_text()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    served = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    expected = prediction_frame(ImageClassifier.load(tmp_path / "m.pt"), _images(5))
    answer = served.predict(_images(5))
    assert answer["label"].tolist() == expected["label"].tolist()
    assert np.array_equal(np.stack(answer["probabilities"]), np.stack(expected["probabilities"]))
    # loaded here, its code/ first on sys.path: ddpipe found there is still this checkout's (commit 8819018's cause)
    assert importlib.machinery.PathFinder.find_spec("ddpipe", sys.path).origin == str(ROOT / "src/ddpipe/__init__.py")
    package = mlflow.models.Model.load(str(local)).metadata["ddpipe_package"]
    assert type(served.unwrap_python_model()).__module__ == f"{package}.models.served"
    (version,) = mlflow.MlflowClient().search_model_versions("name = 'code-model'")
    assert version.tags["run_id"] == run.info.run_id == version.run_id and version.tags["git_commit"] == "abc123"
    # where ddpipe is not installed: the model carries it (its own copy answers), its requirements pinned
    labels, origin = predict_without_ddpipe(f"models:/code-model/{version.version}", f"sqlite:///{tmp_path}/mlflow.db",
                                            _images(5), tmp_path / "bare")
    assert labels == expected["label"].tolist() and origin.endswith(f"/code/{package}/models/served.py"), origin
    requirements = (local / "requirements.txt").read_text().split()
    assert {r.split("==")[0] for r in requirements} >= {"torch", "torchvision", "numpy", "pandas"}, requirements
    assert all("==" in r for r in requirements if not r.startswith("mlflow")), requirements
    # not this repository's lock, on which `--env-manager uv` would build ddpipe itself
    assert not (local / "uv.lock").exists() and not (local / "pyproject.toml").exists()


# Another ddpipe installed, first on the path: version 9.9.9, whose packages raise if anything imports them
OTHER_DDPIPE = {
    "ddpipe/__init__.py": '__version__ = "9.9.9"\n',
    **{f"ddpipe/{name}/__init__.py": f'raise ImportError("ddpipe 9.9.9\'s {name} was imported")\n'
       for name in ("core", "config", "data", "models")},
    "ddpipe-9.9.9.dist-info/METADATA": "Metadata-Version: 2.1\nName: ddpipe\nVersion: 9.9.9\n",
}
# Loads a logged model (argv[1]), answers images (argv[2]), then says which ddpipe `import ddpipe` gives, here and in a
# process it spawns (multiprocessing hands the child its sys.path, the model's code/ included)
BESIDE_ANOTHER = """
import json, multiprocessing, sys


def ddpipe_here():
    import ddpipe
    return ddpipe.__file__, ddpipe.__version__


if __name__ == "__main__":
    import importlib.metadata
    import mlflow.pyfunc, numpy as np

    model = mlflow.pyfunc.load_model(sys.argv[1])
    answer = model.predict(np.load(sys.argv[2]))
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        spawned = pool.apply(ddpipe_here)
    print(json.dumps({"probabilities": answer["probabilities"].tolist(),
                      "served_by": type(model.unwrap_python_model()).__module__,
                      "installed": importlib.metadata.version("ddpipe"), "here": ddpipe_here(), "spawned": spawned}))
"""


def test_a_logged_model_runs_its_own_code_beside_another_installed_ddpipe_and_shadows_it_nowhere(
        tmp_path: Path) -> None:
    """Another ddpipe installed first on the path (9.9.9, whose packages raise when imported): the logged model loads
    and answers from the copy of ddpipe it carries, exactly as the classifier that logged it; afterwards `import ddpipe`
    in that process and in a process it spawns still gives the installed 9.9.9 (why commit 8819018 reverted b54f132:
    MLflow prepends a model's code/ to sys.path). The model's metadata names its code: ddpipe's version and the digest
    of the carried source."""
    import mlflow

    import ddpipe
    from ddpipe.models.carried import code_digest
    from ddpipe.models.served import log_pyfunc

    experiment = _small_model_and_store(tmp_path, 1, "beside")
    run_id = mlflow.MlflowClient().create_run(experiment).info.run_id
    log_pyfunc(mlflow, run_id, tmp_path / "m.pt", _images(2), "resnet_small", None, "abc123")
    local = mlflow.artifacts.download_artifacts(f"runs:/{run_id}/model", dst_path=str(tmp_path / "dl"))
    digest = code_digest()
    package = f"ddpipe_{digest[:16]}"
    recorded = mlflow.models.Model.load(local).metadata
    assert {key: recorded.get(key) for key in ("ddpipe_version", "ddpipe_code_digest", "ddpipe_package")} == {
        "ddpipe_version": ddpipe.__version__, "ddpipe_code_digest": digest, "ddpipe_package": package}
    assert (Path(local) / "code" / package / "models" / "served.py").is_file()
    assert not (Path(local) / "code" / "ddpipe").exists()
    for name, text in OTHER_DDPIPE.items():
        (tmp_path / "other" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "other" / name).write_text(text)
    np.save(tmp_path / "images.npy", _images(5))
    (tmp_path / "beside.py").write_text(BESIDE_ANOTHER)
    (tmp_path / "elsewhere").mkdir()
    said = run([sys.executable, str(tmp_path / "beside.py"), local, str(tmp_path / "images.npy")],
               cwd=tmp_path / "elsewhere", env={"PYTHONPATH": str(tmp_path / "other"), "MLFLOW_TRACKING_URI": ""})
    answer = json.loads(said.stdout.strip().splitlines()[-1])
    expected = ImageClassifier.load(tmp_path / "m.pt").predict(_images(5))["probabilities"]
    assert np.array_equal(np.array(answer["probabilities"]), expected)
    assert answer["served_by"] == f"{package}.models.served" and answer["installed"] == "9.9.9"
    other = str(tmp_path / "other" / "ddpipe" / "__init__.py")
    assert answer["here"] == answer["spawned"] == [other, "9.9.9"], answer


def test_the_carried_copys_imports_of_ddpipe_are_renamed_and_nothing_else() -> None:
    from ddpipe.models.carried import renamed_imports

    source = """import ddpipe_other
from ddpipe.core.files import atomic_write  # from ddpipe.x import y, in a comment: left
from ddpipe import LAYERS
from  ddpipe.data import (
    store,
)
import os, ddpipe.models.nets as nets
TEXT = "from ddpipe.models import served"


def f() -> None:
    s = "é"; from ddpipe.models.saved import load_model  # a column after a 2-byte character
"""
    renamed = """import ddpipe_other
from ddpipe_0123.core.files import atomic_write  # from ddpipe.x import y, in a comment: left
from ddpipe_0123 import LAYERS
from  ddpipe_0123.data import (
    store,
)
import os, ddpipe_0123.models.nets as nets
TEXT = "from ddpipe.models import served"


def f() -> None:
    s = "é"; from ddpipe_0123.models.saved import load_model  # a column after a 2-byte character
"""
    assert renamed_imports(source.encode(), "ddpipe_0123").decode() == renamed
    with pytest.raises(ValueError, match="x.py:1: `import ddpipe.core` binds the name ddpipe"):
        renamed_imports(b"import ddpipe.core\n", "ddpipe_0123", "x.py")


def test_eval_flips_average_the_mirror_images_logits(tmp_path: Path) -> None:
    """model.eval_flips travels in the saved model: the served model predicts as validation did; a model
    file from before the key predicts without flips."""
    torch.manual_seed(0)
    cfg = ModelConfig(name="resnet_compact", width=8, eval_flips=True)
    net = build_model(cfg, 1, 10).eval()
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(predict_logits(net, x, True), (net(x) + net(x.flip(-1))) / 2)
        assert torch.equal(predict_logits(net, x, False), net(x))
    meta = {"num_channels": 1, "classes": [f"c{i}" for i in range(10)], "mean": [0.3], "std": [0.35],
            "image_size": [28, 28], "encoding": "raw"}
    save_model(net.state_dict(), cfg, meta, tmp_path / "flips.pt")
    flipped = ImageClassifier.load(tmp_path / "flips.pt")
    images = torch.from_numpy(_images(4))[:, None]
    mirrored = torch.from_numpy(_images(4)[:, :, ::-1].copy())[:, None]
    assert flipped.flips and torch.allclose(flipped.logits(images), flipped.logits(mirrored), atol=1e-5)
    payload = torch.load(tmp_path / "flips.pt", weights_only=True)
    del payload["model"]["eval_flips"], payload["format_version"]  # a model file written before the key existed
    torch.save(payload, tmp_path / "old.pt")
    assert not ImageClassifier.load(tmp_path / "old.pt").flips


@pytest.mark.parametrize("written", ["last before versions", "before the recipe", "before encoded data",
                                     "before eval_flips"])
def test_a_model_file_written_before_format_versions_loads_as_it_did(tmp_path: Path, written: str) -> None:
    """Format 0: model files as save_model and the train stage wrote them at each step before format versions,
    each with fewer keys (the last; before the exported weights and the evaluation crop were recorded; before
    encoded data; before model.eval_flips). Each loads its network and what it meant, and predicts with it."""
    torch.manual_seed(0)
    net = build_model(ModelConfig(name="resnet_small", width=8), 1, 10).eval()
    payload = {"state_dict": net.state_dict(), "model": {"name": "resnet_small", "width": 8}, "num_channels": 1,
               "classes": [f"c{i}" for i in range(10)], "mean": [0.3], "std": [0.35], "image_size": [28, 28]}
    if written != "before eval_flips":
        payload.update(model={**payload["model"], "eval_flips": True}, exported_epoch=2)
    if written in ("before the recipe", "last before versions"):
        payload.update(model={**payload["model"], "kwargs": {}, "weights": None}, encoding="raw")
    if written == "last before versions":
        payload.update(exported_weights="ema", eval_crop_ratio=0.9)
    torch.save(payload, tmp_path / "old.pt")

    model, saved = load_model(tmp_path / "old.pt")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), net.state_dict().values()))
    last, flips = written == "last before versions", written != "before eval_flips"
    assert (saved.model.name, saved.model.width, saved.model.kwargs, saved.model.weights) == \
        ("resnet_small", 8, {}, None)
    assert (saved.model.eval_flips, saved.encoding, saved.exported_epoch) == (flips, "raw", 2 if flips else None)
    assert (saved.exported_weights, saved.eval_crop_ratio) == (("ema", 0.9) if last else ("raw", IMAGENET_CROP_RATIO))
    classifier = ImageClassifier.load(tmp_path / "old.pt")
    x = (torch.from_numpy(_images(3))[:, None].float() / 255 - 0.3) / 0.35
    with torch.no_grad():
        expected = predict_logits(net, x, flips)
    assert torch.allclose(classifier.logits(torch.from_numpy(_images(3))[:, None]), expected, atol=1e-5)


def test_a_model_file_records_its_format_and_one_newer_than_this_code_is_refused(tmp_path: Path) -> None:
    cfg = ModelConfig(name="resnet_small", width=8)
    meta = {"num_channels": 1, "classes": [f"c{i}" for i in range(10)], "mean": [0.3], "std": [0.35],
            "image_size": [28, 28], "encoding": "raw"}
    save_model(build_model(cfg, 1, 10).state_dict(), cfg, meta, tmp_path / "m.pt")
    payload = torch.load(tmp_path / "m.pt", weights_only=True)
    assert payload["format_version"] == MODEL_FORMAT
    assert (payload["exported_epoch"], payload["exported_weights"]) == (None, "raw")  # extra's defaults, written
    payload["format_version"] = MODEL_FORMAT + 1
    torch.save(payload, tmp_path / "newer.pt")
    said = (f"{tmp_path / 'newer.pt'}: saved-model format {MODEL_FORMAT + 1} is newer than this ddpipe reads "
            f"(formats up to {MODEL_FORMAT})")
    with pytest.raises(ValueError, match=re.escape(said)):
        ImageClassifier.load(tmp_path / "newer.pt")


@pytest.mark.slow
def test_a_model_of_encoded_images_takes_any_size_and_predicts_as_evaluated(tmp_path: Path) -> None:
    """Trained on a folder of JPEG/PNG files of many sizes: the logged model takes each test image as a client
    has it (decoded, at its own size, one request each) and answers what the evaluate stage measured; its
    input goes through the evaluation crop of validation and the evaluate stage, at the evaluation size and crop
    (FixRes: larger than trained), and its weights are the ones exported, perhaps their moving average."""
    src = generate(tmp_path / "imgs", 120, 3)
    args = args_for(tmp_path, tmp_path / "prepared", "num_epochs=1", "mlflow.log_model=true",
                    "data.dataset=imagefolder", f"data.source_dir={src}", "data.image_size=40",
                    "train.batch_size_per_rank=16", "data.val_fraction=0.2", "data.test_fraction=0.2",
                    "model.name=resnet_compact", "train.hflip=true", "data.eval_image_size=48",
                    "data.eval_crop_ratio=0.95", "train.ema_decay=0.8")
    run(["python", "stages/prepare.py", *args])
    run(["python", "stages/train_worker.py", *args])
    run(["python", "stages/evaluate.py", *args])
    evaluated = [line.split(",")[1] for line in (tmp_path / "confusion.csv").read_text().splitlines()[1:]]
    import mlflow.pyfunc

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = json.loads((tmp_path / "run.json").read_text())["run_id"]
    served = mlflow.pyfunc.load_model(f"runs:/{run_id}/model")
    test = open_split(tmp_path / "prepared", "test")
    sizes = set()
    for i in range(len(test)):
        image = decode(test.blob(i), 3)  # what a client holds: the picture at its own size
        sizes.add(tuple(image.shape[1:]))
        answer = served.predict(image.permute(1, 2, 0).numpy()[None])  # 1 x H x W x C
        assert answer["label"].iloc[0] == evaluated[i], i
    assert len(sizes) > 10
    classifier = ImageClassifier.load(tmp_path / "model.pt")
    assert classifier.encoding == "encoded" and classifier.image_size == (48, 48)
    image = decode(test.blob(0), 3)
    assert torch.equal(classifier.to_batch(image.numpy()[None])[0], EvalCrop(48, 0.95)(image))
    exported = json.loads((tmp_path / "train.json").read_text())["train"]["exported_ema"]
    print("exported:", "the weight average" if exported else "the raw weights")
    assert load_model(tmp_path / "model.pt")[1].exported_weights == ("ema" if exported else "raw")


def _small_model_and_store(tmp_path: Path, seed: int, experiment_name: str) -> str:
    """A small resnet saved as tmp_path/m.pt (exported at epoch 1) and an experiment in a sqlite store there: its id."""
    import mlflow

    torch.manual_seed(seed)
    model_cfg = ModelConfig(name="resnet_small", width=8)
    meta = {"num_channels": 1, "classes": [f"c{i}" for i in range(10)], "mean": [0.3], "std": [0.35],
            "image_size": [28, 28], "encoding": "raw"}
    save_model(build_model(model_cfg, 1, 10).state_dict(), model_cfg, meta, tmp_path / "m.pt",
               extra={"exported_epoch": 1})
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    return mlflow.create_experiment(experiment_name, artifact_location=(tmp_path / "artifacts").as_uri())
