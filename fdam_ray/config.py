"""Run configuration: one flat set of plain names shared by YAML files, the CLI and Tune.

Every field is declared once in :data:`FIELDS` with its type, default, allowed
values and the paper's symbol. :func:`build_config` is the only way to make a
:class:`Config`: it rejects unknown keys, coerces types, applies the chosen
algorithm's preset defaults for fields the user left unset, and checks every
value, raising :class:`ConfigError` (a ``ValueError``) that names the field, the
value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from fdam_ray.algorithms.presets import PRESETS
from fdam_ray.factories import PYTHON_PREFIX, import_path_of, is_import_path, python_name, resolve
from fdam_ray.schedules import MIN_LR, ScheduleSection, last_stage


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    kind: str  # "int", "float", "bool", "str", "batch", "int_list", "str_list", "factory" (a name or module:attr),
    #            "resource_list"; "int_auto", "bool_auto": or "auto"
    default: Any
    doc: str
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], bool] | None = None
    allowed: str = ""
    optional: bool = False


def _f(name, kind, default, doc, *, choices=None, check=None, allowed="", optional=False):
    return Field(name, kind, default, doc, choices, check, allowed, optional)


_pos = (lambda v: v > 0, "> 0")
_nonneg = (lambda v: v >= 0, ">= 0")
_ge1 = (lambda v: v >= 1, ">= 1")

MODEL_NAMES = ("linear", "mlp", "cnn", "resnet20", "densenet121", "densenet161")
# "arrays" and "datasets" are set by fdam_ray.train_arrays / train_datasets (bring-your-own data), not by hand.
DATASET_NAMES = ("digits", "synthetic", "arrays", "cifar10", "cifar100", "imagefolder", "mnist5k", "chestxray",
                 "datasets")
CHESTXRAY_SOURCES = ("chexpert", "nih", "padchest", "mimic", "vindr")

FIELDS: tuple[Field, ...] = (
    # -- algorithm ---------------------------------------------------------------
    _f("algorithm", "str", "codasca", "Named preset: objective x drift correction (docs/algorithms.md s.4).",
       choices=tuple(PRESETS)),
    _f("objective", "str", None, "Loss: auc_square (paper eq. 2), auc_margin (AUC-M) or bce; "
       "default from the algorithm preset.", choices=("auc_square", "auc_margin", "bce"), optional=True),
    _f("margin", "float", 1.0, "m, the margin of auc_margin.", check=_pos[0], allowed=_pos[1]),
    _f("num_clients", "int", 4, "K, number of federated clients.", check=_ge1[0], allowed=_ge1[1]),
    _f("clients_per_round", "int", None, "S, clients sampled (uniformly, without replacement, seeded by seed and "
       "round) to take part in each round; null = all K.", check=_ge1[0], allowed=_ge1[1], optional=True),
    _f("client_weighting", "str", "uniform", "Weights of the server's means and CODA's alpha: uniform (1/K, the "
       "paper) or samples (n_k / n, the objective of the pooled data).", choices=("uniform", "samples")),
    _f("local_steps", "int", 10, "I, local steps per communication round (I_0 for the geometric schedule).",
       check=_ge1[0], allowed=_ge1[1]),
    _f("lr", "float", 0.1, "eta (eta_l for CODASCA), local step size.", check=_pos[0], allowed=_pos[1]),
    _f("global_lr", "float", 1.0, "eta_g, server extrapolation; 1 is plain averaging.",
       check=_pos[0], allowed=_pos[1]),
    _f("prox_weight", "float", 0.002, "gamma, weight of the proximal term towards the stage reference.",
       check=_nonneg[0], allowed=_nonneg[1]),
    _f("weight_decay", "float", 0.0, "wd, L2 weight decay on v.", check=_nonneg[0], allowed=_nonneg[1]),
    _f("grad_clip", "float", None, "Element-wise clip of the model gradient to [-clip, clip]; null = off.",
       check=_pos[0], allowed=_pos[1], optional=True),
    _f("batch_size", "batch", 32, "B, local minibatch size; 0 or 'full' = full-batch gradients.",
       allowed=">= 0 or 'full'"),
    _f("iterations", "int", 2000, "t, total local steps per client.", check=_ge1[0], allowed=_ge1[1]),
    _f("positive_ratio", "float", None, "p in the objective; null = global positive ratio from client counts.",
       check=lambda v: 0 < v < 1, allowed="in (0, 1)", optional=True),
    # -- schedule -----------------------------------------------------------------
    _f("schedule", "str", "stagewise", "stagewise (decay every T0) or geometric (I_s grows by rho).",
       choices=("stagewise", "geometric")),
    _f("stage_length", "int", 1000, "T0, iterations per stage (stagewise).", check=_ge1[0], allowed=_ge1[1]),
    _f("lr_decay", "float", 3.0, "Divisor of lr at each stage end (stagewise).", check=_ge1[0], allowed=_ge1[1]),
    _f("reference_point", "str", "average", "Proximal centre of the next stage: average of the stage's "
       "round-end global iterates, or the last one.", choices=("average", "last")),
    _f("reset_control_variates", "bool", True, "Zero the control variates at each stage start."),
    _f("stage_growth", "float", 2.0, "rho, growth of I_s and shrink of lr per stage (geometric).",
       check=_ge1[0], allowed=_ge1[1]),
    _f("rounds_per_stage", "int", 10, "R, rounds per stage (geometric).", check=_ge1[0], allowed=_ge1[1]),
    # -- data ---------------------------------------------------------------------
    _f("dataset", "factory", "digits", "Dataset name, or your own factory module:attr called on each client as "
       "factory(client_id, num_clients, split) -> torch Dataset of (x, y) items, split 'train' or 'test' (None: "
       "no test split).", choices=DATASET_NAMES),
    _f("data_root", "str", None, "Folder of an on-disk dataset.", optional=True),
    _f("partition", "str", "ih", "How a labelled dataset is split over clients: ih (class-disjoint, "
       "the paper's) or dirichlet.", choices=("ih", "dirichlet")),
    _f("imratio", "float", 0.1, "Positive fraction kept on each client (IH and Dirichlet partitions).",
       check=lambda v: 0 < v <= 0.5, allowed="in (0, 0.5]"),
    _f("dirichlet_concentration", "float", 0.5, "Dirichlet concentration per class over clients "
       "(smaller = more heterogeneous).", check=_pos[0], allowed=_pos[1]),
    _f("positive_classes", "int_list", None, "Original classes labelled positive; null = dataset default.",
       optional=True),
    _f("test_fraction", "float", 0.3, "Held-out fraction for datasets without a test split (digits).",
       check=lambda v: 0 < v < 1, allowed="in (0, 1)"),
    _f("heterogeneity", "float", 1.0, "Synthetic data: spread of each client's class-centre shift.",
       check=_nonneg[0], allowed=_nonneg[1]),
    _f("num_features", "int", 20, "Synthetic data: feature dimension.", check=_ge1[0], allowed=_ge1[1]),
    _f("samples_per_client", "int", 500, "Synthetic data: training samples per client.",
       check=_ge1[0], allowed=_ge1[1]),
    # -- on-disk datasets (loaders) ----------------------------------------------
    _f("chestxray_sources", "str_list", CHESTXRAY_SOURCES, "chestxray: the organisations, in client order "
       "(a list, or names joined by commas).", choices=CHESTXRAY_SOURCES,
       check=lambda v: len(set(v)) == len(v), allowed="each source once"),
    _f("chestxray_chexpert_root", "str", None, "chestxray: folder with CheXpert's train.csv, valid.csv, train/.",
       optional=True),
    _f("chestxray_nih_root", "str", None, "chestxray: folder with NIH's Data_Entry_2017*.csv and images*/.",
       optional=True),
    _f("chestxray_padchest_root", "str", None, "chestxray: folder with PadChest's labels CSV and numbered "
       "image folders.", optional=True),
    _f("chestxray_mimic_root", "str", None, "chestxray: folder with MIMIC-CXR-JPG's mimic-cxr-2.0.0-*.csv.gz "
       "and files/.", optional=True),
    _f("chestxray_vindr_root", "str", None, "chestxray: folder with VinDr-CXR's image_labels_train.csv (or "
       "Kaggle train.csv) and train/ images as PNG/JPEG.", optional=True),
    _f("chestxray_clients", "str", "source", "chestxray: source = one client per organisation; patient = "
       "num_clients clients, each a patient group inside one organisation.", choices=("source", "patient")),
    _f("chestxray_clients_per_source", "int_list", None, "chestxray, clients=patient: clients per source in "
       "chestxray_sources order (sum = num_clients); null = as even as possible.", optional=True),
    _f("chestxray_test_fraction", "float", 0.05, "chestxray: fraction of each organisation's patients held out "
       "as its test split (fixed seed: the same patients for every run).",
       check=lambda v: 0 < v < 1, allowed="in (0, 1)"),
    _f("chestxray_test_split", "str", "holdout", "chestxray: holdout (by patient) or official (CheXpert "
       "valid.csv, MIMIC's test split, NIH test_list.txt; others fall back to holdout).",
       choices=("holdout", "official")),
    _f("chestxray_uncertain", "str_list", ("zeros", "ones", "zeros", "ones", "zeros"), "chestxray: uncertain "
       "(-1) labels per task (Cardiomegaly, Edema, Consolidation, Atelectasis, Pleural Effusion), or one for "
       "all: ones, zeros or ignore (missing).", choices=("ones", "zeros", "ignore"),
       check=lambda v: len(v) in (1, 5), allowed="1 or 5 policies"),
    _f("chestxray_blank", "str", "zeros", "chestxray: blank (not mentioned) labels: zeros (negative) or ignore "
       "(missing).", choices=("zeros", "ignore")),
    _f("chestxray_frontal_only", "bool", True, "chestxray: keep frontal (PA/AP) views only."),
    _f("download", "bool", False, "cifar10/cifar100: fetch the official archive into data_root when its files "
       "are missing (torchvision); off = read local files only."),
    _f("negative_classes", "int_list", None, "Original classes labelled negative; null = every class that is "
       "not positive (classes in neither list are left out).", optional=True),
    _f("image_size", "int", None, "Side of the square images a loader resizes to; null = the dataset's "
       "default (imagefolder 224, chestxray 320).", check=_ge1[0], allowed=_ge1[1], optional=True),
    _f("augment", "bool", False, "Random augmentation of training images (cifar: padded crop and flip; "
       "imagefolder: resized crop and flip; chestxray: the paper's random affine)."),
    _f("data_workers", "int_auto", 0, "DataLoader worker processes per client for datasets read from disk; auto = "
       "the CPUs Ray gave the client (the CPUs of this process inline) less one, at most 8.",
       check=_nonneg[0], allowed=">= 0 or 'auto'"),
    # -- model --------------------------------------------------------------------
    _f("model", "factory", "cnn", "Scoring network: a name, or your own factory module:attr called as "
       "factory(input_shape, num_tasks) -> nn.Module giving (B, T) logits, on the driver and every client.",
       choices=MODEL_NAMES),
    _f("model_width", "int", 32, "Width of mlp hidden layers / cnn channels; passed to your own model factory "
       "as width= if it has that parameter, else unused.", check=_ge1[0], allowed=_ge1[1]),
    # -- models: weights, pre-training ---------------------------------------------
    _f("model_weights", "str", None, "Local file of initial network weights (a state_dict saved with "
       "torch.save, or a run's model.pt); a classifier head of another size is re-initialised. Never "
       "downloaded.", optional=True),
    _f("pretrain_iterations", "int", 0, "Two-stage recipe: iterations of BCE pre-training (fedavg) before the "
       "AUC run, which keeps the pre-trained body and re-initialises the head; 0 = off.",
       check=_nonneg[0], allowed=_nonneg[1]),
    _f("pretrain_lr", "float", None, "Step size of pre-training; null = lr.", check=_pos[0], allowed=_pos[1],
       optional=True),
    _f("pretrain_batch_size", "batch", None, "Minibatch of pre-training; null = batch_size.",
       allowed=">= 0 or 'full'", optional=True),
    _f("pretrain_federated", "bool", True, "Pre-train on all clients (fedavg); false = on client 0's data "
       "alone (e.g. the first source)."),
    # -- run ----------------------------------------------------------------------
    _f("eval_batch_size", "int", 256, "Samples scored at once when evaluating (lower it for large images).",
       check=_ge1[0], allowed=_ge1[1]),
    _f("eval_every", "int", 100, "Evaluate the global model every this many iterations (at round ends).",
       check=_ge1[0], allowed=_ge1[1]),
    _f("seed", "int", 0, "Seed of model init, partitions and sampling.", check=_nonneg[0], allowed=_nonneg[1]),
    _f("executor", "str", "ray", "ray: every client a Ray actor, all in parallel; inline: every client in the "
       "driver process, one after another (debuggers work).", choices=("ray", "inline")),
    # -- ray executor --------------------------------------------------------------
    _f("address", "str", None, "Ray cluster to connect to (host:port, ray://host:port, auto; local = a private "
       "local Ray even when a `ray start` cluster runs on this machine); null = "
       "RAY_ADDRESS if set, else a `ray start` cluster of this machine, else start a local Ray (a Ray already "
       "running in this process is reused).",
       optional=True),
    _f("clients_per_actor", "int", 1, "M, clients each host runs one after another on one model replica (each "
       "keeps its own shard, control variate and sampler position; the host returns their updates folded into "
       "one partial sum); ceil(K / M) Ray actors; 1 = one actor per client.", check=_ge1[0], allowed=_ge1[1]),
    _f("cpus_per_actor", "float", 1.0, "CPUs Ray reserves for each actor (fractions allowed; cpus_per_client is "
       "read as this when clients_per_actor = 1); the actor runs max(1, int(this)) torch threads unless "
       "threads_per_actor says otherwise.", check=_pos[0], allowed=_pos[1]),
    _f("gpus_per_actor", "float", 0.0, "GPUs per actor (gpus_per_client is read as this when clients_per_actor = "
       "1); a fraction shares a GPU (0.25 = four actors per GPU); 0 = CPU only.",
       check=lambda v: v == 0 or 0 < v <= 1 or float(v).is_integer(),
       allowed="0, a fraction in (0, 1], or a whole number"),
    _f("placement_strategy", "str", "PACK", "How the clients' placement group spreads over nodes (Ray's "
       "strategies).", choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")),
    _f("client_resources", "resource_list", None, "Ray custom resources per client, one mapping per client in "
       "client order (e.g. [{site_0: 0.01}, {site_1: 0.01}]): client k's actor bundle asks for them, so it runs "
       "on a node that offers them; the clients of one actor must ask for the same; null = any node.",
       optional=True),
    _f("client_data_roots", "str_list", None, "A data folder per client, in client order: client k reads its "
       "training data (all of it) from its own folder only, on the node it runs on; data_root then holds the "
       "global test set; null = every client takes its part of data_root.", optional=True),
    _f("reduce", "str", "star", "ray executor: star (every actor's partial sum goes to the driver) or node (the "
       "actors on one node fold their partial sums into one on that node; the driver receives one per node).",
       choices=("star", "node")),
    _f("transport", "str", "classic", "ray executor: how a round reaches the actors and comes back: classic "
       "(one Ray call per actor, the state through the object store) or compiled (one Ray Compiled Graph built "
       "per federation: the state and the partial sums travel through pre-allocated shared-memory channels; "
       "rebuilt when an actor is replaced). Evaluation and set-up calls stay classic either way.",
       choices=("classic", "compiled")),
    _f("channel_wait", "str", "sleep", "transport=compiled: how the actors and the driver wait on the graph's "
       "channels: sleep (Ray's polling for the first 50 ms of a wait, then sleeps with pauses that grow with the "
       "wait: an idle graph costs almost no CPU, and a long wait ends at most a few percent later) or spin "
       "(Ray's polling throughout: every waiting actor keeps a core busy, also while the run scores or writes "
       "checkpoints).",
       choices=("sleep", "spin")),
    _f("placement_timeout_s", "float", 120.0, "Longest wait for lost actors' placement-group bundles to be "
       "placed again after a node is lost; then the run stops, naming the clients and resources that cannot be "
       "placed, with a checkpoint of the state the round started from (continue it with --resume).",
       check=_pos[0], allowed=_pos[1]),
    _f("gpu_memory_cap", "bool", True, "With a fractional gpus_per_actor, cap each actor's CUDA memory to "
       "that fraction of the GPU."),
    _f("fold_order", "str", "arrival", "ray executor: fold client updates as they arrive (arrival) or in client "
       "order (client: bit-for-bit repeatable runs, equal to the inline executor's; waits for late clients).",
       choices=("arrival", "client")),
    _f("eval_on", "str", "clients", "Where the global model is scored: clients (each actor scores a slice of "
       "the test set, in parallel) or driver.", choices=("clients", "driver")),
    _f("on_client_failure", "str", "retry", "A client actor that dies or raises: retry (replace it and re-run "
       "its call, at most max_client_retries times, then stop the run), drop (the same retries, then go on "
       "without it) or abort (stop at once).", choices=("retry", "drop", "abort")),
    _f("max_client_retries", "int", 2, "Replacements of one client within one call before on_client_failure "
       "gives up on it.", check=_nonneg[0], allowed=_nonneg[1]),
    _f("ray_timeout_s", "float", 1800.0, "Longest wait for any Ray call (a client's round, a placement group); "
       "a client that does not answer in time counts as failed.", check=_pos[0], allowed=_pos[1]),
    _f("deterministic", "bool", False, "Ask torch for deterministic kernels (GPU runs then repeat bit for bit, "
       "more slowly; CPU runs repeat exactly either way)."),
    _f("device", "str", "auto", "auto uses a GPU when one is visible.", choices=("auto", "cpu", "cuda")),
    _f("precision", "str", "fp32", "Arithmetic of the network's forward pass: fp32, or bf16/fp16 autocast (the "
       "objective, a, b, alpha, the parameters and every sum stay float32; fp16 scales the loss).",
       choices=("fp32", "bf16", "fp16")),
    _f("channels_last", "bool_auto", "auto", "Run convolutional networks in channels-last memory format; auto = "
       "on for conv nets on a GPU, off on the CPU.", allowed="true, false or 'auto'"),
    _f("threads_per_actor", "int", None, "torch intra-op threads per actor process (inline: of the driver; "
       "threads_per_client is read as this when clients_per_actor = 1); null = leave as is.",
       check=_ge1[0], allowed=_ge1[1], optional=True),
    _f("out_dir", "str", "runs", "Folder under which run folders are made."),
    _f("run_name", "str", None, "Run folder name; null = time stamp, algorithm and dataset.", optional=True),
    # -- outputs, progress, checkpoints --------------------------------------------
    _f("checkpoint_every", "int", 100, "Write a checkpoint every this many rounds (and at the end); 0 = only "
       "at the end.", check=_nonneg[0], allowed=_nonneg[1]),
    _f("tensorboard", "bool", True, "Write TensorBoard event files into the run folder (needs tensorboard)."),
    # -- experiment trackers -------------------------------------------------------
    _f("trackers", "str_list", (), "Experiment trackers that get the config, every evaluation and the final "
       "model: mlflow, wandb (a list, or names joined by commas; each needs its extra, pip install "
       "'fdam-ray[mlflow]'); empty = none.", choices=("mlflow", "wandb"),
       check=lambda v: len(set(v)) == len(v), allowed="each tracker once"),
    _f("tracker_project", "str", "fdam-ray", "MLflow experiment and W&B project the trackers log to."),
)

# Fields that may differ when a run is resumed (they change how it runs, not what it computes).
RESUME_MAY_CHANGE = {"iterations", "eval_every", "checkpoint_every", "tensorboard", "executor", "device",
                     "threads_per_actor", "out_dir", "address", "cpus_per_actor", "gpus_per_actor",
                     "clients_per_actor",
                     "placement_strategy", "gpu_memory_cap", "eval_on", "fold_order", "on_client_failure",
                     "max_client_retries", "ray_timeout_s", "data_workers", "eval_batch_size", "deterministic",
                     "trackers", "tracker_project", "channels_last", "transport", "channel_wait"}

FIELD_BY_NAME = {f.name: f for f in FIELDS}

# Sections of `fdam fields SECTION` (a field in none is still found by a word of its name or meaning).
SECTIONS: dict[str, tuple[str, ...]] = {
    "algorithm": ("algorithm", "objective", "margin", "num_clients", "clients_per_round", "client_weighting",
                  "local_steps", "lr", "global_lr", "prox_weight", "weight_decay", "grad_clip", "batch_size",
                  "iterations", "positive_ratio"),
    "schedule": ("schedule", "stage_length", "lr_decay", "reference_point", "reset_control_variates",
                 "stage_growth", "rounds_per_stage"),
    "data": ("dataset", "data_root", "partition", "imratio", "dirichlet_concentration", "positive_classes",
             "negative_classes", "test_fraction", "heterogeneity", "num_features", "samples_per_client", "download",
             "image_size", "augment", "data_workers"),
    "chestxray": tuple(f.name for f in FIELDS if f.name.startswith("chestxray_")),
    "model": ("model", "model_width", "model_weights", "pretrain_iterations", "pretrain_lr", "pretrain_batch_size",
              "pretrain_federated"),
    "run": ("eval_batch_size", "eval_every", "seed", "executor", "deterministic", "device", "threads_per_actor",
            "clients_per_actor", "precision", "channels_last"),
    "ray": ("address", "cpus_per_actor", "gpus_per_actor", "placement_strategy", "gpu_memory_cap", "fold_order",
            "eval_on", "on_client_failure", "max_client_retries", "ray_timeout_s", "reduce", "transport",
            "channel_wait",
            "client_resources", "client_data_roots", "placement_timeout_s"),
    "outputs": ("out_dir", "run_name", "checkpoint_every", "tensorboard", "trackers", "tracker_project"),
}

# Resource fields named per client before clients could share an actor: read as the per-actor field when each
# actor hosts one client (the same thing then), refused otherwise (the user must say what an actor gets).
RENAMED_PER_ACTOR = {"cpus_per_client": "cpus_per_actor", "gpus_per_client": "gpus_per_actor",
                     "threads_per_client": "threads_per_actor"}

# A "factory" field holds a string, except that in Python ``model`` may hold a factory that cannot be imported
# by name (a lambda, a local function, one of the __main__ script): it then travels to clients by value.
_TYPES: dict[str, Any] = {"int": int, "float": float, "bool": bool, "str": str, "factory": str, "batch": int,
                          "int_list": tuple[int, ...], "str_list": tuple[str, ...],
                          "resource_list": tuple[dict, ...], "int_auto": int | str, "bool_auto": bool | str}


def field_type(field: Field) -> Any:
    """The Python type of a field's validated value (``X | None`` for optional fields)."""
    kind = _TYPES[field.kind]
    return kind | None if field.optional or field.default is None else kind


