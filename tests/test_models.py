"""Any network by name (ddpipe's, torchvision's, timm's, a class of the user's) and pretrained weights: read
safely, fitted to the network (head, grey stem, normalisation), on files the tests write themselves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from ddpipe.config.schema import ConfigError, ModelConfig
from ddpipe.data.store import Prepared
from ddpipe.models.catalog import build_model, classifier_head, code_paths
from ddpipe.models.pretrained import WeightsError, apply_pretrained, load_pretrained
from ddpipe.models.saved import load_model, save_model
from tests.conftest import OWN_NET

META = {"num_channels": 1, "classes": [str(i) for i in range(10)], "mean": [0.5], "std": [0.25],
        "image_size": [28, 28], "encoding": "raw"}
FASHION_SHAPE = Prepared("random", META["classes"], 1, "raw", [28, 28], None, [0.5], [0.25], {"train": 100})


@pytest.fixture
def repo_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory as a stage has it (the repository root), with the user's mynets.py in it."""
    (tmp_path / "mynets.py").write_text(OWN_NET)
    (tmp_path / "pretrained").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    import sys
    sys.modules.pop("mynets", None)


@pytest.mark.parametrize("name, head", [("resnet50", "fc"), ("efficientnet_b0", "classifier.1"),
                                        ("mobilenet_v3_small", "classifier.3"), ("convnext_tiny", "classifier.2"),
                                        ("vit_b_16", "heads.head")])
def test_torchvision_networks_by_name_keep_their_own_stem(name: str, head: str) -> None:
    """Any torchvision classification model, its ImageNet stem intact but made for grey images, its head sized."""
    model = build_model(ModelConfig(name=name), 1, 7)
    stem = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    reference = next(m for m in torchvision.models.get_model(name).modules() if isinstance(m, nn.Conv2d))
    assert stem.in_channels == 1 and (stem.kernel_size, stem.stride) == (reference.kernel_size, reference.stride)
    assert classifier_head(model, 7) == head and model.get_submodule(head).out_features == 7


def test_small_image_resnets_keep_their_names_and_a_stale_model_file_says_what_changed(tmp_path: Path) -> None:
    """resnet18 now means torchvision's (7x7 stride-2 stem); the 3x3 small-image variant is resnet18_cifar, and
    a model file saved under the old meaning is refused with the new name in the message."""
    assert build_model(ModelConfig(name="resnet18"), 1, 10).conv1.kernel_size == (7, 7)
    small = build_model(ModelConfig(name="resnet18_cifar"), 1, 10)
    assert small.conv1.kernel_size == (3, 3) and isinstance(small.maxpool, nn.Identity)
    save_model(small.state_dict(), ModelConfig(name="resnet18"), META, tmp_path / "old.pt")  # as written before
    with pytest.raises(ValueError, match="now means torchvision's own resnet18 .* now named 'resnet18_cifar'"):
        load_model(tmp_path / "old.pt")


def test_unknown_names_and_keywords_are_refused_with_what_is_accepted(repo_dir: Path) -> None:
    with pytest.raises(ConfigError, match="model.name = 'resnt50' is not accepted.*Did you mean resnet50"):
        build_model(ModelConfig(name="resnt50"), 3, 10)
    with pytest.raises(ConfigError, match="model.kwargs = .'depth': 3. is not accepted by model.name = 'resnet18'"):
        build_model(ModelConfig(name="resnet18", kwargs={"depth": 3}), 3, 10)
    with pytest.raises(ConfigError, match="module 'nonets' cannot be imported"):
        build_model(ModelConfig(name="nonets:Net"), 3, 10)
    with pytest.raises(ConfigError, match="has no class 'Tiny'; its networks: TinyNet"):
        build_model(ModelConfig(name="mynets:Tiny"), 3, 10)


def test_a_network_of_ones_own_is_built_saved_and_rebuilt_with_its_kwargs(repo_dir: Path) -> None:
    cfg = ModelConfig(name="mynets:TinyNet", kwargs={"hidden": 5})
    model = build_model(cfg, 1, 10)
    assert model.head.in_features == 5 * 14 * 14 and classifier_head(model, 10) == "head"
    assert code_paths(cfg.name) == [str(repo_dir / "mynets.py")]  # what the logged MLflow model carries
    save_model(model.state_dict(), cfg, META, repo_dir / "model.pt")
    rebuilt, saved = load_model(repo_dir / "model.pt")
    assert saved.model.kwargs == {"hidden": 5}
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(rebuilt(x), model.eval()(x))


