"""The whole parameter schema: every key of a run's configuration, its default and what it accepts.

Every fact about a key sits in its field (see :func:`param`): its doc, what it accepts, and whether it
shapes the training trajectory. That one table drives the checks, the printed schema
(``ddpipe config --schema``) and :func:`~ddpipe.config.keys.trajectory`.
"""

# No ``from __future__ import annotations`` here: the schema's field types must stay real types at
# runtime (OmegaConf.structured reads them, and so do the checks and the printed schema).
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from ddpipe.config.export import ExportConfig
from ddpipe.config.jobs import ClusterConfig

# ConfigError is the schema's error: modules that check values import it from here
from ddpipe.config.param import ConfigError, param  # noqa: F401
from ddpipe.config.search import SearchConfig

DATASETS = ("fashion_mnist", "mnist", "cifar10", "imagefolder")
# model.name: ddpipe's own networks by these names; any other word names a torchvision (or timm) classification
# model, and "module:Class" a class of the user's (ddpipe.models.catalog checks the name before any work)
OWN_MODELS = ("resnet_small", "resnet_compact", "seed_cnn", "resnet18_cifar", "resnet34_cifar", "resnet50_cifar")


@dataclass
class DataConfig:
    """The dataset and its splits, how the prepare stage stores its images, and what training and evaluation
    read of them."""

    dataset: str = param("fashion_mnist", "Which dataset the fetch stage reads.", choices=DATASETS)
    source_dir: str = param(
        "data/source",
        "Where the dataset lies: class folders for imagefolder (read there, never copied); for the official "
        "datasets a directory searched first for their files (the four *-ubyte.gz files, cifar-10-python.tar.gz "
        "or its folder), then Debian's package directory, then the download. A dependency of the data stages, "
        "so it must exist: the default is the repository's (nearly empty) data/source.",
    )
    download: bool = param(True, "Allow torchvision's download when no local copy is found.")
    val_fraction: float = param(
        0.1, "Share of the official training set held out (stratified) for validation.", gt=0.0, lt=1.0
    )
    test_fraction: float = param(
        0.1, "imagefolder only (it has no official test split): share held out for the test split.",
        gt=0.0, lt=1.0,
    )
    max_train_samples: Optional[int] = param(None, "A stratified subset of this many training samples (null: all).",
                                             ge=1)
    max_test_samples: Optional[int] = param(None, "A stratified subset of this many test samples (null: all): "
                                            "quick runs, not figures to report.", ge=1, trajectory=False)
    classes: Any = param(
        None, "Keep only some classes, relabelled 0..K-1: the first N (in the dataset's order: sorted folder "
        "names for imagefolder), or a list of class names (in the list's order); null = all. Recorded in meta.json.",
        words="null, an integer >= 2, or a list of at least 2 class names",
    )
    encoding: str = param(
        "auto", "How prepare stores images: raw uint8 pixels (one size for all; a batch is one gather) or "
        "encoded JPEG/PNG files decoded per sample. auto: raw when every image has one size with sides of at "
        "most 64 px, else encoded.", choices=("auto", "raw", "encoded"),
    )
    max_side: int = param(
        512, "Encoded images: a longer side above this is downscaled to it at prepare (aspect ratio kept).", ge=16
    )
    jpeg_quality: int = param(90, "Encoded images re-encoded from a JPEG source: JPEG quality.", ge=1, le=100)
    skip_bad_images: bool = param(
        False, "An image file that cannot be decoded: false fails prepare naming it (nothing written); true skips "
        "it, listing it in meta.json and the log.",
    )
    image_size: Optional[int] = param(
        None, "Side of the square the network sees. Encoded images: training random-resized crops and evaluation "
        "centre crops of this size (null = 224). Raw images: their stored size (null, or that size).", ge=8,
    )
    eval_image_size: Optional[str] = param(
        "auto", "Encoded images: the side validation, the test split and the served model resize their centre crop "
        "to. Larger than image_size evaluates at a higher resolution than trained (FixRes: random-resized crops "
        "make objects look larger in training than in a centre crop of the same size). auto: the preset's share "
        "of image_size (ddpipe.engine.resolved.RECIPE_PRESETS; 9/8 for encoded images: 72 px for 64); null: "
        "image_size.",
        int_or=("auto",), ge=8,
    )
    eval_crop_ratio: str = param(
        "auto", "Encoded images: the evaluation crop's side as a share of the shorter side (0.875: Resize(256) + "
        "CenterCrop(224); 1.0 keeps the whole shorter side). auto: the preset's "
        "(ddpipe.engine.resolved.RECIPE_PRESETS; 1.0 for encoded images).", num_or=("auto",), gt=0.0, le=1.0,
    )
    num_workers: str = param(
        "auto", "DataLoader worker processes per rank that decode and augment (persistent, prefetching). auto: 0 "
        "for raw data (a batch is one gather) unless train.auto_augment or train.random_erasing gives each image "
        "work of its own, else the rank's share of this host's cores (less one on CUDA, half on CPU, where the "
        "training threads use them too).", int_or=("auto",), ge=0, trajectory=False,
    )
    decode_on: str = param(
        "auto", "Encoded images in training and validation: where files are decoded, cropped and augmented. "
        "workers: in the loader's worker processes, one image at a time (libjpeg-turbo/libpng on the CPU); device: "
        "on the training device, a batch at a time (on CUDA, JPEGs by nvJPEG through torchvision's decode_jpeg, "
        "PNGs on the CPU), the workers only reading the files; on a CPU the same bytes as workers. auto: workers, "
        "on CUDA too, until make gpu-check shows device decoding at least as fast at 224 px (the run records which). "
        "Not part of the trajectory: the same crops and draws either way (nvJPEG's pixels may differ by rounding).",
        choices=("auto", "workers", "device"), trajectory=False,
    )


