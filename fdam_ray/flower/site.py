"""A site: one fdam-ray client kept between Flower messages (docs/algorithms.md s.2, s.3, s.3b).

A SuperNode may run each message in a fresh process, so nothing of a site lives
in Python objects between messages. What the site must keep between rounds (its
c^k, its sampler position, the stage's proximal centre v_ref, the global p and
the run's config) is :class:`KeptState`, stored in the node's state
(``Context.state``) and, when the site names a ``state-dir``, in a file of its
own that survives a SuperNode restart (one that cannot be this site's state,
unreadable or holding anything else, is set aside as ``site-k.pt.damaged`` with
one line, and the site rejoins as a replaced client). For every message the site rebuilds its
:class:`~fdam_ray.clients.client.Client` from it: the same solver, sampler and control
variate the inline executor runs, so a round here is the same arithmetic.

An update the server may not have counted (its reply lost, or the site left out
of the round after the timeout) must not move c^k: the state after a round is
kept as *pending* until the server's next message says which round of this site
it last counted (``counted``). Then the pending state is adopted, or dropped and
the site goes on from the state it had before that round, as the server's c
assumes (SCAFFOLD's rule for clients that did not take part).

A site's data come from its node config (:func:`site_source`): an ``.npz`` file, a Python source, or its own
chest X-rays (:class:`ImageSite`): organisation k of the study's ``chestxray_sources``, read from the site's
folder in its publisher's layout, with the study's label policies, test patients and augmentation, so that the
site's shard is the one client k has in the inline run of the study.
"""

from __future__ import annotations

from fdam_ray.flower import needs_flower  # noqa: F401 (first: without Flower, says what to install)

# isort: split
import dataclasses
import io
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from flwr.app import RecordDict

from fdam_ray.algorithms import build_algorithm
from fdam_ray.algorithms.drift import DriftCorrection
from fdam_ray.assembly.plugs import site_face
from fdam_ray.clients.client import Client, ClientSection, resolve_device
from fdam_ray.config import build_config
from fdam_ray.core.state import ClientState
from fdam_ray.data import DataSource
from fdam_ray.data.base import Shard, Split, as_labels
from fdam_ray.data.chestxray import DEFAULT_IMAGE_SIZE, organisation_source
from fdam_ray.data.chestxray_readers import TASKS as CHESTXRAY_TASKS
from fdam_ray.data.sections import ChestXraySection
from fdam_ray.executors.base import ExecutorSection
from fdam_ray.executors.inline import inline_threads
from fdam_ray.flower import records
from fdam_ray.settings.factories import resolve

log = logging.getLogger(__name__)

STATE_RECORD = "fdam_site"


class SiteSource(DataSource):
    """One site's own data as client ``site`` of the federation (the site never sees another's)."""

    def __init__(self, site: int, train: tuple[Any, Any], test: tuple[Any, Any] | None = None) -> None:
        self.site = site
        self.train = _split(train, f"site {site}'s training data")
        self.test = None if test is None else _split(test, f"site {site}'s test data")
        self.num_clients = site + 1
        self.input_shape = tuple(self.train.x.shape[1:])
        self.num_tasks = int(self.train.y.shape[1])
        self.task_names = ("positive",) if self.num_tasks == 1 else tuple(f"task{t}" for t in range(self.num_tasks))

    def client_shard(self, client_id: int) -> Shard:
        if client_id != self.site:
            raise ValueError(f"site {self.site} holds its own data only, not client {client_id}'s")
        return Shard(self.train, self.test)

    def test_set(self) -> None:
        return None


def _split(pair: tuple[Any, Any], what: str) -> Split:
    x = np.ascontiguousarray(np.asarray(pair[0], dtype=np.float32))
    if x.ndim < 2:
        raise ValueError(f"{what}: X must have shape (n, features...), got {x.shape}")
    return Split(torch.from_numpy(x), as_labels(pair[1], what=what))