@pytest.mark.skipif(not __import__("importlib.util").util.find_spec("timm"), reason="timm not installed")
def test_timm_models_by_name() -> None:
    model = build_model(ModelConfig(name="resnet10t"), 1, 4)
    assert classifier_head(model, 4) == "fc" and model(torch.randn(2, 1, 32, 32)).shape == (2, 4)


def _torchvision_file(path: Path, name: str = "resnet18") -> nn.Module:
    """A torchvision-format state dict: 3 channels, 1,000 classes, as torchvision distributes them."""
    torch.manual_seed(1)
    reference = torchvision.models.get_model(name, num_classes=1000)
    torch.save(reference.state_dict(), path)
    return reference


def test_torchvision_state_dict_serves_grey_images_with_a_new_head(repo_dir: Path) -> None:
    """The body is the file's; the stem's RGB filters summed answer a grey image exactly as the RGB network
    answers it repeated to three channels; the 1,000-class head is replaced."""
    reference = _torchvision_file(repo_dir / "pretrained" / "r18.pth")
    pretrained = load_pretrained("pretrained/r18.pth")
    model = build_model(ModelConfig(name="resnet18"), 1, 10)
    lines = apply_pretrained(model, pretrained, 10)
    assert any("stem conv1: 3-channel weights summed" in line for line in lines)
    assert any("classifier head fc replaced for 10 classes" in line for line in lines)
    import hashlib
    assert pretrained.sha256 == hashlib.sha256((repo_dir / "pretrained" / "r18.pth").read_bytes()).hexdigest()
    grey = torch.rand(2, 1, 64, 64)
    body = nn.Sequential(*list(model.children())[:-1]).eval()
    ref_body = nn.Sequential(*list(reference.children())[:-1]).eval()
    torch.testing.assert_close(body(grey), ref_body(grey.expand(-1, 3, -1, -1)), rtol=1e-4, atol=1e-5)
    assert model.fc.out_features == 10 and not model.fc.weight.any() and not model.fc.bias.any()  # zeros: loss ln K


def test_a_file_with_a_pickle_payload_is_refused_and_its_payload_never_runs(repo_dir: Path) -> None:
    """CVE-2025-32434: weights_only=True; the payload's marker file is never written."""
    marker = repo_dir / "payload-ran"

    class Payload:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, (f"touch {marker}",))

    reference = torchvision.models.resnet18(num_classes=1000)
    torch.save({"state_dict": reference.state_dict(), "extra": Payload()}, repo_dir / "pretrained" / "evil.pth")
    with pytest.raises(WeightsError, match="is refused: the file holds pickled objects .*CVE-2025-32434.*posix.system"):
        load_pretrained("pretrained/evil.pth")
    assert not marker.exists()


def test_weights_that_do_not_fit_name_their_keys(repo_dir: Path) -> None:
    _torchvision_file(repo_dir / "pretrained" / "r18.pth")
    with pytest.raises(WeightsError, match="does not fit model.name's network; keys missing from the file: layer1.2"):
        apply_pretrained(build_model(ModelConfig(name="resnet34"), 3, 10), load_pretrained("pretrained/r18.pth"), 10)
    (repo_dir / "pretrained" / "junk.pth").write_bytes(b"not a torch file")
    with pytest.raises(WeightsError, match="cannot be read as PyTorch weights"):
        load_pretrained("pretrained/junk.pth")
    with pytest.raises(WeightsError, match="no such file"):
        load_pretrained("pretrained/missing.pth")


