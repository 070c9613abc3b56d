"""The config fields of the two-stage recipe's stage 1 (:mod:`fdam_ray.assembly.pretrain`), declared apart from
it: the config composes this section, and the recipe, which imports the config, sits above it."""

from __future__ import annotations

import dataclasses
import logging

from fdam_ray.settings.sections import NONNEGATIVE, POSITIVE, Section, setting, shared, warn_once

log = logging.getLogger("fdam_ray.assembly.pretrain")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainSection(Section):
    """The config fields of stage 1 (what :func:`pretrain_config` reads besides the run's own fields)."""

    name = "pretrain"

    pretrain_iterations: int = setting(0, "Two-stage recipe: iterations of BCE pre-training (fedavg) before the AUC "
                                       "run, which keeps the pre-trained body and re-initialises the head; 0 = off.",
                                       check=NONNEGATIVE)
    pretrain_lr: float | None = setting(None, "Step size of pre-training; null = lr.", check=POSITIVE)
    pretrain_batch_size: int | None = setting(None, "Minibatch of pre-training; null = batch_size.", kind="batch",
                                              allowed=">= 0 or 'full'")
    pretrain_optimizer: str = setting("sgd", "Local step of pre-training: sgd (with the run's momentum) or adam "
                                      "(the paper's choice, e.g. with pretrain_lr 1e-5).", choices=("sgd", "adam"))
    pretrain_federated: bool = setting(True, "Pre-train on all clients (fedavg); false = on client 0's data alone "
                                       "(e.g. the first source).")
    lr: float = shared()
    batch_size: int = shared()
    local_optimizer: str = shared()
    algorithm: str = shared()
    num_clients: int = shared()

    def check(self) -> None:
        """Pre-training fields without pre-training have no effect: one warning (a config that turns pre-training
        off with pretrain_iterations = 0, e.g. in a sweep, may mean it; more often pretrain_iterations was
        forgotten)."""
        if self.pretrain_iterations:
            return
        unused = self.unused()
        if unused:
            warn_once(log, f"config fields {', '.join(unused)} have no effect: pretrain_iterations = 0 (no "
                      "pre-training); set pretrain_iterations > 0 to pre-train, or remove them")

    def unused(self) -> list[str]:
        """The pre-training fields set (``name = value``) to other than what the run itself uses. Stage 1's own
        config (:func:`pretrain_config`) keeps the fields it was made from, equal to its own, and names none."""
        out = []
        if self.pretrain_lr is not None and self.pretrain_lr != self.lr:
            out.append(f"pretrain_lr = {self.pretrain_lr:g}")
        if self.pretrain_batch_size is not None and self.pretrain_batch_size != self.batch_size:
            out.append(f"pretrain_batch_size = {self.pretrain_batch_size or 'full'}")
        if self.pretrain_optimizer != "sgd" and self.pretrain_optimizer != self.local_optimizer:
            out.append(f"pretrain_optimizer = {self.pretrain_optimizer}")
        if not self.pretrain_federated and not (self.algorithm == "centralized" and self.num_clients == 1):
            out.append("pretrain_federated = false")
        return out