Config = dataclasses.make_dataclass(
    "Config",
    [(f.name, field_type(f), dataclasses.field(default=f.default)) for f in FIELDS],
    frozen=True,
    namespace={
        "__doc__": "A validated run configuration; build it with :func:`build_config`.",
        "to_dict": lambda self: _plain(dataclasses.asdict(self)),
        "replace": lambda self, **changes: build_config({**dataclasses.asdict(self), **changes}),
    },
)
Config.__module__ = __name__  # picklable by reference (configs travel to Ray actors and Tune trials)


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """A config's values as data: a factory given in Python is recorded by its name (``python:module.name``)."""
    return {k: python_name(v) if callable(v) else v for k, v in values.items()}


class _Loader(yaml.SafeLoader):
    """YAML as people write config values: ``1e-3`` is a number, and a key given twice is an error.

    PyYAML follows YAML 1.1, where a float needs a dot (``1.0e-3``) and ``1e-3``
    is a string; YAML 1.2 and every programming language read it as a number.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                continue  # an unhashable key: PyYAML reports it
            if key in seen:
                raise DuplicateKeyError(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: Any, line: int) -> None:
        super().__init__(f"key '{key}' is given twice (again on line {line})")
        self.key, self.line = key, line


def load_yaml(text: str) -> Any:
    """Parse YAML text the way every fdam-ray file and ``key=value`` is read (see :class:`_Loader`)."""
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: plain data only


def read_yaml_file(path: str | Path, what: str) -> Any:
    """Read a YAML file; any problem (missing, not UTF-8, not YAML, a key given twice) is one
    :class:`ConfigError` naming ``what`` and the file."""
    from fdam_ray.locations import is_uri, read_uri_text

    try:
        text = read_uri_text(path) if is_uri(str(path)) else Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} '{path}' does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} '{path}' is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{what} '{path}' cannot be read: {exc.strerror or exc}") from None
    try:
        return load_yaml(text)
    except DuplicateKeyError as exc:
        raise ConfigError(f"{what} '{path}': {exc}") from None
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"{what} '{path}' is not valid YAML: {detail}") from None


def _fail(name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config field '{name}': {value!r} is not allowed ({allowed})")


class CommandLineText(str):
    """A value typed as ``key=value``: read as YAML for numbers, booleans and lists, kept as text for strings."""


def _from_text(field: Field, text: CommandLineText) -> Any:
    if text.strip() in ("", "null", "~", "None"):
        return None
    if field.kind == "str" or (field.kind == "str_list" and not text.lstrip().startswith("[")):
        return str(text)  # run_name=007 stays "007", data_root=2024 stays "2024"
    try:
        return load_yaml(text)
    except yaml.YAMLError:
        return str(text)


def _coerce(field: Field, value: Any) -> Any:
    if isinstance(value, CommandLineText):
        value = _from_text(field, value)
    if value is None:
        if field.optional:
            return None
        if field.default == ():  # a list that may be empty (trackers=)
            return ()
        raise _fail(field.name, value, f"a value is required; {field.allowed or field.kind}".rstrip("; "))
    kind = field.kind
    if kind == "factory":
        return _factory_value(field, value)
    if kind.endswith("_auto"):  # "auto", or a value of the plain kind
        if value == "auto":
            return value
        if isinstance(value, str):
            raise _fail(field.name, value, field.allowed)
        kind = kind.removesuffix("_auto")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise _fail(field.name, value, field.allowed or "true or false")
    if kind == "int":
        if isinstance(value, bool):
            raise _fail(field.name, value, "an integer")
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise _fail(field.name, value, "an integer" + (f" {field.allowed}" if field.allowed else ""))
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(field.name, value, "a number" + (f" {field.allowed}" if field.allowed else ""))
        value = float(value)
        if not math.isfinite(value):
            raise _fail(field.name, value, "a finite number")
    elif kind == "str":
        if not isinstance(value, str):
            choices = f", one of {', '.join(field.choices)}" if field.choices else ""
            raise _fail(field.name, value, "a string" + choices)
        if field.choices and value not in field.choices:
            hint = difflib.get_close_matches(value, field.choices, n=1)
            extra = f"; did you mean '{hint[0]}'?" if hint else ""
            raise _fail(field.name, value, f"one of {', '.join(field.choices)}{extra}")
        return value
    elif kind == "batch":
        if value == "full":
            return 0
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _fail(field.name, value, field.allowed)
        return value
    elif kind == "int_list":
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise _fail(field.name, value, "a list of integers")
        return tuple(value)
    elif kind == "str_list":
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        empty_ok = field.default == ()
        if (not isinstance(value, (list, tuple)) or not (value or empty_ok)
                or not all(isinstance(v, str) for v in value)):
            raise _fail(field.name, value, ("a list of names" if empty_ok else "a non-empty list of names")
                        + (f" from {', '.join(field.choices)}" if field.choices else ""))
        if field.choices and any(v not in field.choices for v in value):
            raise _fail(field.name, value, f"each one of {', '.join(field.choices)}")
        value = tuple(value)
    elif kind == "resource_list":
        what = "a list with one mapping of Ray resource name: amount (> 0) per client"
        if not isinstance(value, (list, tuple)) or not value:
            raise _fail(field.name, value, what)
        for k, entry in enumerate(value):
            if not isinstance(entry, Mapping) or not all(
                isinstance(r, str) and r and isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v) and v > 0 for r, v in entry.items()
            ):
                raise _fail(field.name, value, f"{what}; entry {k} ({entry!r}) is not")
            if any(r in ("CPU", "GPU", "memory", "object_store_memory") for r in entry):
                raise _fail(field.name, value, f"custom resources only; entry {k} names CPU/GPU/memory, which "
                            "cpus_per_actor / gpus_per_actor set")
        value = tuple(dict(entry) for entry in value)
    if field.check is not None and not field.check(value):
        raise _fail(field.name, value, field.allowed)
    return value


def _factory_value(field: Field, value: Any) -> Any:
    """A built-in name, an import path ``module:attr`` that resolves here to a callable, or (``model`` in Python)
    the factory itself, kept as its import path when it has one."""
    names = ", ".join(field.choices or ())
    if isinstance(value, str):
        if value in (field.choices or ()):
            return value
        if value.startswith(PYTHON_PREFIX):
            raise ConfigError(
                f"config field '{field.name}': {value!r} is a factory that was given in Python and cannot be "
                f"imported by name; give the callable again (fdam_ray.train(config, {field.name}=...), "
                f"fdam_ray.resume(run_dir, {field.name}=...)) or an import path module:attr")
        if is_import_path(value):
            try:
                resolve(value, field=f"config field '{field.name}'")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            return value
        hint = difflib.get_close_matches(value, field.choices or (), n=1)
        extra = f"; did you mean '{hint[0]}'?" if hint else ""
        raise _fail(field.name, value, f"one of {names}, or your own factory as an import path module:attr{extra}")
    if callable(value) and field.name == "model":
        return import_path_of(value) or value
    raise _fail(field.name, value, f"one of {names}, or an import path module:attr"
                + (", or in Python the factory itself" if field.name == "model" else ""))


def _flatten_sections(values: Mapping[str, Any]) -> dict[str, Any]:
    """Sections to flat names: ``model: {name: cnn, weights: W}`` or ``model.weights=W`` -> ``model_weights``.

    A section's ``name`` key sets the field named like the section (``model``).
    """
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            for sub, v in value.items():
                out[key if sub == "name" else f"{key}_{sub}"] = v
        elif "." in key:
            section, _, sub = key.partition(".")
            out[section if sub == "name" else f"{section}_{sub}"] = value
        else:
            out[key] = value
    return out


# Names people reach for, and the paper's symbols, mapped to the field they mean (only for suggestions).
_OTHER_NAMES = {
    "learning_rate": "lr", "eta": "lr", "eta_l": "lr", "local_lr": "lr", "global_learning_rate": "global_lr",
    "server_lr": "global_lr", "eta_g": "global_lr", "gamma": "prox_weight", "clients": "num_clients",
    "n_clients": "num_clients", "k": "num_clients", "i": "local_steps", "local_iterations": "local_steps",
    "t0": "stage_length", "imbalance_ratio": "imratio", "p": "positive_ratio", "batchsize": "batch_size",
    "steps": "iterations", "total_iterations": "iterations", "decay": "lr_decay",
}


def nearest_field(key: str) -> str | None:
    """The field an unknown key most likely means (a near spelling of a field or of a common other name)."""
    lowered = key.lower()
    if lowered in _OTHER_NAMES:
        return _OTHER_NAMES[lowered]
    hint = difflib.get_close_matches(lowered, [*FIELD_BY_NAME, *_OTHER_NAMES], n=1)
    return None if not hint else _OTHER_NAMES.get(hint[0], hint[0])


def _check_per_client(merged: dict[str, Any]) -> None:
    """client_resources / client_data_roots: one entry per client; one actor's clients ask for the same resources."""
    k = merged["num_clients"]
    for name in ("client_resources", "client_data_roots"):
        value = merged[name]
        if value is not None and len(value) != k:
            raise _fail(name, value, f"one entry per client: {k} (num_clients), not {len(value)}")
    resources, m = merged["client_resources"], merged["clients_per_actor"]
    if resources is not None and m > 1:
        for first in range(0, k, m):
            for j in range(first + 1, min(first + m, k)):
                if resources[j] != resources[first]:
                    raise _fail("client_resources", resources,
                                f"the same resources for the clients of one actor (clients_per_actor={m}): client "
                                f"{j} asks for {resources[j]}, client {first} (same actor) for {resources[first]}")
    if merged["client_data_roots"] is not None and merged["dataset"] in ("arrays", "datasets", "chestxray"):
        raise _fail("client_data_roots", merged["client_data_roots"],
                    f"per-client folders of a dataset read from data_root; dataset={merged['dataset']} "
                    + ("has per-source roots (chestxray_*_root)" if merged["dataset"] == "chestxray"
                       else "takes its data in memory"))


