"""The export stage: ONNX and INT8 graphs of the trained model, scored by ONNX Runtime on images the tests write,
checked against the PyTorch model before they replace anything, registered, and served."""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from ddpipe.config.load import load_config
from ddpipe.config.schema import ConfigError, ModelConfig
from ddpipe.core.devices import cpu_int8_kind
from tests.conftest import (
    CONFIDENT_TRAINING,
    LIGHT_EXPORT,
    PARAMS,
    ROOT,
    TIMED_EXPORT,
    args_for,
    make_imagefolder,
    predict_without_ddpipe,
    run,
)

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, judged_prepared: Path) -> list[str]:
    """The default network trained for two epochs on generated MNIST-format data with 2,000 test images, without the
    random crop that makes its bars near-ties (a model the export's gates can judge: tests/conftest.py,
    CONFIDENT_TRAINING), evaluated, registered as clf."""
    tmp = tmp_path_factory.mktemp("export")
    args = args_for(tmp, judged_prepared, "mlflow.log_model=true", "mlflow.registered_model_name=clf",
                    "mlflow.experiment_name=exp", *CONFIDENT_TRAINING, *LIGHT_EXPORT)
    run(["python", "stages/train_worker.py", *args])
    run(["python", "stages/evaluate.py", *args])
    return args


def _client(cfg):  # noqa: ANN001, ANN202
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=cfg.mlflow.tracking_uri)


def _digests(*paths: str) -> list[str]:
    return [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths]


@pytest.mark.cpu_kernels
def test_the_default_network_exports_onnx_and_int8_that_a_plain_client_scores_as_evaluated(
        trained: list[str], judged_prepared: Path) -> None:
    import onnxruntime as ort

    from ddpipe.export.stage import export, merge

    cfg = load_config([*trained, *TIMED_EXPORT], params_file=PARAMS)
    m = export(cfg)["export"]
    # the DVC metrics hold what the run's parameters determine, this host's figures lie beside them: both, whole
    compared, host_figures = (json.loads(Path(p).read_text())
                              for p in (cfg.paths.export_metrics, cfg.paths.export_host))
    assert merge(compared, host_figures)["export"] == m
    assert {k: set(v) for k, v in compared["export"].items() if isinstance(v, dict)} == {
        "pytorch": {"accuracy", "agreement"}, "onnx": {"accuracy", "agreement", "size_mb"},
        "int8": {"accuracy", "agreement", "size_mb", "made_for"}}
    assert set(compared["export"]) - {"pytorch", "onnx", "int8"} == {"num_samples"}
    assert m["onnx"]["agreement"] >= 0.999 and m["onnx"]["max_prob_diff"] < 1e-4
    assert set(m["int8"]["latency_ms"]) == {"batch_1", "batch_8"} and m["int8"]["size_mb"] < m["onnx"]["size_mb"]
    # the INT8 copy is made for the CPU kind it runs on here, and says so
    assert m["int8"]["made_for"] == cpu_int8_kind() and m["cpu_vnni"] == (cpu_int8_kind() == "x86-vnni")
    host = m["latency_host"]  # what else ran while timing: the load and the cores others kept busy, and a verdict
    assert host["load_average"] >= 0 and host["others_busy_cores"] >= 0 and isinstance(host["busy"], bool)
    assert all(0 < t["p50"] <= t["p99"] and t["first"] > 0 for f in ("pytorch", "onnx", "int8")
               for t in m[f]["latency_ms"].values())
    # a client that knows nothing of ddpipe: ONNX Runtime, the raw uint8 test images, the metadata's class names
    images = np.load(judged_prepared / "test.images.npy")
    labels = np.load(judged_prepared / "test.labels.npy")
    evaluated = json.loads(Path(cfg.paths.test_metrics).read_text())["test"]["accuracy"]
    assert abs(m["pytorch"]["accuracy"] - evaluated) <= 0.001  # the stage's reference is the evaluate stage's model
    # the fp32 graph scores as the evaluate stage did; the INT8 copy as the stage scored it, within the stage's own
    # gates (on 2,000 images, 1 point is 20 of them)
    assert m["pytorch"]["accuracy"] - m["int8"]["accuracy"] <= cfg.export.max_int8_accuracy_drop
    assert m["int8"]["agreement"] >= 0.99, m["int8"]  # a confident model: its INT8 copy keeps its answers
    one = 1 / len(labels)  # an image: another thread count may settle a near-tie the other way
    for path, expected, tolerance in ((cfg.paths.onnx, evaluated, 0.001),
                                      (cfg.paths.onnx_int8, m["int8"]["accuracy"], one)):
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        (graph_input,) = session.get_inputs()
        assert graph_input.type == "tensor(uint8)" and isinstance(graph_input.shape[0], str)  # the batch is dynamic
        probs = np.concatenate([session.run(None, {graph_input.name: images[a:a + 7]})[0]
                                for a in range(0, len(images), 7)])
        assert np.allclose(probs.sum(1), 1.0, atol=1e-4)
        assert abs(float((probs.argmax(1) == labels).mean()) - expected) <= tolerance + 1e-9, path
        # the same answers whatever the batch: kernels that saturate would make them depend on its shape
        whole = session.run(None, {graph_input.name: images})[0]
        assert (whole.argmax(1) == probs.argmax(1)).all() and np.abs(whole - probs).max() < 1e-4, path
        assert json.loads(session.get_modelmeta().custom_metadata_map["classes"]) == [str(i) for i in range(10)]
    # registered with the training's version, which takes the alias now that its exports passed
    client = _client(cfg)
    version = client.get_model_version_by_alias("clf", "champion")
    assert version.tags["export_passed"] == "true" and float(version.tags["export_onnx_agreement"]) >= 0.999
    artifacts = {a.path for a in client.list_artifacts(version.run_id, "export")}
    assert artifacts == {"export/model.onnx", "export/model.int8.onnx"}
    run = client.get_run(version.run_id).info  # the training's run keeps the end it had
    assert run.status == "FINISHED" and run.end_time is not None