@dataclass
class ModelConfig:
    """The network: which one, built how, from which weights, and how it predicts in evaluation."""

    name: str = param(
        "auto", "Network to train: auto (by device and input size, ddpipe.engine.resolved.resolve; logged), one of "
        "ddpipe's (" + ", ".join(OWN_MODELS) + "), any torchvision classification model by its name (resnet50, "
        "efficientnet_b0, convnext_tiny, vit_b_16, ...: its own ImageNet stem), a timm model when timm is installed, "
        "or module.path:ClassName (a class importable from the repository root, built with in_channels, "
        "num_classes and model.kwargs).", words="auto, a network's name, or module.path:ClassName",
    )
    width: int = param(16, "resnet_small / resnet_compact / seed_cnn: channels of the first stage.", ge=4)
    kwargs: dict[str, Any] = field(default_factory=dict, metadata={
        "doc": "Keyword arguments for the network's constructor (torchvision, timm or your class), e.g. "
               "{dropout: 0.2}.", "trajectory": True, "words": "a mapping of keyword arguments"})
    weights: Optional[str] = param(
        None, "Pretrained weights: a state-dict file under paths.pretrained (.pt/.pth/.bin as torchvision and timm "
        "distribute them, .safetensors with the safetensors package, or a model file exported by an earlier "
        "experiment), or a torchvision weights name (ResNet50_Weights.IMAGENET1K_V2: from torch hub's cache, else "
        "downloaded). Loaded with weights_only=True; a classifier head of another size is replaced. null: none.",
        words="null, a file under paths.pretrained, or a torchvision weights name (ResNet50_Weights.IMAGENET1K_V2)",
    )
    eval_flips: bool = param(
        True, "Validation, test and the served model average the logits of each image and of its left-right "
        "mirror (for data whose mirror images are the same class, as train.hflip assumes).",
    )