def build_config(values: Mapping[str, Any] | None = None, **overrides: Any) -> Config:
    """Make a validated :class:`Config` from a mapping (and keyword overrides).

    Fields the user does not set take the algorithm preset's default, then the
    field's own default. Nested sections are accepted and flattened (see
    :func:`_flatten_sections`). Raises :class:`ConfigError` on the first bad value.
    """
    given = _flatten_sections(values or {})
    given.update(_flatten_sections(overrides))
    given = _read_renamed(given)
    for key in given:
        if key not in FIELD_BY_NAME:
            hint = nearest_field(key)
            extra = f"; did you mean '{hint}'?" if hint else ""
            raise ConfigError(f"unknown config field '{key}'{extra} (see `fdam fields` for the list)")
    algorithm = _coerce(FIELD_BY_NAME["algorithm"], given.get("algorithm", "codasca"))
    preset = PRESETS[algorithm]
    merged: dict[str, Any] = {}
    for field in FIELDS:
        if field.name in given:
            merged[field.name] = _coerce(field, given[field.name])
        elif field.name in preset.defaults:
            merged[field.name] = _coerce(field, preset.defaults[field.name])
        else:
            merged[field.name] = field.default if field.default is None else _coerce(field, field.default)
    for name, value in preset.fixed.items():
        if name in given and merged[name] != value:
            raise _fail(name, merged[name], f"algorithm '{algorithm}' requires {name} = {value!r}")
        merged[name] = value
    if merged["objective"] not in preset.objectives:
        raise _fail("objective", merged["objective"],
                    f"algorithm '{algorithm}' takes one of {', '.join(preset.objectives)}")
    if merged["clients_per_round"] is not None and merged["clients_per_round"] > merged["num_clients"]:
        raise _fail("clients_per_round", merged["clients_per_round"],
                    f"at most num_clients = {merged['num_clients']}, or null for all")
    _check_per_client(merged)
    config = Config(**merged)
    _check_schedule_reach(config)
    return config