@pytest.mark.cpu_kernels
def test_an_int8_copy_made_for_another_cpu_kind_holds_its_weights_type_and_says_so_where_served(
        trained: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``export.int8_cpu`` names the CPUs the copy is for: one for x86 CPUs without VNNI holds uint8 weights (uint8 x
    int8 sums saturate there), one for VNNI int8 weights; the graph, the metrics and the served model say which."""
    import onnx

    from ddpipe.config.export import INT8_CPUS
    from ddpipe.export.stage import export
    from ddpipe.models.onnx_served import OnnxClassifier
    from ddpipe.models.saved import INT8_CPU_KEY, INT8_WEIGHTS

    assert set(INT8_WEIGHTS) == set(INT8_CPUS) - {"auto"}  # the schema's kinds are the ones a copy can be made for
    here = cpu_int8_kind()
    for kind in ("x86-vnni", "x86-no-vnni"):
        out = tmp_path / kind
        cfg = load_config([*trained, f"export.int8_cpu={kind}", f"paths.onnx={out}.onnx",
                           f"paths.onnx_int8={out}.8.onnx", f"paths.export_metrics={out}.json",
                           f"paths.export_host={out}.host.json", "mlflow.log_model=false"], params_file=PARAMS)
        m = export(cfg)["export"]
        assert m["int8"]["made_for"] == kind
        graph = onnx.load(cfg.paths.onnx_int8)
        assert {p.key: p.value for p in graph.metadata_props}[INT8_CPU_KEY] == kind
        initializers = {i.name: i for i in graph.graph.initializer}
        dequantized = {n.output[0]: n.input[0] for n in graph.graph.node if n.op_type == "DequantizeLinear"}
        convs = [n for n in graph.graph.node if n.op_type == "Conv"]
        conv_weights = {initializers[dequantized[n.input[1]]].data_type for n in convs}
        assert conv_weights == {onnx.TensorProto.INT8 if INT8_WEIGHTS[kind] == "int8" else onnx.TensorProto.UINT8}
        said = capsys.readouterr().err
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            OnnxClassifier(cfg.paths.onnx_int8)
        if kind == here:
            assert "note: the INT8 copy is made for" not in said and not caught
        else:
            assert f"note: the INT8 copy is made for {kind} CPUs (export.int8_cpu) and checked here on a {here}" in said
            assert any(f"made for {kind} CPUs and runs on a {here} CPU" in str(w.message) for w in caught)


@pytest.mark.cpu_kernels
def test_the_served_onnx_model_answers_a_raw_image_request_as_the_pytorch_one(trained: list[str],
                                                                             tmp_path: Path) -> None:
    import mlflow.pyfunc

    from ddpipe.models.served import ImageClassifier

    cfg = load_config(trained, params_file=PARAMS)
    version = _client(cfg).get_model_version_by_alias("clf", "champion")
    mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
    served = mlflow.pyfunc.load_model(version.tags["export_onnx_model"])
    request = np.random.default_rng(1).integers(0, 256, size=(5, 40, 40), dtype=np.uint8)  # N x H x W, resized
    answer = served.predict(request)
    assert list(answer.columns) == ["label", "class_index", "probability", "probabilities"]
    assert list(answer["label"]) == ImageClassifier.load(cfg.paths.model).predict(request)["label"]
    # where ddpipe is not installed: the logged ONNX model carries it
    labels, origin = predict_without_ddpipe(version.tags["export_onnx_model"], cfg.mlflow.tracking_uri, request,
                                            tmp_path / "bare")
    assert labels == list(answer["label"]) and not origin.startswith(str(ROOT)), origin
    with pytest.raises(ValueError, match="integer pixels must lie in 0-255"):  # bad input: refused before any work
        served.predict(np.full((1, 28, 28), 300, dtype=np.int64))


def _swap_classes(path: Path) -> None:
    """The graph's output reversed along the classes: a broken export that still runs."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    out = model.graph.output[0].name
    for node in model.graph.node:
        node.output[:] = [f"{o}_raw" if o == out else o for o in node.output]
    for name, value in (("s", [-1]), ("e", [-(2 ** 62)]), ("a", [1]), ("st", [-1])):
        model.graph.initializer.append(numpy_helper.from_array(np.array(value, dtype=np.int64), f"swap_{name}"))
    model.graph.node.append(helper.make_node("Slice", [f"{out}_raw", "swap_s", "swap_e", "swap_a", "swap_st"], [out]))
    onnx.save_model(model, str(path))


@pytest.mark.cpu_kernels
def test_a_broken_export_fails_the_stage_and_leaves_the_previous_export_in_place(
        trained: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import stages.export
    from ddpipe.export import stage

    cfg = load_config(trained + ["export.int8=true"], params_file=PARAMS)
    outputs = (cfg.paths.onnx, cfg.paths.onnx_int8, cfg.paths.export_host, cfg.paths.export_metrics)
    before = _digests(*outputs)
    real = stage.export_onnx

    def broken(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        real(*args, **kwargs)
        _swap_classes(args[2])

    monkeypatch.setattr(stage, "export_onnx", broken)
    with pytest.raises(SystemExit) as failed:
        stages.export.main(cfg)
    message = str(failed.value.code)
    assert "onnx: top-1 agrees with the PyTorch model on" in message
    assert "below export.min_agreement = 99.90%" in message
    assert "Nothing was written; the previous export stays in place" in message
    assert _digests(*outputs) == before
    assert not [p for p in Path(cfg.paths.onnx).parent.iterdir() if p.name.startswith(".export-")]
    # DVC deletes a stage's outputs before it runs unless they persist
    import yaml

    outs = yaml.safe_load((Path(__file__).parents[1] / "dvc.yaml").read_text())["stages"]["export"]["outs"]
    assert all(next(iter(o.values()))["persist"] for o in outs)
    version = _client(cfg).get_model_version("clf", "1")
    assert version.tags["export_passed"] == "false"


@pytest.mark.parametrize("eval_size", [None, 40])
def test_a_torchvision_network_with_its_own_stem_exports_and_scores(tmp_path: Path, eval_size: int | None) -> None:
    """resnet18 (torchvision's ImageNet stem) on a folder of 32 px RGB PNGs the test writes; with ``eval_size``, kept
    encoded and evaluated at a FixRes size larger than the images (the saved model's size, which the graph takes)."""
    import onnxruntime as ort

    from ddpipe.config.schema import DataConfig
    from ddpipe.data.prepare import prepare
    from ddpipe.data.store import load_meta
    from ddpipe.export.stage import export
    from ddpipe.models.catalog import build_model
    from ddpipe.models.saved import save_model

    folder = make_imagefolder(tmp_path / "imgs", per_class=12, size=32)
    encoding = "encoded" if eval_size else "auto"  # FixRes sizes are the encoded images' (raw ones have one size)
    prepare(DataConfig(dataset="imagefolder", source_dir=str(folder), encoding=encoding), 0, tmp_path / "raw",
            tmp_path / "prepared", workers=1)
    meta = asdict(load_meta(tmp_path / "prepared"))
    meta["image_size"] = [eval_size, eval_size] if eval_size else meta["image_size"]
    torch.manual_seed(0)
    network = build_model(ModelConfig(name="resnet18"), 3, 3)
    save_model(network.state_dict(), ModelConfig(name="resnet18"), meta, tmp_path / "model.pt")
    # untrained weights on noise: no accuracy to judge, so the INT8 gate is set aside (the graph is what is checked;
    # the fp32 graph against PyTorch is fp32 rounding, far below the logits' spread)
    cfg = load_config(args_for(tmp_path, tmp_path / "prepared", "model.name=resnet18", "data.dataset=imagefolder",
                               f"data.source_dir={folder}", "export.max_int8_accuracy_drop=1.0", *LIGHT_EXPORT),
                      params_file=PARAMS)
    m = export(cfg)["export"]
    assert m["onnx"]["agreement"] == 1.0 and m["num_samples"] == meta["sizes"]["test"]
    assert m["int8"]["size_mb"] < m["onnx"]["size_mb"] / 3
    (graph_input,) = ort.InferenceSession(cfg.paths.onnx, providers=["CPUExecutionProvider"]).get_inputs()
    assert graph_input.shape[1:] == [3, *meta["image_size"]]


OWN_NET = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(2))
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.body(x), 1))
"""


# under other CPU kinds' kernels (tests/test_cpu_kinds.py): the default networks, a user's and EMA weights; timm's and
# torchvision's are the same convolutions and norms, at 3x the cost
@pytest.mark.parametrize("case", [pytest.param("resnet_small", marks=pytest.mark.cpu_kernels), "timm",
                                  pytest.param("own module", marks=pytest.mark.cpu_kernels), "fine-tuned",
                                  pytest.param("ema", marks=pytest.mark.cpu_kernels)])
def test_every_kind_of_network_we_train_exports_and_agrees(case: str, tmp_path: Path, judged_prepared: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           request: pytest.FixtureRequest) -> None:
    """The default network on a GPU or an AMX CPU (resnet_small), a timm network by name, a user's module
    (module:Class), a fine-tuned torchvision network (its pretrained weights named but not needed to rebuild it) and
    EMA weights, each trained briefly (fresh weights answer every image alike), exported, and scored against the
    PyTorch model on the prepared test split (2,000 images: the 99.9 % agreement asked allows 2 near-ties to settle
    the other way in fp32 rounding). FixRes sizes: the torchvision test."""
    from ddpipe.data.store import load_meta
    from ddpipe.engine.ema import WeightAverage
    from ddpipe.export.stage import export
    from ddpipe.models.catalog import build_model
    from ddpipe.models.saved import save_model

    if case == "timm":
        pytest.importorskip("timm")
    (tmp_path / "export_own_nets.py").write_text(OWN_NET)  # a name no other test imports: modules stay cached
    monkeypatch.syspath_prepend(str(tmp_path))
    request.addfinalizer(lambda: sys.modules.pop("export_own_nets", None))
    model = ModelConfig(**{"resnet_small": {"name": "resnet_small", "width": 8}, "timm": {"name": "resnet10t"},
                           "own module": {"name": "export_own_nets:Net"},
                           "fine-tuned": {"name": "resnet18", "weights": "ResNet18_Weights.IMAGENET1K_V1"},
                           "ema": {"name": "resnet_compact", "width": 8}}[case])
    meta = asdict(load_meta(judged_prepared))
    torch.manual_seed(0)
    network = build_model(model, meta["num_channels"], len(meta["classes"]))
    average = WeightAverage(network, 0.9) if case == "ema" else None
    _train_briefly(network, judged_prepared, meta, average)
    state = average.weights() if average else network.state_dict()
    save_model(state, model, meta, tmp_path / "model.pt",
               {"exported_epoch": 1, "exported_weights": "ema" if average else "raw"})
    cfg = load_config(args_for(tmp_path, judged_prepared, f"model.name={model.name}", "export.int8=false",
                               "mlflow.log_model=false", *LIGHT_EXPORT), params_file=PARAMS)
    m = export(cfg)["export"]
    assert m["onnx"]["agreement"] >= 0.999 and m["num_samples"] == meta["sizes"]["test"], m["onnx"]
    assert m["onnx"]["max_prob_diff"] < 1e-3
    assert not Path(cfg.paths.onnx_int8).exists()
    assert m["onnx"]["accuracy"] == m["pytorch"]["accuracy"] > 0.15  # trained: more than chance (0.10)


def _train_briefly(network: torch.nn.Module, prepared: Path, meta: dict, average=None) -> None:  # noqa: ANN001
    """A few optimizer steps on the prepared training images (and the weight average after each, when given)."""
    from ddpipe.data.store import open_split

    split = open_split(prepared, "train")
    optimizer = torch.optim.AdamW(network.parameters(), lr=3e-3)
    mean = torch.tensor(meta["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(meta["std"]).view(1, -1, 1, 1)
    labels = torch.as_tensor(np.array(split.labels))
    network.train()
    for step in range(30):
        idx = np.arange(step * 32, step * 32 + 32) % len(labels)
        x = (torch.from_numpy(split.pixels(idx)).float() / 255 - mean) / std
        loss = torch.nn.functional.cross_entropy(network(x), labels[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if average is not None:
            average.update(network)
    network.eval()


@pytest.mark.cpu_kernels
def test_global_max_pooling_is_exported_as_a_reduction_that_answers_bit_for_bit() -> None:
    """resnet_small's and resnet_compact's AdaptiveMaxPool2d(1), which torch 2.11's exporter cannot translate,
    replaced in a copy by a max over height and width: the same answers to the bit, the caller's network untouched."""
    from ddpipe.export.graph import exportable
    from ddpipe.models.catalog import build_model
    from ddpipe.models.nets import GlobalMaxPool

    for name in ("resnet_small", "resnet_compact"):
        torch.manual_seed(0)
        network = build_model(ModelConfig(name=name, width=8), 1, 10).eval()
        copy = exportable(network)
        assert any(isinstance(m, GlobalMaxPool) for m in copy.modules())
        assert any(isinstance(m, torch.nn.AdaptiveMaxPool2d) for m in network.modules())
        x = torch.randn(4, 1, 28, 28)
        with torch.no_grad():
            assert torch.equal(copy(x), network(x)), name