@dataclass
class TrainConfig:
    """How the train stage trains: batch and learning rate, optimizer and schedule, loss, augmentation, the
    recipe's optional steps, fine-tuning, speed, checkpoints and which weights leave the run."""

    optimizer: str = param("adamw", "Optimizer.", choices=("adamw", "sgd"))
    base_lr: float = param(3e-3, "Learning rate for one process, before lr_scaling.", gt=0.0)
    lr_scaling: str = param(
        "sqrt", "How the lr grows with world size: base_lr x sqrt(W), x W, or unchanged.",
        choices=("sqrt", "linear", "none"),
    )
    momentum: float = param(0.9, "SGD momentum (AdamW: beta1).", ge=0.0, lt=1.0)
    nesterov: bool = param(True, "SGD only: Nesterov momentum.")
    weight_decay: float = param(5e-4, "Decoupled weight decay (AdamW) or L2 (SGD).", ge=0.0)
    warmup_epochs: float = param(0.5, "Linear warm-up length, in epochs (counted in optimizer steps).", ge=0.0)
    lr_schedule: str = param("cosine", "After warm-up: cosine decay or constant.", choices=("cosine", "constant"))
    min_lr_ratio: float = param(0.0, "Cosine floor as a share of the peak lr.", ge=0.0, le=1.0)
    label_smoothing: float = param(0.1, "Cross-entropy label smoothing.", ge=0.0, lt=1.0)
    class_weights: str = param(
        "none", "Loss weight of each sample by its class: none, or balanced (n / (classes x the class's count in "
        "the training split), so rare classes weigh more and the mean weight is 1).", choices=("none", "balanced"),
    )
    sampler: str = param(
        "uniform", "Training order: uniform (every sample once per epoch, shuffled) or balanced (each epoch draws as "
        "many samples with replacement, every class equally likely); both the same global batches at any world "
        "size.", choices=("uniform", "balanced"),
    )
    ema_decay: Optional[float] = param(
        None, "Exponential moving average of the weights and BatchNorm buffers, updated every optimizer step with "
        "this decay (warmed up as min(decay, (1 + n) / (10 + n)) after n updates); validated each epoch beside "
        "the raw weights, exported when better. null = off. Typical: 0.999 (about 1000 steps).", ge=0.0, lt=1.0,
    )
    wd_norm_bias: bool = param(
        True, "Apply weight_decay to normalisation weights and biases too (false: only to conv and linear "
        "weights, as torchvision's recipe does).",
    )
    auto_augment: str = param(
        "none", "Per-image augmentation policy after the crop and flip (torchvision.transforms.v2): none, "
        "trivialaugment (TrivialAugmentWide) or randaugment (RandAugment, randaugment_ops and _magnitude).",
        choices=("none", "trivialaugment", "randaugment"),
    )
    randaugment_ops: int = param(2, "RandAugment: operations per image.", ge=1, le=14)
    randaugment_magnitude: int = param(9, "RandAugment: magnitude of each operation (of 31 bins).", ge=0, le=30)
    random_erasing: float = param(
        0.0, "Probability of erasing a random rectangle of each training image (RandomErasing, filled with the "
        "mean colour; 0 = off).", ge=0.0, le=1.0,
    )
    mixup_alpha: float = param(
        0.0, "MixUp: each training image blended with a partner sample, the share drawn from Beta(alpha, alpha); "
        "the targets blended alike (soft-target loss). 0 = off. Typical: 0.2.", ge=0.0,
    )
    cutmix_alpha: float = param(
        0.0, "CutMix: a rectangle of a partner sample pasted into each training image, its area share from "
        "Beta(alpha, alpha); targets by area. 0 = off. Typical: 1.0.", ge=0.0,
    )
    mix_prob: float = param(
        1.0, "MixUp/CutMix: the share of training images that are mixed.", ge=0.0, le=1.0,
    )
    mix_switch_prob: float = param(
        0.5, "With both mixup_alpha and cutmix_alpha set: the share of mixed images that take CutMix.", ge=0.0, le=1.0,
    )
    grad_clip_norm: Optional[float] = param(None, "Clip the global gradient norm to this (null = off).", gt=0.0)
    grad_accum_steps: int = param(1, "Micro-batches per optimizer step (no_sync on all but the last).", ge=1)
    body_lr_ratio: float = param(
        1.0, "Fine-tuning: the learning rate of the network's body (all but its classifier head) as a share of the "
        "head's, e.g. 0.1 for pretrained weights.", gt=0.0, le=1.0,
    )
    freeze_body_epochs: str = param(
        "0", "Fine-tuning: train only the classifier head for this many epochs (the body's weights fixed, its "
        "BatchNorm in eval mode), then everything; all: the body stays frozen for good.", int_or=("all",), ge=0,
    )
    # as the user set it; ddpipe.engine.resolved holds the int it becomes (OmegaConf has no int-or-word type)
    batch_size_per_rank: str = param(
        "auto", "Training micro-batch per process: an int, or auto (by device and input size, from the same "
        "table as model.name's auto: ddpipe.engine.resolved.AUTO_CHOICES).",
        int_or=("auto",),
    )
    eval_batch_size_per_rank: str = param(
        "auto", "Validation/test batch per process: an int, or auto (twice batch_size_per_rank: evaluation keeps no "
        "gradients, so its memory stays below the training step's, whatever the image size).", int_or=("auto",),
        trajectory=False,
    )
    precision: str = param(
        "auto", "auto: bf16 where the device runs it fast, else fp32. fp16 needs CUDA.",
        choices=("auto", "fp32", "bf16", "fp16"),
    )
    channels_last: str = param(
        "auto", "Memory format for conv nets: auto (on for CPU and for CUDA with bf16/fp16), on, off.",
        choices=("auto", "on", "off"),
    )
    auto_by: str = param(
        "measured", "How auto picks the network, its batch, the precision and the memory format on a CPU: measured "
        "(a few seconds of each candidate, once per machine kind, cached under ~/.cache/ddpipe/auto; "
        "docs/training.md) or table (fixed per device kind). Explicit values always win.",
        choices=("measured", "table"), trajectory=False)
    compile: bool = param(False, "Wrap the model in torch.compile.")
    deterministic: bool = param(
        False, "CUDA: true = the same weights from the same seed, run after run (deterministic algorithms and "
        "cuBLAS workspace, fixed cuDNN algorithms, no TF32, global pooling as reductions); false = fast (cuDNN "
        "benchmark, TF32 for fp32). CPU runs are deterministic either way; distributed.exact implies it.",
    )
    random_crop_padding: int = param(
        2, "Raw images' augmentation: pad by this many pixels, then crop back (0 = off).", ge=0)
    min_crop_scale: str = param(
        "auto", "Encoded images' augmentation (random-resized crop, the ImageNet recipe): the smallest share of the "
        "image's area a crop covers (ImageNet's 0.08). auto: the preset's (ddpipe.engine.resolved.RECIPE_PRESETS; "
        "0.35 for encoded images).", num_or=("auto",), gt=0.0, le=1.0,
    )
    hflip: bool = param(True, "Augmentation: random horizontal flips (turn off for digits).")
    checkpoint_every_steps: int = param(
        0, "Also checkpoint every N optimizer steps within an epoch (0 = at epoch ends only).", ge=0,
        trajectory=False,
    )
    keep_checkpoints: int = param(2, "How many newest checkpoints to keep.", ge=1, trajectory=False)
    model_epoch: str = param(
        "best", "Which weights become paths.model and the logged model: the epoch with the best validation "
        "accuracy (the earliest on ties) or the last epoch.", choices=("best", "last"), trajectory=False,
    )
    early_stopping_patience: Optional[int] = param(
        None, "Stop after this many epochs without a better validation accuracy (null = off).", ge=1
    )
    progress_bar: bool = param(True, "tqdm progress bar on rank 0.", trajectory=False)
    log_every_n_steps: int = param(
        10, "Every this many optimizer steps, rank 0's training loss since the last record, the step's learning "
        "rate, the global gradient norm and images/s go to MLflow at the global step (train_loss_step, lr_step, "
        "grad_norm, images_per_s_step); 0: per epoch only.", ge=0, trajectory=False)
    val_every_n_steps: int = param(
        0, "Also validate every this many optimizer steps inside an epoch (0: at epoch ends only): a step checkpoint, "
        "then val_loss_step and val_accuracy_step to MLflow at the global step and the live metrics files; a search's "
        "pruner is asked after each (its steps are validations).", ge=0, trajectory=False)