def _read_renamed(given: dict[str, Any]) -> dict[str, Any]:
    """``cpus_per_client`` & co. as ``cpus_per_actor`` & co. when every actor hosts one client; else an error."""
    old = [k for k in RENAMED_PER_ACTOR if k in given]
    if not old:
        return given
    m = _coerce(FIELD_BY_NAME["clients_per_actor"], given.get("clients_per_actor", 1))
    out = dict(given)
    for key in old:
        new = RENAMED_PER_ACTOR[key]
        if new in given:
            raise ConfigError(f"config fields '{key}' and '{new}' are both given; '{key}' is the old name of "
                              f"'{new}': give '{new}' only")
        if m != 1:
            raise ConfigError(f"config field '{key}' is now '{new}' (resources are reserved per actor, and "
                              f"clients_per_actor = {m} clients share one): set '{new}' instead")
        # coerced under the name the user gave, so an error names it
        out[new] = _coerce(dataclasses.replace(FIELD_BY_NAME[new], name=key), out.pop(key))
    return out


def _check_schedule_reach(config: Config) -> None:
    stage, lr = last_stage(ScheduleSection.of(config))
    if lr >= MIN_LR:
        return
    if config.schedule == "stagewise":
        knobs = (f"lr={config.lr:g}, lr_decay={config.lr_decay:g}, stage_length={config.stage_length}, "
                 f"iterations={config.iterations}")
        fix = "raise stage_length, or lower lr_decay or iterations"
    else:
        knobs = (f"lr={config.lr:g}, stage_growth={config.stage_growth:g}, rounds_per_stage="
                 f"{config.rounds_per_stage}, local_steps={config.local_steps}, iterations={config.iterations}")
        fix = "raise rounds_per_stage, or lower stage_growth or iterations"
    raise ConfigError(f"config: the schedule ({knobs}) runs {stage} stages and decays lr to {lr:.1e}, below "
                      f"{MIN_LR:g} where float32 steps no longer move the model; {fix}")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["lr=0.1", "run_name=007"]`` -> ``{"lr": "0.1", "run_name": "007"}`` as :class:`CommandLineText`;
    :func:`build_config` reads each by its field's type (``lr`` -> 0.1, ``run_name`` -> "007")."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        out[key.strip()] = CommandLineText(raw)
    return out


