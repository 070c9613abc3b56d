"""A user's own model factories and dataset factories, importable by the driver and (PYTHONPATH) by Ray workers.

``ON_DRIVER`` is False wherever this module is freshly imported (every Ray worker); a test sets it to True in
its own process so that the data factories refuse to run there: a run that succeeds then read no client data
in the driver process.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from torch import nn

from fdam_ray.models import linear

ON_DRIVER = False
NUM_TASKS = 2
NOT_CALLABLE = 3


# -- models ---------------------------------------------------------------------------------------
def same_as_linear(input_shape, num_tasks):
    """The built-in ``linear`` network, built by a factory of one's own."""
    return linear(input_shape, num_tasks, 0)


def bn_net(input_shape, num_tasks, width):
    """A hidden layer with BatchNorm (float buffers and an integer counter), as wide as ``model_width``."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.BatchNorm1d(width), nn.ReLU(),
                         nn.Linear(width, num_tasks))


class _Squeezed(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, 1)

    def forward(self, x):
        return self.fc(x.flatten(1)).squeeze(-1)


def one_dim_logits(input_shape, num_tasks):
    """(B,) logits: accepted for one task."""
    return _Squeezed(math.prod(input_shape))


def wrong_logits(input_shape, num_tasks):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_tasks + 1))


def not_a_module(input_shape, num_tasks):
    return {"weight": torch.zeros(num_tasks)}


def frozen(input_shape, num_tasks):
    net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 4), nn.Linear(4, num_tasks))
    net[1].weight.requires_grad_(False)
    return net


class _Masked(nn.Module):
    def __init__(self, features: int, num_tasks: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, num_tasks)
        self.register_buffer("mask", torch.ones(features, dtype=torch.bool))

    def forward(self, x):
        return self.fc(x.flatten(1) * self.mask)


def bool_buffer(input_shape, num_tasks):
    return _Masked(math.prod(input_shape), num_tasks)


def two_args_only(input_shape):
    return nn.Linear(math.prod(input_shape), 1)


def wrong_kwargs(input_shape, num_tasks):
    """A factory that calls torch with a keyword it does not take (a TypeError in the user's own code)."""
    return nn.Linear(math.prod(input_shape), num_tasks, hidden=4)


def missing_key(input_shape, num_tasks):
    """A factory that looks up a setting that is not there (a KeyError in the user's own code)."""
    return {"linear": nn.Linear}["mlp"](math.prod(input_shape), num_tasks)


class _NanForward(nn.Module):
    def __init__(self, features: int, num_tasks: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, num_tasks)

    def forward(self, x):
        return torch.log(self.fc(x.flatten(1)) - 1e6)  # log of a negative: NaN, with finite weights


def nan_outputs(input_shape, num_tasks):
    return _NanForward(math.prod(input_shape), num_tasks)


class _Embedded(nn.Module):
    """Integer features as token ids: an embedding, mean-pooled, then a linear head."""

    def __init__(self, tokens: int, num_tasks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(tokens, 4)
        self.fc = nn.Linear(4, num_tasks)

    def forward(self, x):
        return self.fc(self.embed(x).mean(1))


def token_model(input_shape, num_tasks):
    return _Embedded(10, num_tasks)


# -- data -----------------------------------------------------------------------------------------
def client_arrays(client_id: int, num_clients: int, split: str, num_tasks: int = NUM_TASKS):
    """Client ``client_id``'s samples (x float32 (n, 6), y (n, T) of 0, 1 and some NaN), shifted per client."""
    rng = np.random.default_rng([11, client_id, num_clients, split == "test"])
    n = 30 if split == "train" else 20
    y = (rng.random((n, num_tasks)) < 0.3 + 0.1 * client_id).astype(np.float32)
    y[0] = 1.0
    y[1] = 0.0  # every task has both classes on every client
    y[rng.random((n, num_tasks)) < 0.1] = np.nan
    y[:2] = np.nan_to_num(y[:2], nan=0.0)
    directions = np.random.default_rng(11).standard_normal((num_tasks, 6))  # the same on every client
    signal = 1.5 * np.nan_to_num(y, nan=0.5) @ directions
    x = (signal + rng.standard_normal((n, 6)) + 0.5 * client_id).astype(np.float32)
    return x, (y[:, 0] if num_tasks == 1 else y)


class PairDataset(torch.utils.data.Dataset):
    """Items ``(x_i, y_i)`` as numpy arrays; remembers the process that built it."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y
        self.pid = os.getpid()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def client_dataset(client_id: int, num_clients: int, split: str):
    """``dataset: own_fixtures:client_dataset``: each client's train and test split, built where it runs."""
    if ON_DRIVER:
        raise RuntimeError(f"client {client_id}'s data was read in the driver process")
    return PairDataset(*client_arrays(client_id, num_clients, split))


def odd_clients_without_test(client_id: int, num_clients: int, split: str):
    """One task; clients 1, 3, ... have no test split."""
    if split == "test" and client_id % 2:
        return None
    return PairDataset(*client_arrays(client_id, num_clients, split, num_tasks=1))


def train_only(client_id: int, num_clients: int, split: str):
    return None if split == "test" else PairDataset(*client_arrays(client_id, num_clients, split))