@dataclass
class DistributedConfig:
    """The processes of a run (torchrun's launch, one node or several) and how they sum and stop together."""

    # nproc_per_node and nnodes as the user set them (auto, MIN:MAX); ddpipe.engine.resolved.Job holds their ints
    nproc_per_node: str = param(
        "auto", "Processes per node: an int, or auto (one per GPU; on a CPU-only machine 1, using every core).",
        int_or=("auto",), trajectory=False,
    )
    max_restarts: int = param(0, "torchrun restarts of the worker group after a failure.", ge=0, trajectory=False)
    nnodes: str = param(
        "1", "Nodes (torchrun --nnodes): N, or MIN:MAX for elastic jobs. More than 1 needs rdzv_endpoint.",
        trajectory=False,
    )
    rdzv_endpoint: str = param(
        "", "host:port of the c10d rendezvous (the first node), for multi-node runs.", trajectory=False
    )
    rdzv_id: str = param(
        "ddpipe", "Rendezvous id: the same on every node of one job, new for each job.", trajectory=False
    )
    backend: str = param("auto", "auto: nccl on CUDA, gloo on CPU.", choices=("auto", "nccl", "gloo"))
    sync_batchnorm: bool = param(True, "Synchronise BatchNorm statistics across processes.")
    shared_memory: bool = param(
        True, "CPU, every rank on one host: SyncBatchNorm's and DDP's sums through shared memory instead of "
        "gloo's sockets (ddpipe.distributed.host_sums); same results, off: gloo for every sum.", trajectory=False,
    )
    exact: bool = param(
        False, "World-size-exact arithmetic (CPU): every sum over the batch in fp64, so 1 and N processes with "
        "the same global batch end with the same weights; 2.6x (fp32) to 4.2x (bf16) slower per step.",
    )
    threads_per_process: Optional[int] = param(
        None, "CPU threads per process (null = cores / local world size, shared with other trainings on the "
        "host (no more than a container's CPU quota), or fewer where train.auto_by=measured timed fewer faster on "
        "hyperthreads; a set "
        "value is kept, and the others share the cores it leaves); the evaluate and export stages' threads too "
        "(null: their share of the host).", ge=1,
    )
    timeout_s: int = param(600, "Bound on every collective; a silent rank fails the job after this.", ge=1,
                           trajectory=False)
    shutdown_timeout_s: int = param(
        60, "torchrun --shutdown-timeout: after forwarding a stop signal, seconds it gives the workers to "
        "checkpoint their step and exit before it kills them.", ge=1, trajectory=False,
    )