class ImageSite(DataSource):
    """A site's chest X-rays: organisation ``chestxray_sources[k]`` of the study, read from the site's own folder
    in its publisher's layout (:mod:`fdam_ray.data.chestxray_readers`), images loaded batch by batch.

    Which organisation it is, the label policies, the test patients, ``image_size`` and the augmentation are the
    study's (:meth:`for_study`, once the site has the run's config); the folder is the site's alone. Before that it
    says only the shape of its samples: (3, ``image-size``, ``image-size``) from its node config (default: the
    loader's 320), which the study's ``image_size`` must match."""

    num_tasks = len(CHESTXRAY_TASKS)
    task_names = CHESTXRAY_TASKS

    def __init__(self, site: int, root: str, image_size: int = DEFAULT_IMAGE_SIZE) -> None:
        self.site, self.root, self.image_size = site, root, image_size
        self.num_clients = site + 1
        self.input_shape = (3, image_size, image_size)

    def for_study(self, config: Any) -> DataSource:
        section = ChestXraySection.of(config)
        size = section.image_size or DEFAULT_IMAGE_SIZE
        if size != self.image_size:
            raise ValueError(f"site {self.site} resizes its images to {self.image_size} (node config image-size) but "
                             f"the study's image_size is {size}: set image-size = {size} in this site's node config")
        if not Path(self.root).expanduser().is_dir():
            raise ValueError(f"site {self.site}: its image folder chestxray-root = '{self.root}' is not a folder on "
                             f"this node ({os.uname().nodename})")
        return OwnShard(self.site, organisation_source(section, self.site, self.root))

    def client_shard(self, client_id: int) -> Shard:
        raise ValueError(f"site {self.site} reads its images once it has the study's config (ImageSite.for_study)")

    def test_set(self) -> None:
        return None


class OwnShard(DataSource):
    """Client ``site`` of the federation, whose shard is client 0 of ``inner`` (a source of this site's data only)."""

    def __init__(self, site: int, inner: DataSource) -> None:
        self.site, self.inner = site, inner
        self.num_clients = site + 1
        self.input_shape, self.num_tasks, self.task_names = inner.input_shape, inner.num_tasks, inner.task_names

    def client_shard(self, client_id: int) -> Shard:
        if client_id != self.site:
            raise ValueError(f"site {self.site} holds its own data only, not client {client_id}'s")
        return self.inner.client_shard(0)

    def test_set(self) -> None:
        return None


def study_source(source: DataSource, config: Any) -> DataSource:
    """The site's data under the run's config: an :class:`ImageSite`'s organisation, else ``source`` as it is."""
    return source.for_study(config) if isinstance(source, ImageSite) else source


def site_source(node_config: Mapping[str, Any]) -> tuple[int, DataSource]:
    """(k, the site's data) from the SuperNode's ``--node-config``: ``site`` (k), and ``data`` (an ``.npz`` with
    ``x``, ``y`` and optionally ``x_test``, ``y_test``), ``chestxray-root`` (the folder of the site's chest X-rays as
    its publisher ships them, with ``image-size`` when the study's ``image_size`` is not 320: :class:`ImageSite`) or
    ``source`` (``module:function``, called with k, returning a :class:`~fdam_ray.data.DataSource` that builds
    client k's shard, or ``((X, y), (X_test, y_test) or None)``)."""
    if "site" not in node_config:
        raise ValueError("node config: 'site' (this site's client number k, 0..K-1) is missing")
    site = int(node_config["site"])
    if "chestxray-root" in node_config:
        return site, ImageSite(site, str(node_config["chestxray-root"]),
                               int(node_config.get("image-size", DEFAULT_IMAGE_SIZE)))
    if "data" in node_config:
        with np.load(str(node_config["data"]), allow_pickle=False) as npz:
            test = (npz["x_test"], npz["y_test"]) if "x_test" in npz else None
            return site, SiteSource(site, (npz["x"], npz["y"]), test)
    if "source" in node_config:
        made = resolve(str(node_config["source"]), field="node config 'source'", here=f"on site {site}")(site)
        if isinstance(made, DataSource):
            return site, made
        train, test = made
        return site, SiteSource(site, train, test)
    raise ValueError("node config: give 'data' (an .npz file of x, y[, x_test, y_test]), 'chestxray-root' (the "
                     "folder of the site's chest X-rays) or 'source' (module:function returning the site's data)")