def typed_value(key: str, value: Any) -> Any:
    """A command-line value as the field ``key`` reads it (plain YAML for names that are not fields)."""
    field = FIELD_BY_NAME.get(_flatten_sections({key: None}).popitem()[0])
    if isinstance(value, CommandLineText) and field is not None:
        return _from_text(field, value)
    return read_text_value(value)


def read_text_value(value: Any) -> Any:
    """A command-line value read as YAML (for settings that are not config fields, such as tune options)."""
    if isinstance(value, CommandLineText):
        try:
            return load_yaml(value) if value.strip() else None
        except yaml.YAMLError:
            return str(value)
    return value


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML config file into a mapping (validated later by :func:`build_config`)."""
    data = read_yaml_file(path, "config file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of field: value, not {type(data).__name__}")
    return data


def select_fields(terms: list[str] | tuple[str, ...] = ()) -> list[Field]:
    """The fields ``fdam fields TERM ...`` lists: for each term (case-insensitive), the fields of the section it
    names (:data:`SECTIONS`), else those with the term in their name or starting a word of their meaning; with
    several terms, the fields every term selects."""
    chosen = list(FIELDS)
    for term in terms:
        word = term.lower().strip()
        if word in SECTIONS:
            names = set(SECTIONS[word])
            chosen = [f for f in chosen if f.name in names]
            continue
        pattern = re.compile(rf"(?<![\w-]){re.escape(word)}", re.IGNORECASE)
        chosen = [f for f in chosen if word in f.name.lower() or pattern.search(f.doc)]
    return chosen


def describe_fields(terms: list[str] | tuple[str, ...] = ()) -> str:
    """A plain-text table of every field (or those ``terms`` select), its default and its meaning (for `fdam
    fields`); a term that selects nothing is a :class:`ConfigError` naming the sections."""
    fields = select_fields(terms)
    if not fields:
        raise ConfigError(f"no config field matches {' '.join(terms)!r}; give a section ({', '.join(SECTIONS)}) "
                          "or a word of a field's name or meaning, or nothing for every field")
    rows = []
    for f in fields:
        allowed = ", ".join(f.choices) if f.choices else f.allowed
        if f.kind == "factory":
            allowed += ", or module:attr"
        rows.append(f"{f.name:<24} {f.default!s:<10} {f.doc}" + (f" [{allowed}]" if allowed else ""))
    return "\n".join(rows)