@dataclass
class MlflowConfig:
    """Where the train and evaluate stages record a run (MLflow), and what becomes of its model there."""

    enabled: bool = param(True, "Record each training as an MLflow run, with its evaluate and export figures; false: "
                          "no run, no store opened, MLflow not imported (the stages' files hold every figure).")
    tracking_uri: Optional[str] = param(None, "Where runs go. MLFLOW_TRACKING_URI wins; null: sqlite:///<repo root>/"
                                        "mlflow.db.")
    experiment_name: str = param("ddpipe", "MLflow experiment the runs are filed under.")
    log_model: bool = param(
        True, "Log the exported model (train.model_epoch) as an MLflow pyfunc model that takes images as clients have "
        "them and returns class probabilities and names, and the export stage's fp32 graph as model_onnx.")
    registered_model_name: Optional[str] = param(
        None, "Also register the logged model under this name (a version tagged with the DVC experiment and "
        "git commit); null: no registration.")
    sweep: Optional[str] = param(
        None, "Name of the sweep this run belongs to: runs with the same name are nested under one parent run "
        "of that name (dvc exp run --queue -S mlflow.sweep=NAME ...); null: a top-level run.")
    log_system_metrics: bool = param(
        True, "MLflow's system metrics (CPU, memory, GPU) every 10 s: rank 0's node into a local store, every "
        "node into a tracking server.")
    champion_alias: Optional[str] = param(
        "champion", "With registered_model_name: the export stage moves this alias to the version whose exported "
        "model has the best validation accuracy (model_val_accuracy, on the same validation split) among those whose "
        "exports passed their check and that the test does not veto; null: no alias.")
    champion_max_test_drop: float = param(
        0.05, "The test's veto on the champion: a version whose test accuracy is more than this (a share: 0.05 is 5 "
        "points) below its own validation accuracy never takes the alias. The test never ranks versions.",
        ge=0.0, le=1.0)
    outbox: str = param(
        "mlflow-outbox", "Where a run's MLflow records are kept until the store has them (relative: under the repo "
        "root); an unreachable server loses nothing: ddpipe outbox deliver.")