@dataclasses.dataclass
class KeptState:
    """What a site keeps between messages (see the module docstring)."""

    run_key: str = ""
    config: str = ""  # the run's config as JSON, as the server sent it
    version: int = 0  # the server's setup version this site has applied
    positive_ratio: np.ndarray | None = None
    stage: int = 0
    reference: np.ndarray | None = None
    client: ClientState | None = None  # Client.get_state() after the last round the server counted
    pending_round: int = -1
    pending: ClientState | None = None  # Client.get_state() after round pending_round, not yet known to be counted
    pending_start: ClientState | None = None  # the client state that round started from (for the change of c^k)
    replaced: bool = False  # joined mid-run without a kept state: its first round starts from c^k = c

    def settle(self, counted: int) -> None:
        """Adopt the pending round if the server counted it, else go back to the state before it."""
        if self.pending is not None:
            if counted == self.pending_round:
                self.client = self.pending
            else:
                log.warning("site %s: its update of round %d was not counted by the server; it goes on from the "
                            "state it had before that round", _site_of(self.client or self.pending),
                            self.pending_round)
        self.pending, self.pending_start, self.pending_round = None, None, -1

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        torch.save({k: _tensors(v.to_dict() if isinstance(v, ClientState) else v) for k, v in fields.items()}, buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, site: int | None = None) -> KeptState:
        """The state ``data`` holds (of site ``site``, when given); :class:`DamagedState` (one line, never torch's
        advice to load a file unsafely) when it holds anything else."""
        try:
            raw = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)  # tensors and plain values only
        except Exception as exc:  # torch raises many kinds, each with a long text of its own
            raise DamagedState(f"not a state torch can read safely ({type(exc).__name__})") from None
        if not isinstance(raw, dict):
            raise DamagedState(f"holds {type(raw).__name__}, not a site's state")
        kinds = {f.name: _KINDS[f.name] for f in dataclasses.fields(cls)}
        for key, value in raw.items():
            if key not in kinds:
                raise DamagedState(f"holds {str(key)[:40]!r}, which a site's state does not")
            if not isinstance(value, kinds[key]) or (isinstance(value, bool) and kinds[key] is int):
                raise DamagedState(f"its {key} is {type(value).__name__}")
        for key in ("client", "pending", "pending_start"):
            if raw.get(key) is None:
                continue
            owner = raw[key].get("client_id")
            if not isinstance(owner, int) or (site is not None and owner != site):
                raise DamagedState(f"its {key} is the state of client {str(owner)[:20]}, not of site {site}")
            try:
                raw[key] = ClientState.from_dict(raw[key])
            except (KeyError, ValueError) as exc:
                raise DamagedState(f"its {key} is not a client's state ({type(exc).__name__}: {exc})") from None
        out = cls(**raw)
        for name in ("positive_ratio", "reference"):
            value = getattr(out, name)
            if value is not None:
                setattr(out, name, value.numpy())
        return out


class DamagedState(ValueError):
    """A kept state that cannot be this site's (an unreadable file, or one holding something else)."""


_KINDS: dict[str, type | tuple[type, ...]] = {
    "run_key": str, "config": str, "version": int, "positive_ratio": (torch.Tensor, type(None)), "stage": int,
    "reference": (torch.Tensor, type(None)), "client": (dict, type(None)), "pending_round": int,
    "pending": (dict, type(None)), "pending_start": (dict, type(None)), "replaced": bool}


def _site_of(state: ClientState | None) -> object:
    return "?" if state is None else state.client_id


