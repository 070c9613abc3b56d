"""Your own network and your own Dataset factory, federated with CODASCA.

Four "sites" each hold part of scikit-learn's bundled handwritten digits
(8x8 images, no download); the task is to score the digit 0 against the rest,
so about 10% of the samples are positive. Each site builds its own
``torch.utils.data.Dataset`` where its client runs (under Ray on its own actor:
the driver never reads a site's samples), and every client trains the small
network built by ``build_model``.

Run it::

    python examples/own_model_and_data.py            # Ray, 4 clients, 600 iterations (about a minute)
    python examples/own_model_and_data.py --quick    # in this process, a few iterations (a smoke test)

The same run from the command line names both factories by import path; every
process that runs a client must be able to import this file, here through
``PYTHONPATH`` (on a cluster: install it, or ship it with Ray's
``runtime_env={"working_dir": ...}``)::

    PYTHONPATH=examples fdam train dataset=own_model_and_data:client_dataset \\
        model=own_model_and_data:build_model num_clients=4 iterations=600 batch_size=32 lr=0.1

The rules (README, "Your own model and data"): a model factory is called as
``factory(input_shape, num_tasks)`` (and ``width=model_width`` when it has a
``width`` parameter) and returns an ``nn.Module`` giving (B, T) logits; a
dataset factory is called as ``factory(client_id, num_clients, split)`` with
``split`` "train" or "test" and returns a Dataset of ``(x, y)`` items, ``y`` 0,
1 or NaN (missing), or None when a client has no test split.
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np
import torch
from torch import nn

import fdam_ray


def build_model(input_shape: tuple[int, ...], num_tasks: int, width: int = 16) -> nn.Module:
    """A small convolutional network with BatchNorm for (1, 8, 8) images: (B, T) logits."""
    channels = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_tasks),
    )


class DigitImages(torch.utils.data.Dataset):
    """One site's digits as (1, 8, 8) float images in [0, 1], labelled 1 for the digit 0 and 0 otherwise."""

    def __init__(self, images: np.ndarray, digits: np.ndarray) -> None:
        self.images = torch.from_numpy(images.reshape(-1, 1, 8, 8) / 16.0).float()
        self.labels = torch.from_numpy((digits == 0).astype(np.float32))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def client_dataset(client_id: int, num_clients: int, split: str) -> DigitImages:
    """Site ``client_id``'s train or test split: a fixed shuffle of the digits cut into ``num_clients`` parts,
    each part's last quarter held out for testing. Called where the site's client runs."""
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    part = np.array_split(order, num_clients)[client_id]
    cut = len(part) * 3 // 4
    rows = part[:cut] if split == "train" else part[cut:]
    return DigitImages(data.data[rows], data.target[rows])


def main(argv: list[str] | None = None) -> fdam_ray.RunResult:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few iterations in this process (a smoke test)")
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args(argv)
    config = {"algorithm": "codasca", "num_clients": args.clients, "batch_size": 32, "lr": 0.1, "local_steps": 10,
              "iterations": 600, "stage_length": 300, "eval_every": 100, "cpus_per_actor": 0.5}
    if args.quick:
        config.update(executor="inline", iterations=20, stage_length=20, local_steps=5, eval_every=10)
        del config["cpus_per_actor"]  # a Ray field: inline runs the clients in this process
    k = args.clients
    # Each entry is a picklable callable: the client's own process builds its Dataset.
    clients = [functools.partial(client_dataset, c, k, "train") for c in range(k)]
    tests = [functools.partial(client_dataset, c, k, "test") for c in range(k)]
    result = fdam_ray.train_datasets(config, clients, None, client_tests=tests, model=build_model)
    last = result.history[-1]
    print(f"pooled test AUC {last['test_auc']:.4f} after {last['iteration']} iterations; per site: "
          + ", ".join(f"{site} {auc:.3f}" for site, auc in last["client_auc"].items()))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
