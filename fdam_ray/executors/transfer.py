"""What crosses the object store: float32 states, or differences rounded to 16 bits (``transfer_precision``).

With ``transfer_precision: bf16`` or ``fp16`` the driver and every client keep
float32 master states and send each other only rounded differences:

- down: the driver keeps a copy M of the state the clients hold. A round's
  broadcast is q = round(G - M (+ e)), the change of the global state G since
  the last broadcast; the driver and every client apply M <- M + decode(q) with
  the same float32 addition, so they hold the same M to the bit, and the round
  runs from M. The first broadcast, and any to a client without the previous
  master (a replacement actor, a resumed run), is M in full float32.
- up: a host (an actor, or a group of the inline executor) folds its clients'
  updates into a partial sum as before, subtracts W M (W its clients' total
  weight; the control variates' changes of a sampled round are differences
  already) and sends q = round(S - W M (+ e)); the driver adds W M back to
  decode(q) before folding. A per-node reducer adds decoded differences and
  rounds its sum once more for its trip to the driver.
- error feedback (``error_feedback: true``): e, the rounding's residual
  d - decode(round(d)), is added to the next difference, so the sum of what
  was decoded plus the last residual is the sum of the true differences. The
  upload residual is host state (checkpointed with the host's first client);
  the broadcast's is the driver's (checkpointed with the loop state). The
  server step starts from the driver's exact G, not from M (docs/algorithms.md
  s.8 R4); where the new G is built from the clients' results alone (eta_g = 1
  in a round every client ran) it is built from M, so what a rounding of G - M
  left out is not in the next G - M, and the broadcast's residual carries it.

Rounding is round to nearest, ties to even (torch's and numpy's float32 ->
bf16/fp16 conversion); integer buffers (num_batches_tracked) travel as they are.
``fp32`` (the default) takes none of these paths: a run is as without this module.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.core.state import ClientState, GlobalState, Rule, StepStats, reads_store_arrays, vector_fields
from fdam_ray.features.capabilities import no_16bit
from fdam_ray.settings.sections import Section, fail, setting, shared

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferSection(Section):
    """The config fields that set what crosses the object store between the driver and the clients."""

    name = "transfer"

    transfer_precision: str = setting(
        "fp32", "What crosses between driver and clients: fp32 states, or their differences rounded to bf16/fp16 "
        "(2 bytes a value; driver and clients keep float32 master states).", choices=PRECISIONS)
    error_feedback: bool = setting(
        False, "transfer_precision bf16/fp16: add each client host's rounding residual to its next upload "
        "and the driver's to its next broadcast (both checkpointed).")
    executor: str = shared()
    transport: str = shared()

    def check(self) -> None:
        if self.error_feedback and self.transfer_precision == "fp32":
            raise fail("error_feedback", True, "true only with transfer_precision bf16 or fp16")
        refused = no_16bit(self.transport) if self.executor == "ray" else ""  # as the transports declare
        if self.transfer_precision != "fp32" and refused:
            raise fail("transfer_precision", self.transfer_precision,
                       f"fp32 with transport={self.transport}; {refused}")


# -- rounding -------------------------------------------------------------------------------------------------


_TORCH_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

reads_store_arrays(__name__)  # encode and decode only read the arrays they wrap


def encode(x: np.ndarray, precision: str) -> np.ndarray:
    """``x`` (float32) rounded to ``precision`` (round to nearest, ties to even), as its 16-bit patterns (torch's
    conversion: one pass, where the same rounding in numpy takes five)."""
    if precision not in _TORCH_TYPES:
        raise ValueError(f"transfer_precision {precision!r} has no 16-bit encoding")
    x = np.ascontiguousarray(x, dtype=np.float32)
    return torch.from_numpy(x).to(_TORCH_TYPES[precision]).view(torch.int16).numpy().view(np.uint16)


def decode(bits: np.ndarray, precision: str) -> np.ndarray:
    """The float32 values of 16-bit patterns made by :func:`encode`."""
    raw = torch.from_numpy(np.ascontiguousarray(bits).view(np.int16))
    return raw.view(_TORCH_TYPES[precision]).float().numpy()


def _rounded(d: np.ndarray, precision: str, residual: dict | None, name: str) -> np.ndarray:
    """Encode ``d`` (plus the kept residual of ``name``); keep the new residual when ``residual`` is a dict."""
    if residual is not None and name in residual:
        d = d + residual[name]
    bits = encode(d, precision)
    if residual is not None:
        residual[name] = d - decode(bits, precision)
    return bits


def _float_names() -> list[str]:
    return [f.name for f in vector_fields() if f.metadata["rule"] is not Rule.MAX]


def _counter_names() -> list[str]:
    return [f.name for f in vector_fields() if f.metadata["rule"] is Rule.MAX]


# -- up: a host's partial sum ---------------------------------------------------------------------------------


@dataclasses.dataclass
class CompressedSum:
    """A host's partial sum as it travels: its summed vectors as rounded differences from W M."""

    precision: str
    bits: dict[str, np.ndarray | None]
    counters: dict[str, np.ndarray]
    weight: float
    count: int
    bytes_up: int
    stats: list[StepStats]

    @property
    def nbytes(self) -> int:
        return int(sum(b.nbytes for b in self.bits.values() if b is not None)
                   + sum(c.nbytes for c in self.counters.values()))