def _tensors(value: Any) -> Any:
    """numpy arrays as tensors (what ``torch.load(weights_only=True)`` reads back), recursively."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, dict):
        return {k: _tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors(v) for v in value)
    return value


class SiteStore:
    """Where a site's :class:`KeptState` lives: the node's state record, and a file when ``state_dir`` is set.

    The node's state is lost when the SuperNode restarts; the file (written atomically after every change) is
    not, and it lies where the site decides.
    """

    def __init__(self, state: RecordDict, state_dir: str | None, site: int, node: int | None = None) -> None:
        self.state = state
        self.site, self.node = site, node
        self.path = None if not state_dir else Path(state_dir) / f"site-{site}.pt"
        self.lost = ""  # why a kept state was not usable (told to the server), "" if none was lost

    def load(self) -> KeptState:
        """The kept state; a damaged one is set aside with one line (the site goes on as one that kept no state,
        and the server takes it back as a replaced client)."""
        if STATE_RECORD in self.state.config_records:
            try:
                return KeptState.from_bytes(bytes(cast(bytes, self.state.config_records[STATE_RECORD]["blob"])),
                                            self.site)
            except DamagedState as exc:
                del self.state.config_records[STATE_RECORD]
                return self._damaged(f"its kept state in the node's state is damaged ({exc})")
        if self.path is not None and self.path.exists():
            log.info("site state read from %s (the node's state was empty: a restarted SuperNode)", self.path)
            try:
                return KeptState.from_bytes(self.path.read_bytes(), self.site)
            except (DamagedState, OSError) as exc:
                aside = self._set_aside(self.path)
                return self._damaged(f"its state file {self.path} is damaged ({exc}); it is kept, not read, as "
                                     f"{aside}")
        return KeptState()

    def _damaged(self, what: str) -> KeptState:
        self.lost = what
        log.warning("site %d (node %s): %s; the site rejoins as a replaced client (c^k = the global c, a fresh "
                    "sampler); nothing to do unless it happens again (then look at the disk of its state-dir)",
                    self.site, "?" if self.node is None else self.node, what)
        return KeptState()

    @staticmethod
    def _set_aside(path: Path) -> Path:
        for i in range(1000):
            aside = path.with_name(path.name + (".damaged" if i == 0 else f".damaged.{i}"))
            if not aside.exists():
                break
        os.replace(path, aside)
        return aside

    def save(self, kept: KeptState) -> None:
        data = kept.to_bytes()
        self.state.config_records[STATE_RECORD] = records.config({"blob": data})
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".site-", suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, self.path)


def build_client(site: int, source: DataSource, kept: KeptState) -> Client:
    """The site's client as ``kept`` describes it: the run's config, p, the stage's centre, c^k and sampler."""
    if not kept.config:
        raise RuntimeError(f"site {site} has not been given the run's config yet")
    config = build_config(json.loads(kept.config))
    threads = inline_threads(ExecutorSection.of(config))
    if threads is not None:
        torch.set_num_threads(threads)
    # the plugs' client face (dp: the clip, the site's noise share, DP-SGD), with the sigma the server resolved
    # into the config: the face the driver builds
    client = Client(ClientSection.of(config), study_source(source, config), site,
                    device=resolve_device(config.device), face=site_face(config))
    if kept.positive_ratio is not None and client.replica.objective.has_auxiliary:
        client.configure(kept.positive_ratio)
    if kept.reference is not None:
        client.replica.set_reference(kept.reference)
    if kept.client is not None:
        client.set_state(kept.client)
    return client


def site_drift(kept: KeptState) -> DriftCorrection:
    """The drift correction of the run whose config ``kept`` holds (its algorithm's, as the driver's)."""
    if not kept.config:
        raise RuntimeError("the site has not been given the run's config yet")
    return build_algorithm(ClientSection.of(build_config(json.loads(kept.config)))).drift


def zero_control_variate(kept: KeptState) -> None:
    """A stage start with reset_control_variates: c^k <- 0 in the kept client state (the drift correction's
    :meth:`~fdam_ray.algorithms.drift.DriftCorrection.zeroed`)."""
    if kept.client is not None:
        site_drift(kept).zeroed(kept.client)
