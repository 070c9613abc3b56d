"""transfer_precision bf16/fp16 without Ray: the rounding, the masters, error feedback, bytes and resume.

The oracle rounds with torch (round to nearest, ties to even) and is written here apart from
fdam_ray.executors.transfer: it wraps an fp32 inline executor, keeps its own master, and rounds each round's
change of the global state and each client's difference from that master.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from sample_clients import gaussian_clients

import fdam_ray
from fdam_ray.algorithms.server import PartialSum
from fdam_ray.assembly.recipe import federate, resume
from fdam_ray.checkpoint import load_checkpoint
from fdam_ray.config import ConfigError, build_config
from fdam_ray.core.state import GlobalState, StepStats
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.inline import InlineExecutor
from fdam_ray.executors.transfer import Downlink, Receiver, compress, decode, encode, expand

TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16}
FLOATS = ("v", "alpha", "buffers", "c_v", "c_alpha")
BASE = dict(model="linear", batch_size="full", eval_every=4, seed=0, lr=0.3, executor="inline", algorithm="codasca",
            local_steps=2, iterations=16, stage_length=8, global_lr=1.1)


def torch_round(x: np.ndarray, precision: str) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(TORCH[precision]).float().numpy()


def numpy_round(x: np.ndarray, precision: str) -> np.ndarray:
    """Round to nearest, ties to even, written out on the bit patterns (bf16), or numpy's own cast (fp16)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if precision == "fp16":
        return x.astype(np.float16).astype(np.float32)
    u = x.view(np.uint32)
    kept = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    return (kept << np.uint32(16)).view(np.float32)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_encoding_rounds_as_torch_does_ties_to_even(precision):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-6, 4, 10000),
                        np.float32([0.0, -0.0, 1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11])])
    bits = encode(x, precision)
    assert bits.dtype == np.uint16 and bits.nbytes == x.size * 2
    np.testing.assert_array_equal(decode(bits, precision), numpy_round(x, precision))
    np.testing.assert_array_equal(decode(bits, precision), torch_round(x, precision))
    half = {"bf16": 2**-8, "fp16": 2**-11}[precision]  # ties: to the even neighbour
    ties = decode(encode(np.float32([1 + half, 1 + 3 * half, -(1 + half)]), precision), precision)
    np.testing.assert_array_equal(ties, np.float32([1.0, 1 + 4 * half, -1.0]))


class RoundingOracle(InlineExecutor):
    """An fp32 inline executor whose transfers the test rounds itself (torch's rounding, its own master)."""

    def __init__(self, precision: str) -> None:
        super().__init__()
        self.precision = precision
        self.master: GlobalState | None = None

    def run_round(self, state, plan, fold, clients=None):
        if self.master is None:
            self.master = copy.deepcopy(state)
        else:
            for name in FLOATS:
                if getattr(state, name) is not None:
                    m = getattr(self.master, name)
                    m += torch_round(getattr(state, name) - m, self.precision)
            self.master.counters = state.counters.copy()
        master = self.master

        def rounded(partial: PartialSum) -> None:
            assert partial.weight == 1.0  # one client per host, uniform weights
            for name in FLOATS:
                total = getattr(partial, name)
                if total is None:
                    continue
                ref = 0.0 if plan.partial and name.startswith("c_") else getattr(master, name)
                total[...] = torch_round(total - ref, self.precision) + ref
            fold(partial)

        super().run_round(master, plan, rounded, clients)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_rounded_run_equals_the_oracle_of_rounded_differences(precision, sampled):
    clients, test = gaussian_clients()
    cfg = dict(BASE, **({"clients_per_round": 2} if sampled else {}))
    got = fdam_ray.train_arrays(dict(cfg, transfer_precision=precision), clients, test)
    config = build_config(dict(cfg, dataset="arrays", num_clients=len(clients)))
    want = federate(config, source=ArraysSource(clients, test), executor=RoundingOracle(precision), save=False)
    exact = fdam_ray.train_arrays(cfg, clients, test)
    for name in ("v", "alpha", "c_v", "c_alpha"):
        np.testing.assert_allclose(getattr(got.state, name), getattr(want.state, name), rtol=0, atol=1e-6)
    assert np.abs(got.state.v - exact.state.v).max() > 1e-6  # the rounding really changed the run


def test_fp32_is_the_run_without_the_field_bit_for_bit():
    clients, test = gaussian_clients()
    plain = fdam_ray.train_arrays(BASE, clients, test)
    fp32 = fdam_ray.train_arrays(dict(BASE, transfer_precision="fp32"), clients, test)
    for name in FLOATS:
        np.testing.assert_array_equal(getattr(fp32.state, name), getattr(plain.state, name))
    assert (fp32.summary["bytes_up"], fp32.summary["bytes_down"]) == (plain.summary["bytes_up"],
                                                                        plain.summary["bytes_down"])


def test_bytes_count_two_bytes_a_value():
    clients, test = gaussian_clients()
    fp32 = fdam_ray.train_arrays(BASE, clients, test)
    bf16 = fdam_ray.train_arrays(dict(BASE, transfer_precision="bf16"), clients, test)
    assert bf16.summary["bytes_up"] * 2 == fp32.summary["bytes_up"]
    rounds, k, state_bytes = 8, len(clients), fp32.state.nbytes
    # every broadcast but the first (the full master) is half the state; stage references stay float32
    assert fp32.summary["bytes_down"] - bf16.summary["bytes_down"] == (rounds - 1) * k * state_bytes // 2


