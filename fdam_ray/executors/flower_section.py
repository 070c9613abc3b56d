"""The Flower-specific settings: their own ``flower:`` section of the same config file.

Everything else in the file is an ordinary fdam-ray config (the same fields,
checked by :func:`fdam_ray.config.build_config`), so the study a consortium
simulated with Ray runs unchanged on Flower: only this section is added.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from fdam_ray.settings.sections import ConfigError, fail

SECTION_KEY = "flower"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlowerSection:
    """How the server reaches the sites and how their updates are combined.

    Attributes:
        connect_timeout_s: how long the server waits for every site (0..K-1) to connect before it starts.
        round_timeout_s: how long the server waits for the replies of one message wave; a site that has not
            replied by then is left out of that round (the partial-participation rule, docs/algorithms.md s.3b).
        secagg: combine the round's updates with Flower's SecAgg+ (the server sees only their sum).
        secagg_clipping_range: SecAgg+ clips each value sent to [-range, range] before quantising.
        secagg_quantization_range: SecAgg+ maps [-range, range] onto this many integer levels.
        secagg_num_shares: SecAgg+ shares of each site's key (a fraction: of the round's sites).
        secagg_reconstruction_threshold: shares needed to reconstruct a site's masks (a fraction: of the shares;
            0.7 of 3 sites is 2: one site may drop out mid-protocol, and no single site can unmask another).
        test_data: an ``.npz`` file (arrays ``x``, ``y``) the server scores the global model on; None: the
            sites' own test splits are the test set.
        bind_sites: bind each site number to the public key of the node that first takes it; a node with another
            key claiming that site later is refused (:mod:`fdam_ray.flower.identity`). False: a node is whichever
            site it says it is.
        site_keys: site -> the fingerprint (``SHA256:...``, as ``ssh-keygen -lf`` prints it and a refusal's log
            line names it) of the public key that site's node must hold. It overrides the binding: the operator
            replaces a site's node this way, or binds every site from the first message on (no first come, first
            bound). In the config file the site numbers are written as text: ``site_keys: {'1': 'SHA256:...'}``.
    """

    connect_timeout_s: float = 120.0
    round_timeout_s: float = 600.0
    secagg: bool = False
    secagg_clipping_range: float = 8.0
    secagg_quantization_range: int = 2**24
    secagg_num_shares: float = 1.0
    secagg_reconstruction_threshold: float = 0.7
    test_data: str | None = None
    bind_sites: bool = True
    site_keys: Mapping[int, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "round_timeout_s"):
            _number(name, getattr(self, name), lambda v: v > 0, "a finite number of seconds > 0")
        _number("secagg_clipping_range", self.secagg_clipping_range, lambda v: v > 0, "a finite number > 0")
        q = self.secagg_quantization_range
        if not isinstance(q, int) or isinstance(q, bool) or not 2 <= q <= 2**26:
            raise fail("flower.secagg_quantization_range", q, "an integer in [2, 2**26]")
        # SecAgg+'s own rules (a count of shares is whole and at least 3; the modulus 2**32 holds at most
        # 2**32 / quantization_range of them; a count threshold is below a count of shares), checked here, not in
        # the middle of the first secure round
        most = 2**32 // q
        _number("secagg_num_shares", self.secagg_num_shares,
                lambda v: 0 < v <= 1 or (float(v).is_integer() and 3 <= v <= most),
                f"a fraction in (0, 1] of the round's sites, or a whole count in [3, {most}]")
        shares = self.secagg_num_shares
        _number("secagg_reconstruction_threshold", self.secagg_reconstruction_threshold,
                lambda v: 0 < v <= 1 or (float(v).is_integer() and 2 <= v and (shares <= 1 or v < shares)),
                "a fraction in (0, 1] of the shares, or a whole count >= 2"
                + ("" if shares <= 1 else f" and below flower.secagg_num_shares = {shares:g}"))
        if not isinstance(self.secagg, bool):
            raise fail("flower.secagg", self.secagg, "true or false")
        if self.test_data is not None and (not isinstance(self.test_data, str) or not self.test_data):
            raise fail("flower.test_data", self.test_data, "the path of an .npz file, or null")
        if not isinstance(self.bind_sites, bool):
            raise fail("flower.bind_sites", self.bind_sites, "true or false")
        object.__setattr__(self, "site_keys", _site_keys(self.site_keys))

    def check_sites(self, num_clients: int) -> None:
        """Every site ``site_keys`` names is one of the study's (0 .. num_clients - 1); else one line."""
        outside = sorted(k for k in self.site_keys if k >= num_clients)
        if outside:
            raise fail("flower.site_keys", {k: self.site_keys[k] for k in outside},
                       f"site numbers of the study, 0 .. {num_clients - 1} (num_clients = {num_clients})")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> FlowerSection:
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                raise ConfigError(f"unknown field 'flower.{str(key)[:80]}' (the flower section takes "
                                  f"{', '.join(sorted(known))})")
        return cls(**values)


