"""Named sites: the name a client goes by wherever it is shown (config field ``client_names``).

A cross-silo study speaks of hospitals, not of client 3. With ``client_names``
set, client k is shown as its name in the per-client metric keys
(``client_auc.<name>``, hence ``metrics.csv``, Tune and the trackers), in
``train.log`` (a client replaced or dropped, warnings), in error messages and
in the summary; without it, as today, by its index ``0..K-1``. A name is used as
a metric key and may become part of a file name, so it is kept to ASCII
letters and digits and ``_ . -`` (no accents, other scripts, spaces or line
breaks), and the message that refuses a name says exactly that.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from fdam_ray.settings.redact import short
from fdam_ray.settings.sections import Section, fail, setting, shared

MAX_NAME = 64
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{MAX_NAME - 1}}}", re.ASCII)
NAME_ALLOWED = (f"one distinct name per client, each of at most {MAX_NAME} characters of ASCII letters, digits, '_', "
                "'.' and '-' (A-Z, a-z, 0-9, _ . -; no accents, other scripts, spaces or line breaks), starting with "
                "a letter or digit")


def is_site_name(name: object) -> bool:
    """Whether ``name`` may name a client: safe as a metric key (MLflow, W&B, TensorBoard) and as a file name;
    :data:`NAME_ALLOWED` says the same in words."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None  # match(): '$' would let "a\n" through


def client_label(client_id: int, names: Sequence[str] | None) -> str:
    """How client ``client_id`` is shown: its name, else its index (``3``)."""
    if names is None or not 0 <= client_id < len(names):
        return str(client_id)
    return names[client_id]


def client_labels(client_ids: Sequence[int], names: Sequence[str] | None) -> str:
    """Several clients as shown in one message: ``0, 1, 2`` or ``siteA, siteB``."""
    return ", ".join(client_label(k, names) for k in client_ids)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SiteSection(Section):
    """The names of the clients (sites); checked against ``num_clients``."""

    name = "sites"

    client_names: tuple[str, ...] | None = setting(
        None, "A name per client, in client order, used wherever a client is shown (client_auc.<name>, train.log, "
        "errors); ASCII letters, digits, '_', '.', '-'; null = the client indices 0..K-1.",
        allowed=NAME_ALLOWED)
    num_clients: int = shared()

    def check(self) -> None:
        names = self.client_names
        if names is None:
            return
        bad = next((n for n in names if not is_site_name(n)), None)
        if bad is not None:
            raise fail("client_names", names, f"{NAME_ALLOWED}; {short(bad, 60)} is not")
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise fail("client_names", names, f"{NAME_ALLOWED}; '{name}' is given twice")
            seen.add(name)
        if len(names) != self.num_clients:
            raise fail("client_names", names,
                       f"one name per client: {self.num_clients} (num_clients), not {len(names)}")