TIME_LIMIT = re.compile(r"^(\d+-)?\d+(:\d\d){0,2}$")


@dataclass
class PathsConfig:
    """Where each stage's files go. dvc.yaml interpolates them into the stages' deps and outs
    (``${paths.model}``), so no stage lists them under ``params:``: a changed path changes the stages that
    name it."""

    raw: str = param("data/raw", "Fetch stage output: verified copies of the dataset's files.")
    prepared: str = param("data/prepared", "Prepare stage output: per split memory-mapped raw pixels or encoded "
                          "shards with an index, plus meta.json.")
    checkpoints: str = param(
        "checkpoints", "Training checkpoints (git-ignored, not a DVC output: DVC never deletes them); a run "
        "resumes from the newest of its own (the same trajectory keys, global batch and prepared data). A directory, "
        "or a prefix in object storage, s3://BUCKET/PREFIX (several nodes with no shared disk).")
    model: str = param("models/model.pt", "Final weights plus what rebuilds the model.")
    run_info: str = param("models/run.json", "The MLflow run id the evaluate stage logs to.")
    train_metrics: str = param("metrics/train.json", "Training metrics (DVC metrics); running: true until it ends.")
    history: str = param("metrics/history.csv", "Per-epoch training curves (DVC plots), after every validation.")
    test_metrics: str = param("metrics/test.json", "Test-split accuracy, macro-F1, loss (DVC metrics).")
    per_class: str = param("metrics/per_class.csv", "Test-split precision, recall and F1 per class (DVC plots).")
    confusion: str = param("metrics/confusion.csv", "Test predictions for DVC's confusion plot.")
    reports: str = param("reports", "Evaluate stage images: confusion matrix, misclassified samples.")
    onnx: str = param("models/model.onnx", "Export stage: the fp32 ONNX graph (uint8 images in, probabilities out).")
    onnx_int8: str = param("models/model.int8.onnx", "Export stage: its static INT8 copy (export.int8).")
    export_metrics: str = param("metrics/export.json", "Export stage: each format's test accuracy, agreement with the "
                                "PyTorch model and size (DVC metrics: figures the run's parameters determine).")
    export_host: str = param(
        "metrics/export_host.json", "Export stage: what this host measured, which moves between two runs of one model "
        "(not a DVC metric): each format's CPU latency and largest probability difference from PyTorch, the threads, "
        "the host's load while timing, whether its CPU has VNNI.")
    pretrained: str = param(
        "pretrained", "Where local weights files lie (model.weights names one): a dependency of the train stage, so "
        "DVC re-trains when a file there changes. The default, the repository's pretrained/, exists in every clone.")
    stage_env: str = param(
        "stages/env", "Each stage's locked packages, <stage>.txt: what its code imports and what those depend on, "
        "name==version (generated from uv.lock and dvc.yaml: ddpipe config --stage-env, which make lock runs); a "
        "dependency of that stage, so a new version of a package it runs with re-runs it and a dev tool's does not.")


@dataclass
class Config:
    """A run's whole configuration: ``seed`` and ``num_epochs`` at the top level (so ``dvc exp run -S
    num_epochs=20`` needs no section), then one section per concern."""

    seed: int = param(42, "Seeds weights, splits and augmentation.", ge=0)
    num_epochs: int = param(10, "Training epochs.", ge=1)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    export: ExportConfig = field(default_factory=ExportConfig, metadata={"trajectory": False})
    # Where files go and how runs are tracked never change the weights: none of these keys shapes the trajectory.
    mlflow: MlflowConfig = field(default_factory=MlflowConfig, metadata={"trajectory": False})
    paths: PathsConfig = field(default_factory=PathsConfig, metadata={"trajectory": False})
    cluster: ClusterConfig = field(default_factory=ClusterConfig, metadata={"trajectory": False})
    search: SearchConfig = field(default_factory=SearchConfig, metadata={"trajectory": False})