@pytest.mark.parametrize("override, says", [
    ("export.formats=[tflite]", "export.formats = ['tflite'] is not accepted"),
    ("export.opset=12", "export.opset = 12 is not accepted"),
    ("export.calibration_split=test", "the test split is the check's own"),
    ("export.calibration_split=holdout", "expected train or val"),
    ("export.min_agreement=1.5", "export.min_agreement = 1.5 is not accepted"),
    ("export.max_int8_accuracy_drop=-0.1", "export.max_int8_accuracy_drop = -0.1 is not accepted"),
])
def test_bad_export_params_are_refused_before_any_work(override: str, says: str) -> None:
    with pytest.raises(ConfigError, match=re_escape(says)):
        load_config([override], params_file=PARAMS)


def test_an_opset_newer_than_the_exporter_writes_is_refused_before_any_work(tmp_path: Path) -> None:
    from ddpipe.export.stage import check_before_work

    args = args_for(tmp_path, tmp_path, "export.opset=99")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}  # conftest's migrated MLflow store alone
    with pytest.raises(ConfigError, match="export.opset = 99 is not accepted; the installed onnx"):
        check_before_work(load_config(args, params_file=PARAMS))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_an_operator_the_exporter_refuses_is_named(tmp_path: Path) -> None:
    from ddpipe.export.graph import ExportError, export_onnx
    from ddpipe.models.saved import SavedModel

    @torch.library.custom_op("ddpipe_test::twist", mutates_args=())
    def twist(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    twist.register_fake(lambda x: torch.empty_like(x))
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.LazyLinear(3))
    net(torch.zeros(1, 1, 8, 8))

    class Twisted(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return net(twist(x))

    saved = SavedModel({}, ModelConfig(name="mynets:Twisted"), 1, ["a", "b", "c"], [0.5], [0.25], [8, 8], "raw",
                       None, 1.0, "raw")
    with pytest.raises(ExportError, match=r"refused the operator .*twist"):
        export_onnx(Twisted(), saved, tmp_path / "m.onnx", 18)
    assert not (tmp_path / "m.onnx").exists()


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_latency_p50_is_the_best_rounds_median_and_the_first_call_is_reported_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of other work during one round of timed runs does not move p50; p99 sees it; the first call is apart."""
    from ddpipe.export import check

    calls = []
    times = iter([40.0,  # the first call; the rest of the warm-up is run untimed
                  1.0, 1.2, 1.1,  # round 1
                  5.0, 6.0, 5.5,  # round 2: the host busy
                  1.3, 1.4, 1.2])  # round 3
    monkeypatch.setattr(check, "_milliseconds", lambda run, batch: next(times))
    out = check.latency(calls.append, np.zeros((2, 1, 4, 4), np.uint8), [1], runs=9)["batch_1"]
    assert out["first"] == 40.0 and out["p50"] == 1.1 and out["p99"] > 5.5
    assert next(times, None) is None and len(calls) == check.WARMUP_RUNS - 1


def test_latencies_timed_beside_other_work_are_marked_busy() -> None:
    """Another process spinning a core while the block runs: its CPU time is counted, the export's own is not."""
    from ddpipe.export.check import BUSY_CORES, HostLoad

    spin = "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass"
    with HostLoad() as load:
        import subprocess

        subprocess.run([sys.executable, "-c", spin], check=True)
    figures = load.figures()
    assert figures["others_busy_cores"] >= BUSY_CORES and figures["busy"] is True


# qemu-user's model of an AVX2 EPYC: AVX2, no AVX-512, no VNNI (ONNX Runtime picks its INT8 kernels by CPUID; qemu
# computes VPMADDUBSW's saturating int16 sums as the silicon does: BENCHMARKS, "INT8 on CPUs without VNNI")
EMULATED_AVX2 = "EPYC-Rome"


def _answers(graph: Path, images: Path, out: Path, qemu: str | None = None) -> np.ndarray:
    """``graph``'s top-1 answers for the images in ``images``, from bench/int8_cpus.py's scoring child (numpy and
    ONNX Runtime only, one thread), natively or on qemu's :data:`EMULATED_AVX2`."""
    cmd = [sys.executable, str(ROOT / "bench" / "int8_cpus.py"), "--score", str(graph), str(images), str(out)]
    run([qemu, "-cpu", EMULATED_AVX2, *cmd] if qemu else cmd, timeout=600)
    return np.load(out)


def test_the_int8_copy_for_cpus_without_vnni_answers_alike_on_an_emulated_avx2_cpu(
        trained: list[str], judged_prepared: Path, tmp_path: Path) -> None:
    """The copy ``export.int8_cpu: auto`` makes on an x86 CPU without VNNI (uint8 weights), made and checked here by
    the export stage, scored again by ONNX Runtime on qemu's AVX2 EPYC: the same answers to the image as on this CPU
    (uint8 x uint8 sums are exact on both), so the stage's gates hold there as here. The copy for VNNI CPUs is this
    host's own (test_the_default_network_...); on a CPU without VNNI it saturates, which the served model warns of."""
    import shutil

    from ddpipe.export.stage import export

    qemu = shutil.which("qemu-x86_64")
    if qemu is None or cpu_int8_kind() == "other":
        pytest.skip("qemu-x86_64 (Debian's qemu-user, which .ci/run installs) and an x86 host are needed")
    out = tmp_path / "no-vnni"
    cfg = load_config([*trained, "export.int8_cpu=x86-no-vnni", f"paths.onnx={out}.onnx",
                       f"paths.onnx_int8={out}.8.onnx", f"paths.export_metrics={out}.json",
                       f"paths.export_host={out}.host.json", "mlflow.log_model=false"], params_file=PARAMS)
    m = export(cfg)["export"]  # passed its gates here, or it raised
    labels = np.load(judged_prepared / "test.labels.npy")
    images = judged_prepared / "test.images.npy"
    here = _answers(Path(cfg.paths.onnx_int8), images, tmp_path / "here.npy")
    emulated = _answers(Path(cfg.paths.onnx_int8), images, tmp_path / "emulated.npy", qemu)
    assert float((here == labels).mean()) == pytest.approx(m["int8"]["accuracy"], abs=1 / len(labels) + 1e-9)
    differ = np.flatnonzero(here != emulated)
    assert differ.size == 0, f"{differ.size} of {len(labels)} answers differ on the emulated AVX2 CPU: {differ[:20]}"