_ALLOWED = {"connect_timeout_s": "> 0 (seconds)", "round_timeout_s": "> 0 (seconds)", "secagg": "true, false",
            "secagg_clipping_range": "> 0", "secagg_quantization_range": "an integer in [2, 2**26]",
            "secagg_num_shares": "a fraction in (0, 1], or a whole count >= 3",
            "secagg_reconstruction_threshold": "a fraction in (0, 1], or a whole count >= 2 below the shares",
            "test_data": "an .npz path, or null", "bind_sites": "true, false",
            "site_keys": "{site: 'SHA256:<43 base64 characters>'}"}


def catalog_rows() -> list[tuple[str, str, str, str, str]]:
    """The section's fields as ``fdam fields`` lists them: (``flower``, ``flower.<name>``, default, meaning,
    allowed), the meaning read from :class:`FlowerSection`'s docstring (one source for both)."""
    meaning: dict[str, str] = {}
    name = None
    for line in (FlowerSection.__doc__ or "").split("Attributes:", 1)[-1].splitlines():
        head = re.match(r"^ {8}(\w+): (.*)$", line)
        if head:
            name, meaning[head.group(1)] = head.group(1), head.group(2).strip()
        elif name and line.startswith(" " * 12):
            meaning[name] += " " + line.strip()
    def plain(text: str) -> str:  # as the other rows read: no reST markup, a capital first letter
        text = re.sub(r":\w+:`~?([^`]*)`", r"\1", text).replace("``", "")
        return text[:1].upper() + text[1:]

    defaults = FlowerSection()  # every field has a default: the defaults as the section holds them
    return [(SECTION_KEY, f"{SECTION_KEY}.{f.name}", str(getattr(defaults, f.name)), plain(meaning[f.name]),
             _ALLOWED[f.name]) for f in dataclasses.fields(FlowerSection)]


def _number(name: str, value: Any, rule: Callable[[float], bool], allowed: str) -> None:
    """A number of the section: a real number (not a bool or text), finite, and within ``rule``; else one line."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and rule(value)
    if not ok:
        raise fail(f"flower.{name}", value, allowed)


_FINGERPRINT = re.compile(r"SHA256:[A-Za-z0-9+/]{43}")


def _site_keys(value: Any) -> dict[int, str]:
    """``flower.site_keys`` as site -> fingerprint (site numbers >= 0, each a key's SHA256 fingerprint)."""
    allowed = "a mapping of site number (>= 0) to a public key fingerprint 'SHA256:<43 base64 characters>'"
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise fail("flower.site_keys", value, allowed)
    out: dict[int, str] = {}
    for site, key in value.items():
        number = site if isinstance(site, int) and not isinstance(site, bool) else None
        if isinstance(site, str) and site.strip().isdigit():
            number = int(site)
        if number is None or number < 0 or not isinstance(key, str) or not _FINGERPRINT.fullmatch(key.strip()):
            raise fail("flower.site_keys", {site: key}, allowed)
        if key.strip() in out.values():  # one key is one node: two sites on it would be one site counted twice
            other = next(k for k, v in out.items() if v == key.strip())
            raise fail("flower.site_keys", {other: out[other], site: key},
                       f"one key per site: sites {min(other, number)} and {max(other, number)} name the same "
                       "fingerprint")
        out[number] = key.strip()
    return out


def split_config(values: Mapping[str, Any]) -> tuple[dict[str, Any], FlowerSection]:
    """(the fdam-ray fields, the Flower section) of one config mapping.

    :func:`fdam_ray.config.build_config` calls it too: a simulation of the study ignores the section, but a broken
    one is refused there as here (this module imports no Flower)."""
    rest = dict(values)
    section = rest.pop(SECTION_KEY, None)
    if section is not None and not isinstance(section, Mapping):
        raise ConfigError(f"config field 'flower' must be a section of field: value, not {type(section).__name__}")
    return rest, FlowerSection.from_mapping(section)
