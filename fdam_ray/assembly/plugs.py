"""The plugs of a run, built from its config (docs/architecture.md, "Plugs"): the one place that knows which
mechanisms a config asks for and cuts each its sections. Today: differential privacy of training
(:mod:`fdam_ray.privacy.driver`), wrapped by private evaluation (:mod:`fdam_ray.privacy.evaluation`); a run
without any gets the plug that does nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fdam_ray.clients.face import ClientFace
from fdam_ray.core.schedules import ScheduleSection, planned_rounds
from fdam_ray.features.sites import client_label
from fdam_ray.loop.plug import Plug
from fdam_ray.privacy.driver import RunFacts, privacy_plug
from fdam_ray.privacy.driver import site_face as privacy_site_face
from fdam_ray.privacy.evaluation import evaluation_plug
from fdam_ray.privacy.section import PrivacySection

if TYPE_CHECKING:
    from fdam_ray.config import Config


def run_plug(config: Config) -> Plug:
    """The driver's plug of ``config`` (its faces: the clients', the server's reducer, the driver's hooks)."""
    section = PrivacySection.of(config)
    return evaluation_plug(_training_plug(config, section), dp_eval=section.dp_eval, noise=section.dp_eval_noise,
                           target=section.dp_eval_epsilon, delta=section.dp_delta, seed=section.dp_noise_seed,
                           iterations=config.iterations, eval_every=config.eval_every)


def _training_plug(config: Config, section: PrivacySection) -> Plug:
    if not section.enabled:
        return Plug()
    facts = RunFacts(planned_rounds=planned_rounds(ScheduleSection.of(config)), iterations=config.iterations,
                     batch_size=config.batch_size, transport=config.transport,
                     transfer_precision=config.transfer_precision,
                     labels=tuple(client_label(k, config.client_names) for k in range(config.num_clients)),
                     val_fraction=config.val_fraction, seed=config.seed)
    return privacy_plug(section, facts)


def site_face(config: Config) -> ClientFace:
    """The client face a Flower site builds from the run config the server sent (the same as the driver's)."""
    return privacy_site_face(PrivacySection.of(config))
