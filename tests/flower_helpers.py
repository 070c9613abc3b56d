"""What the Flower tests share: three sites' data (with a global test set), and an in-process grid that keeps
every message type it sent and every reply that reached the server. Importable without Flower (the grid is then
a plain object and the tests that use it are skipped)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # before flwr is imported: nothing leaves 127.0.0.0/8
HAVE_FLOWER = importlib.util.find_spec("flwr") is not None
if HAVE_FLOWER:
    from fdam_ray.flower.inprocess import InProcessGrid as _Grid
else:
    _Grid = object  # type: ignore[assignment,misc]


def three_sites():
    """Three sites of 30, 50 and 40 samples whose features are shifted apart, and a test set of 60."""
    rng = np.random.default_rng(0)

    def site(n, shift):
        x = rng.normal(size=(n, 4)).astype(np.float32) + shift
        y = (x[:, 0] + 0.5 * rng.normal(size=n) > shift).astype(np.float32)
        return x, y

    return [site(30, 0.0), site(50, 0.3), site(40, -0.2)], site(60, 0.0)


def write_three_sites(folder):
    """The three sites' data and the test set, as arrays and as the .npz files the sites and the server read."""
    clients, test = three_sites()
    for k, (x, y) in enumerate(clients):
        np.savez(folder / f"site{k}.npz", x=x, y=y)
    np.savez(folder / "test.npz", x=test[0], y=test[1])
    return clients, test, folder


class RecordingGrid(_Grid):
    """Keeps every message type sent and every reply that reached the server."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent, self.replies = [], []

    def push_messages(self, messages):
        messages = list(messages)
        self.sent += [m.metadata.message_type for m in messages]
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        got = list(super().pull_messages(message_ids))
        self.replies += got
        return got
