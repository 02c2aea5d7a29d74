"""The checks of a loaded config: every key's bounds and choices, then the rules that tie keys together."""

import re
from pathlib import Path

from ddpipe.config.export import check_export
from ddpipe.config.keys import FIELDS, flatten
from ddpipe.config.rules import accepted, accepts, not_accepted
from ddpipe.config.schema import TIME_LIMIT, Config, ConfigError


def validate(cfg: Config, set_in: dict[str, str] | None = None) -> None:
    """Check every key's bounds and choices, then the rules that tie keys together. ``set_in`` maps
    keys to the file or "command line" that set them, for the messages."""
    set_in = set_in or {}
    for key, value in flatten(cfg).items():
        if key not in FIELDS:  # inside a free mapping (model.kwargs): the network's constructor checks it
            continue
        if not accepts(FIELDS[key], value):
            raise not_accepted(key, value, accepted(FIELDS[key]), set_in.get(key))
    classes = cfg.data.classes
    if not (classes is None or (isinstance(classes, int) and not isinstance(classes, bool) and classes >= 2) or (
            isinstance(classes, list) and len(classes) >= 2 and all(isinstance(c, str) for c in classes)
            and len(set(classes)) == len(classes))):
        raise not_accepted("data.classes", classes, accepted(FIELDS["data.classes"]) + " (distinct)",
                           set_in.get("data.classes"))
    _check_model(cfg, set_in)
    check_export(cfg.export, set_in)
    uri = cfg.mlflow.tracking_uri or ""
    if "@" in uri.partition("://")[2].split("/", 1)[0]:  # never a password in params.yaml, dvc.lock or a run
        raise ConfigError("mlflow.tracking_uri holds credentials (user:password@host); not accepted: give the "
                          "server's address only and the credentials as MLFLOW_TRACKING_USERNAME and "
                          "MLFLOW_TRACKING_PASSWORD (or ~/.mlflow/credentials)")
    dist = cfg.distributed
    nnodes = dist.nnodes.split(":")
    if not (1 <= len(nnodes) <= 2 and all(n.isdigit() and int(n) >= 1 for n in nnodes)):
        raise not_accepted("distributed.nnodes", dist.nnodes, "a positive integer N or MIN:MAX",
                           set_in.get("distributed.nnodes"))
    if nnodes != ["1"] and dist.rdzv_endpoint and ":" not in dist.rdzv_endpoint:
        raise ConfigError(f"distributed.rdzv_endpoint = {dist.rdzv_endpoint!r} is not accepted with "
                          f"distributed.nnodes = {dist.nnodes!r}; expected host:port of the first node")
    for key in ("partition", "account", "mem"):  # written into #SBATCH lines: one word each
        value = getattr(cfg.cluster, key)
        if value is not None and not re.match(r"^[A-Za-z0-9_.,:+-]+$", value):
            raise not_accepted(f"cluster.{key}", value, "null, or one word of letters, digits and _.,:+-",
                               set_in.get(f"cluster.{key}"))
    if not TIME_LIMIT.match(cfg.cluster.time_limit):
        raise not_accepted("cluster.time_limit", cfg.cluster.time_limit, accepted(FIELDS["cluster.time_limit"]),
                           set_in.get("cluster.time_limit"))
    if dist.exact and not dist.sync_batchnorm:
        raise ConfigError("distributed.sync_batchnorm = False is not accepted with distributed.exact = True "
                          "(exact mode normalises over the global batch); accepted: true")
    if dist.exact and cfg.train.compile:
        raise ConfigError("train.compile = True is not accepted with distributed.exact = True (compiled "
                          "kernels may reorder the per-sample arithmetic); accepted: false")


# "resnet50", "vit_base_patch16_224.augreg_in21k" (timm's tags), "mynets:TinyNet", "my_pkg.nets:Net"
_MODEL_NAME = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")
# ResNet50_Weights.IMAGENET1K_V2, ViT_B_16_Weights.DEFAULT
TORCHVISION_WEIGHTS = re.compile(r"^[A-Za-z0-9_]+_Weights\.[A-Za-z0-9_]+$")


def _check_model(cfg: Config, set_in: dict[str, str]) -> None:
    """model.name's form (whether it names a network: ddpipe.models.catalog, at launch) and model.weights'
    place: a local file must lie under paths.pretrained, the train stage's dependency, or DVC would not
    re-train when it changes."""
    name = cfg.model.name
    if not _MODEL_NAME.match(name):
        raise not_accepted("model.name", name, accepted(FIELDS["model.name"]), set_in.get("model.name"))
    weights = cfg.model.weights
    if weights is None or TORCHVISION_WEIGHTS.match(weights):
        return
    root = Path(cfg.paths.pretrained)
    path = Path(weights)
    if ".." in path.parts or path.parts[:len(root.parts)] != root.parts or len(path.parts) <= len(root.parts):
        raise ConfigError(f"{set_in.get('model.weights', 'config')}: model.weights = {weights!r} is not accepted; "
                          f"expected a torchvision weights name (ResNet50_Weights.IMAGENET1K_V2) or a file under "
                          f"paths.pretrained ({root}/...), which dvc.yaml lists as the train stage's dependency: "
                          f"copy the file there (e.g. cp {weights} {root}/)")