def _reference(master: GlobalState, name: str, sampled: bool) -> np.ndarray | None:
    """What a client's vector ``name`` is a difference from: the master's, nothing for the control variates'
    changes of a sampled round (differences already)."""
    rule = next(f.metadata["rule"] for f in vector_fields() if f.name == name)
    return None if rule is Rule.CONTROL and sampled else getattr(master, name)


def _shift(partial: PartialSum, master: GlobalState, sampled: bool, sign: float) -> None:
    w = np.float32(partial.weight)
    for name in _float_names():
        total, ref = getattr(partial, name), _reference(master, name, sampled)
        if total is None or ref is None:
            continue
        scaled = ref * w if w != 1 else ref
        (np.subtract if sign < 0 else np.add)(total, scaled, out=total)


def compress(partial: PartialSum, master: GlobalState, precision: str, *, sampled: bool,
             residual: dict | None = None) -> CompressedSum:
    """``partial`` (absolute sums, changed in place) as rounded differences from its weight times ``master``;
    ``residual`` (error feedback) is added and updated."""
    _shift(partial, master, sampled, -1.0)
    return compress_differences(partial, precision, residual)


def compress_differences(diff: PartialSum, precision: str, residual: dict | None = None) -> CompressedSum:
    bits = {n: None if getattr(diff, n) is None else _rounded(getattr(diff, n), precision, residual, n)
            for n in _float_names()}
    counters = {n: np.array(getattr(diff, n)) for n in _counter_names()}
    out = CompressedSum(precision, bits, counters, diff.weight, diff.count, 0, list(diff.stats))
    out.bytes_up = out.nbytes if diff.count == 1 else diff.bytes_up  # a merge keeps its hosts' counts
    return out


def differences(sent: CompressedSum) -> PartialSum:
    """The float32 partial sum of differences that ``sent`` carries."""
    vectors: dict[str, np.ndarray | None] = {n: None if b is None else decode(b, sent.precision)
                                             for n, b in sent.bits.items()}
    vectors.update((n, np.array(c)) for n, c in sent.counters.items())
    return PartialSum.from_vectors(vectors, weight=sent.weight, count=sent.count, bytes_up=sent.bytes_up,
                                   stats=list(sent.stats))


def expand(sent: CompressedSum, master: GlobalState, *, sampled: bool) -> PartialSum:
    """The absolute partial sum ``sent`` stands for (decoded differences plus weight times ``master``)."""
    partial = differences(sent)
    _shift(partial, master, sampled, 1.0)
    return partial