def stats() -> list[StepStats]:
    return [StepStats(0, 0.0, 1, 1, 0.0)]


def test_error_feedback_carries_the_residual():
    """Up and down: the sum of what was decoded plus the last residual is the sum of the true differences."""
    rng = np.random.default_rng(1)
    master = GlobalState(v=np.zeros(1000, np.float32), alpha=np.zeros(1, np.float32),
                         buffers=np.zeros(0, np.float32), counters=np.zeros(0, np.int64))
    residual: dict = {}
    true_sum, decoded_sum = np.zeros(1000), np.zeros(1000)
    for _ in range(20):
        d = (rng.standard_normal(1000) * 1e-3).astype(np.float32)
        partial = PartialSum(v=master.v + d, alpha=np.zeros(1, np.float32), buffers=np.zeros(0, np.float32),
                             counters=np.zeros(0, np.int64), weight=1.0, count=1, stats=stats())
        sent = compress(partial, master, "bf16", sampled=False, residual=residual)
        true_sum += d
        decoded_sum += expand(sent, master, sampled=False).v - master.v
    np.testing.assert_allclose(decoded_sum + residual["v"], true_sum, atol=1e-8)
    assert np.abs(residual["v"]).max() > 0

    # the broadcast: the server builds the next state from the master the round ran from, so each change is
    # taken from the master; the master plus the residual is where the true changes lead
    downlink, true_state = Downlink("bf16", error_feedback=True), copy.deepcopy(master)
    downlink.send(true_state)
    for _ in range(50):
        change = (rng.standard_normal(1000) * 1e-2).astype(np.float32)
        held = downlink.master
        downlink.send(dataclasses.replace(held, v=held.v + change))
        true_state.v = true_state.v + change
    np.testing.assert_allclose(downlink.master.v + downlink.residual["v"], true_state.v, atol=1e-5)
    assert np.abs(downlink.residual["v"]).max() > 0


def test_every_receiver_holds_the_drivers_master_to_the_bit():
    rng = np.random.default_rng(2)
    state = GlobalState(v=rng.standard_normal(500).astype(np.float32), alpha=np.ones(1, np.float32),
                        buffers=rng.standard_normal(7).astype(np.float32), counters=np.arange(2))
    downlink, early, late = Downlink("fp16", error_feedback=False), Receiver(), Receiver()
    for r in range(6):
        state.v = state.v + (rng.standard_normal(500) * 0.01).astype(np.float32)
        message, master = downlink.send(state)
        message.full = copy.deepcopy(master)
        early.receive(message)
        if r >= 3:  # a replacement that joins late gets the full master once, then the changes
            late.receive(message)
        for name in ("v", "alpha", "buffers", "counters"):
            np.testing.assert_array_equal(getattr(early.master, name), getattr(downlink.master, name))
            if r >= 3:
                np.testing.assert_array_equal(getattr(late.master, name), getattr(downlink.master, name))
    assert not np.array_equal(downlink.master.v, state.v)  # the masters are the rounded state


def test_resume_with_error_feedback_is_exact(tmp_path):
    clients, test = gaussian_clients()
    source = ArraysSource(clients, test)
    values = dict(BASE, dataset="arrays", num_clients=len(clients), transfer_precision="bf16", error_feedback=True,
                  out_dir=str(tmp_path), checkpoint_every=1)
    whole = federate(build_config(dict(values, run_name="whole")), source=source, save=True)
    half = federate(build_config(dict(values, run_name="cut", iterations=8)), source=source, save=True)
    recorded = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert recorded.loop.transfer["residual"] and recorded.clients[0]["transfer_residual"]
    resumed = resume(tmp_path / "cut", {"iterations": 16}, source=source)
    assert half.state.round == 4 and resumed.state.round == whole.state.round == 8
    for name in FLOATS:
        np.testing.assert_array_equal(getattr(resumed.state, name), getattr(whole.state, name), err_msg=name)


@pytest.mark.parametrize(("values", "field"), [
    (dict(transfer_precision="int8"), "transfer_precision"),
    (dict(error_feedback=True), "error_feedback"),
    (dict(transfer_precision="bf16", transport="compiled"), "transfer_precision"),
])
def test_bad_values_are_one_line_errors(values, field):
    with pytest.raises(ConfigError) as err:
        build_config(values)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_decoding_read_only_bits_warns_nothing():
    """Bits fetched from Ray's object store are read-only; torch warns (once a process) on such arrays."""
    import subprocess
    import sys

    script = ("import numpy as np; from fdam_ray.executors.transfer import encode, decode\n"
              "for p in ('bf16', 'fp16'):\n"
              "    x = np.linspace(-2, 2, 11, dtype=np.float32); x.flags.writeable = False\n"
              "    bits = encode(x, p); bits.flags.writeable = False\n"
              "    assert np.allclose(decode(bits, p), np.linspace(-2, 2, 11), atol=0.02)\n")
    out = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Warning" not in out.stderr, out.stderr[-2000:]