def test_checkpoint_wrappers_and_safetensors_are_read(repo_dir: Path) -> None:
    reference = build_model(ModelConfig(name="resnet_compact"), 1, 10)
    state = reference.state_dict()
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, repo_dir / "pretrained/c.pt")
    assert load_pretrained("pretrained/c.pt").state_dict.keys() == state.keys()
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(repo_dir / "pretrained" / "w.safetensors"))
    loaded = load_pretrained("pretrained/w.safetensors").state_dict
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_an_exported_model_brings_its_normalisation(repo_dir: Path) -> None:
    """A model exported by an earlier experiment: its weights, and the mean and std it was trained with."""
    net = build_model(ModelConfig(name="resnet_compact"), 1, 6)
    save_model(net.state_dict(), ModelConfig(name="resnet_compact"), {**META, "classes": list("abcdef")},
               repo_dir / "pretrained" / "exp1.pt")
    pretrained = load_pretrained("pretrained/exp1.pt")
    assert pretrained.normalisation(1) == ([0.5], [0.25])
    target = build_model(ModelConfig(name="resnet_compact"), 1, 4)
    lines = apply_pretrained(target, pretrained, 4)
    assert "classifier replaced for 4 classes" in lines[-1]
    assert torch.equal(target.features[0].weight, net.features[0].weight)


def test_a_torchvision_weights_name_reads_torch_hubs_cache_and_says_where_offline(
        repo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(repo_dir / "torch-home"))

    def offline(url: str, dst: str, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        raise OSError("Network is unreachable")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    cache = repo_dir / "torch-home" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    with pytest.raises(WeightsError, match=f"{cache} is not in torch hub's cache and downloading .* failed"):
        load_pretrained("ResNet18_Weights.IMAGENET1K_V1")
    _torchvision_file(cache)
    pretrained = load_pretrained("ResNet18_Weights.IMAGENET1K_V1")
    assert pretrained.file == cache
    assert pretrained.normalisation(3) == ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])  # ImageNet's
    (mean,), (std,) = pretrained.normalisation(1)  # grey: the channels' average
    assert (mean, std) == (pytest.approx(0.449), pytest.approx(0.226))
    with pytest.raises(WeightsError, match="not a torchvision weights name"):
        load_pretrained("ResNet18_Weights.IMAGENET9K")


def test_the_launcher_says_when_dvc_yaml_misses_the_networks_file(repo_dir: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """An edit to mynets.py re-runs train and evaluate only if dvc.yaml lists it: the launcher checks."""
    from ddpipe.config.load import load_config
    from ddpipe.engine.assembly import build_network
    from ddpipe.engine.resolved import resolve
    from ddpipe.launch.torchrun import note_network

    def check(*overrides: str) -> None:  # what the launcher's preflight does with the network
        run = resolve(load_config(list(overrides), params_file=None), torch.device("cpu"), FASHION_SHAPE)
        build_network(run)
        note_network(run)

    (repo_dir / "dvc.yaml").write_text("stages:\n  train:\n    deps:\n      - stages/train_worker.py\n")
    check("model.name=mynets:TinyNet")
    assert "lives in mynets.py, which dvc.yaml does not list" in capsys.readouterr().err
    (repo_dir / "dvc.yaml").write_text("stages:\n  train:\n    deps:\n      - mynets.py\n")
    check("model.name=mynets:TinyNet")
    assert capsys.readouterr().err == ""
    check("model.name=resnet18")
    assert "the small-image variant this name meant before is 'resnet18_cifar'" in capsys.readouterr().err


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("name", ["resnet_small", "seed_cnn"])  # global max pooling | global average pooling
def test_global_pools_as_reductions_answer_and_learn_as_the_adaptive_pools(name: str) -> None:
    """train.deterministic on CUDA computes global pooling as reductions (their backward adds no atomics): the same
    outputs and gradients as nn.AdaptiveMax/AvgPool2d(1), the same state dict."""
    from ddpipe.models.nets import GlobalAvgPool, GlobalMaxPool, global_pools_as_reductions

    torch.manual_seed(0)
    network = build_model(ModelConfig(name=name, width=8), 1, 10)
    swapped = build_model(ModelConfig(name=name, width=8), 1, 10)
    swapped.load_state_dict(network.state_dict())
    assert global_pools_as_reductions(swapped) is swapped and swapped.state_dict().keys() == network.state_dict().keys()
    assert not any(isinstance(m, (nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool2d)) for m in swapped.modules())
    assert any(isinstance(m, (GlobalMaxPool, GlobalAvgPool)) for m in swapped.modules())
    x = torch.randn(4, 1, 28, 28)
    for model in (network, swapped):
        model(x).square().mean().backward()
    torch.testing.assert_close(swapped(x), network(x), rtol=0, atol=1e-6)
    for a, b in zip(network.parameters(), swapped.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)