# -- down: the broadcast --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Broadcast:
    """A round's state as it travels down: the change since master ``prior`` (None: send ``full`` only), and
    the new master in full (a state, or a reference the receiver fetches only when it lacks ``prior``)."""

    precision: str
    version: int
    prior: int
    bits: dict[str, np.ndarray | None] | None
    counters: dict[str, np.ndarray]
    round: int
    iteration: int
    full: Any
    error_feedback: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the change (a receiver without the prior master fetches ``full`` instead)."""
        changes = [b for b in (self.bits or {}).values() if b is not None] + list(self.counters.values())
        return sum(int(x.nbytes) for x in changes)


def _apply(master: GlobalState, bits: dict[str, np.ndarray | None], counters: dict[str, np.ndarray],
           precision: str, round: int, iteration: int) -> None:
    """``master += decode(bits)``: the one float32 addition the driver and every client make alike."""
    for name, b in bits.items():
        if b is not None:
            x = getattr(master, name)
            np.add(x, decode(b, precision), out=x)
    for name, c in counters.items():
        setattr(master, name, np.array(c))
    master.round, master.iteration = round, iteration


def _copy(state: GlobalState) -> GlobalState:
    out = copy.copy(state)
    for name in _float_names() + _counter_names():
        x = getattr(state, name)
        setattr(out, name, None if x is None else np.array(x, copy=True))
    return out


class Downlink:
    """The driver's side of the broadcast: the master M the clients hold, its version and (error feedback) the
    residual; ``error_feedback`` is passed on to the hosts for their uploads."""

    def __init__(self, precision: str, error_feedback: bool) -> None:
        self.precision = precision
        self.error_feedback = error_feedback
        self.master: GlobalState | None = None
        self.version = 0
        self.residual: dict | None = {} if error_feedback else None

    @classmethod
    def of(cls, section: TransferSection) -> Downlink | None:
        """The driver's broadcast side for ``transfer_precision`` (None for fp32: nothing changes)."""
        if section.transfer_precision == "fp32":
            return None
        return cls(section.transfer_precision, section.error_feedback)

    def send(self, state: GlobalState) -> tuple[Broadcast, GlobalState]:
        """The broadcast of ``state`` and the master after it (what the round runs from)."""
        prior = self.version
        self.version += 1
        if self.master is None:
            self.master = _copy(state)
            return Broadcast(self.precision, self.version, prior, None, {}, state.round, state.iteration, None,
                             self.error_feedback), self.master
        master = self.master
        bits: dict[str, np.ndarray | None] = {n: None if getattr(state, n) is None else
                _rounded(getattr(state, n) - getattr(master, n), self.precision, self.residual, n)
                for n in _float_names()}
        counters = {n: np.array(getattr(state, n)) for n in _counter_names()}
        _apply(master, bits, counters, self.precision, state.round, state.iteration)
        return Broadcast(self.precision, self.version, prior, bits, counters, state.round, state.iteration, None,
                         self.error_feedback), master

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the broadcast (master, version, residual)."""
        master = None if self.master is None else {n: copy.copy(getattr(self.master, n)) for n in _float_names()
                                                   + _counter_names() + ["round", "iteration"]}
        residual = None if self.residual is None else {k: v.copy() for k, v in self.residual.items()}
        return {"master": master, "version": self.version, "residual": residual}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        master = state.get("master")
        self.master = None if master is None else _copy(GlobalState(**master))
        self.version = int(state.get("version", 0))
        if self.error_feedback:
            self.residual = {k: np.array(v) for k, v in (state.get("residual") or {}).items()}


class Receiver:
    """A client host's side of the broadcast: its float32 master and the version it is at."""

    def __init__(self) -> None:
        self.master: GlobalState | None = None
        self.version = -1

    def receive(self, message: Broadcast, fetch: Callable[[Any], GlobalState] = lambda x: x) -> GlobalState:
        """The master after ``message`` (the state this host's round runs from)."""
        if message.bits is not None and self.master is not None and self.version == message.prior:
            _apply(self.master, message.bits, message.counters, message.precision, message.round, message.iteration)
        else:
            self.master = _copy(fetch(message.full))
        self.version = message.version
        return self.master


def decoding(fold: Callable[[PartialSum], None], master: GlobalState, sampled: bool) -> Callable[[Any], None]:
    """``fold`` for what arrives rounded: a :class:`CompressedSum` is expanded against ``master`` first."""

    def fold_sent(part: Any) -> None:
        fold(expand(part, master, sampled=sampled) if isinstance(part, CompressedSum) else part)

    return fold_sent


def sent_nbytes(message: Broadcast, master: GlobalState) -> int:
    """Bytes a client that holds the prior master receives (the full master on a first broadcast)."""
    return int(master.nbytes) if message.bits is None else message.nbytes


RESIDUAL_KEY = "transfer_residual"  # the field of a host's first ClientState its upload residual rides in


def attach_residual(states: Sequence[ClientState | None], residual: dict | None) -> None:
    """Put a host's upload residual into the first of its clients' exported states."""
    if residual is not None and states and states[0] is not None:
        states[0].transfer_residual = {k: np.array(v) for k, v in residual.items()}


def residual_of(states: Sequence[ClientState | None]) -> dict:
    """A host's upload residual from its clients' checkpointed states (empty when none was kept)."""
    for s in states:
        if s is not None and s.transfer_residual is not None:
            return {k: np.array(v, dtype=np.float32) for k, v in s.transfer_residual.items()}
    return {}
