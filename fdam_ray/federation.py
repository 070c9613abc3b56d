"""The driver loop: rounds, stages, evaluation, checkpoints and run outputs.

One round (ALGORITHMS.md s.3): the executor runs every client from the global
state, the :class:`RoundReducer` folds their updates as they arrive and
applies the server step. When a stage ends (applied just before the first
round of the next one) the proximal centre moves (to the average of the
stage's round-end global iterates, or the last one), CODA recomputes alpha in
closed form, and control variates are zeroed unless the config keeps them. A
new stage starts from the last global iterate (the
paper's analysis restarts from the stage output; with the default
``reference_point: average`` the two differ only in the start point, and
restarting a deep network from an average of iterates would also need its
BatchNorm statistics recomputed).

Everything the loop carries from round to round is in :class:`LoopState`; a
checkpoint is that, the clients' states (control variates, sampler positions)
and the config, so a resumed run continues the same run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from fdam_ray.algorithms import Algorithm
from fdam_ray.client import Replica, all_finite, resolve_device
from fdam_ray.data import DataSource, make_source
from fdam_ray.evaluation import Evaluator
from fdam_ray.executors import Executor, make_executor
from fdam_ray.objectives import closed_form_alpha
from fdam_ray.outputs import Progress, RunWriter, make_run_dir
from fdam_ray.schedules import Position, Schedule
from fdam_ray.state import ClientInfo, ClientUpdate, GlobalState, RoundPlan
from fdam_ray.weights import load_weights, read_weights

log = logging.getLogger(__name__)


class DivergenceError(RuntimeError):
    """The global state, a client's update or its loss became NaN or infinite."""


@dataclasses.dataclass
class RunResult:
    """What a finished run returns.

    Attributes:
        model_state: the global network's ``state_dict`` (BatchNorm statistics included).
        a, b, alpha: the objective's extra primal and dual variables (empty for bce).
        control_variates: the global (c_v, c_alpha), or None without drift correction.
        history: one record per evaluation (iteration, round, stage, lr, losses, AUCs, bytes, time).
        summary: best and final test AUC, rounds, bytes moved, wall time, samples/s.
        state: the final global state as flat buffers.
        run_dir: where outputs were written (None when nothing was saved).
        pretrain: the BCE pre-training run of the two-stage recipe (``pretrain_iterations`` > 0), else None.
    """

    config: object
    model_state: dict[str, torch.Tensor]
    a: np.ndarray
    b: np.ndarray
    alpha: np.ndarray
    control_variates: tuple[np.ndarray, np.ndarray] | None
    history: list[dict]
    summary: dict
    state: GlobalState
    run_dir: Path | None
    pretrain: RunResult | None = None


@dataclasses.dataclass
class LoopState:
    """What the driver loop carries between rounds (all of it goes into a checkpoint)."""

    state: GlobalState
    reference: np.ndarray  # proximal centre of the current stage
    ref_sum: np.ndarray  # float64 sum of this stage's round-end v (reference_point: average)
    ref_count: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    samples: int = 0
    train_s: float = 0.0
    wall_offset: float = 0.0  # wall time of earlier sessions of a resumed run
    loss_sum: float = 0.0
    loss_rounds: int = 0
    next_eval: int = 0
    history: list[dict] = dataclasses.field(default_factory=list)
    position: Position = dataclasses.field(default_factory=Position)  # in the schedule, after the last round

    def to_payload(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["state"] = dataclasses.asdict(self.state)
        d["position"] = dataclasses.asdict(self.position)
        return d

    @classmethod
    def from_payload(cls, d: dict) -> LoopState:
        return cls(**{**d, "state": GlobalState(**d["state"]), "position": Position(**d["position"])})


def global_positive_ratio(infos: list[ClientInfo]) -> np.ndarray:
    """p per task: all clients' positives over all clients' labelled samples."""
    pos = np.sum([i.positives for i in infos], axis=0).astype(np.float64)
    lab = np.sum([i.labelled for i in infos], axis=0).astype(np.float64)
    for t, (n_pos, n_lab) in enumerate(zip(pos, lab, strict=True)):
        if n_pos == 0 or n_pos == n_lab:
            side = "positive" if n_pos == 0 else "negative"
            raise ValueError(f"task {t}: no client has a {side} training label, so AUC cannot be optimised")
    return pos / lab


class Federation:
    """Runs one federation from a config; see :func:`run`."""

    def __init__(self, config, source: DataSource, executor: Executor) -> None:
        self.config = config
        self.source = source
        self.executor = executor
        self.algorithm = Algorithm.from_config(config)
        # Under Ray the driver's replica only loads states and, with eval_on=driver, scores: it stays on
        # the CPU, outside Ray's GPU accounting (the clients hold the GPU shares).
        device = resolve_device(config.device) if config.executor == "inline" else torch.device("cpu")
        self.replica = Replica(config, source, device=device)

    # -- start -----------------------------------------------------------------------
    def _start(self) -> GlobalState:
        cfg = self.config
        infos = self.executor.start(cfg, self.source)
        size = self.replica.flat.state_size
        for info in infos:
            if info.state_size != size:
                raise RuntimeError(f"client {info.client_id} has {info.state_size} model values, the driver {size}")
            if self.replica.objective.has_auxiliary and not np.all(info.positives):
                log.warning("client %d has no positive training label for some task; it still takes part "
                            "(its local objective uses the global p)", info.client_id)
        p = (global_positive_ratio(infos) if cfg.positive_ratio is None
             else np.full(self.source.num_tasks, cfg.positive_ratio))
        self.positive_ratio = p
        if self.replica.objective.has_auxiliary:
            self.replica.objective.set_positive_ratio(p)
            self.executor.configure(p)
        state = self.replica.flat.initial_state()
        if self.algorithm.control_variates:
            state.c_v = np.zeros_like(state.v)
            state.c_alpha = np.zeros_like(state.alpha)
        return state

    def _recompute_alpha(self, loop: LoopState) -> None:
        """CODA: alpha <- its closed form from the current v, by one extra round of score sums."""
        state = loop.state
        m = self.executor.score_moments(state)
        loop.bytes_down += self.executor.active_clients * state.nbytes
        loop.bytes_up += sum(x.sum_pos.nbytes + x.num_pos.nbytes + x.sum_neg.nbytes + x.num_neg.nbytes for x in m)
        mean_pos = np.sum([x.sum_pos for x in m], 0) / np.maximum(np.sum([x.num_pos for x in m], 0), 1)
        mean_neg = np.sum([x.sum_neg for x in m], 0) / np.maximum(np.sum([x.num_neg for x in m], 0), 1)
        state.alpha = closed_form_alpha(mean_pos, mean_neg, self.config.objective, self.config.margin).astype(
            np.float32
        )

    def _switch_stage(self, loop: LoopState) -> None:
        """The stage that just ended hands over: CODA's alpha, the new proximal centre, control variates."""
        cfg = self.config
        if self.algorithm.recompute_alpha:
            self._recompute_alpha(loop)
        loop.reference = ((loop.ref_sum / loop.ref_count).astype(np.float32)
                          if cfg.reference_point == "average" and loop.ref_count else loop.state.v.copy())
        loop.ref_sum[:], loop.ref_count = 0.0, 0
        if cfg.reset_control_variates and loop.state.c_v is not None:
            loop.state.c_v = np.zeros_like(loop.state.c_v)
            loop.state.c_alpha = np.zeros_like(loop.state.c_alpha)
        self.executor.begin_stage(loop.reference, cfg.reset_control_variates)
        loop.bytes_down += self.executor.active_clients * loop.reference.nbytes

    def _round(self, loop: LoopState, plan: RoundPlan) -> None:
        cfg = self.config
        t0 = time.perf_counter()
        reducer = self.algorithm.reducer(loop.state)

        def fold(update: ClientUpdate) -> None:
            # each client checks its own update (in parallel, where its buffers live); the driver trusts it
            if not (update.stats.finite and math.isfinite(update.stats.loss)):
                raise DivergenceError(f"round {plan.round}: client {update.client_id} sent a NaN or infinite "
                                      f"update (loss {update.stats.loss}); lower lr or set grad_clip")
            reducer.fold(update)

        self.executor.run_round(loop.state, plan, fold)
        loop.bytes_down += self.executor.active_clients * loop.state.nbytes
        loop.bytes_up += reducer.bytes_up
        state = reducer.finish(steps=plan.steps)
        if not all_finite([torch.from_numpy(x) for x in (state.v, state.alpha, state.buffers)]):
            raise DivergenceError(f"round {plan.round}: the global state became NaN or infinite after the server "
                                  "step; lower lr or global_lr")
        loop.train_s += time.perf_counter() - t0
        loop.samples += sum(s.samples for s in reducer.stats)
        loop.loss_sum += float(np.mean([s.loss for s in reducer.stats]))
        loop.loss_rounds += 1
        if cfg.reference_point == "average":
            loop.ref_sum += state.v
            loop.ref_count += 1
        loop.state = state

    def _record(self, loop: LoopState, evaluator: Evaluator, plan_round: int, stage: int, lr: float,
                started: float) -> dict:
        rec = {
            "iteration": loop.state.iteration, "round": plan_round, "stage": stage, "lr": lr,
            "train_loss": loop.loss_sum / loop.loss_rounds if loop.loss_rounds else None,
            **evaluator(loop.state),
            "bytes_up": loop.bytes_up, "bytes_down": loop.bytes_down,
            "wall_s": round(loop.wall_offset + time.perf_counter() - started, 3),
            "samples_per_s": round(loop.samples / loop.train_s, 1) if loop.train_s else None,
        }
        loop.loss_sum, loop.loss_rounds = 0.0, 0
        loop.history.append(rec)
        log.info("iteration %d round %d stage %d: test AUC %.4f", rec["iteration"], plan_round, stage,
                 rec["test_auc"])
        return rec

    def _checkpoint_payload(self, loop: LoopState, started: float) -> dict:
        loop_payload = loop.to_payload()
        loop_payload["wall_offset"] = loop.wall_offset + time.perf_counter() - started
        return {"config": self.config.to_dict(), "loop": loop_payload, "clients": self.executor.client_states(),
                "positive_ratio": self.positive_ratio, "torch_rng": torch.get_rng_state()}

    # -- the run ----------------------------------------------------------------------
    def run(self, *, run_dir: Path | Callable[[], Path] | None, on_eval: Callable[[dict], None] | None = None,
            progress: bool = False, resume: dict | None = None,
            report: Callable[[dict, Callable[[], dict]], None] | None = None,
            checkpoints: bool = True) -> RunResult:
        """Run (or, with ``resume``, continue) the federation.

        ``run_dir`` may be a function making the folder: it is called only once the
        clients have started, so bad data never leaves a half-made run folder.
        ``report(record, make_checkpoint)`` is called at every evaluation with a function
        that returns the checkpoint payload of that moment (Tune trials report with it, and
        pass ``checkpoints=False``: Tune keeps their checkpoints, not the run folder).
        """
        cfg = self.config
        initial = self._start()
        if callable(run_dir):
            run_dir = run_dir()
        started = time.perf_counter()
        if resume is None:
            loop = LoopState(state=initial, reference=initial.v.copy(),
                             ref_sum=np.zeros_like(initial.v, dtype=np.float64), next_eval=cfg.eval_every)
            self.executor.begin_stage(loop.reference, True)
            loop.bytes_down += self.executor.active_clients * loop.reference.nbytes
        else:
            loop = LoopState.from_payload(resume["loop"])
            self.executor.begin_stage(loop.reference, False)
            self.executor.restore_client_states(resume["clients"])
            torch.set_rng_state(resume["torch_rng"])
        writer = None
        if run_dir is not None:
            writer = RunWriter(run_dir, tensorboard=cfg.tensorboard, history=loop.history)
            writer.write_config(cfg.to_dict())
            if resume is not None:
                writer.event("resumed at round %d, iteration %d", loop.state.round, loop.state.iteration)
        evaluator = Evaluator(self.replica, self.source, self.executor)
        bar = Progress(cfg.iterations, loop.state.iteration) if progress else None

        def record(plan_round: int, stage: int, lr: float) -> dict:
            rec = self._record(loop, evaluator, plan_round, stage, lr, started)
            if writer is not None:
                writer.record(rec)
            if on_eval is not None:
                on_eval(rec)
            if report is not None:
                report(rec, lambda: self._checkpoint_payload(loop, started))
            return rec

        def checkpoint() -> None:
            if writer is not None and checkpoints:
                writer.checkpoint(self._checkpoint_payload(loop, started))

        try:
            if resume is None:
                record(0, 1, cfg.lr)
                checkpoint()  # a run stopped before its first periodic checkpoint can still be resumed
            last_checkpoint = loop.state.round
            schedule = Schedule(cfg, loop.position)
            for plan, starts_stage in schedule.plans():
                if starts_stage:
                    self._switch_stage(loop)
                    if writer is not None:
                        writer.event("stage %d began at iteration %d (round %d)", plan.stage, plan.iteration,
                                     plan.round)
                self._round(loop, plan)
                loop.position = dataclasses.replace(schedule.position)
                auc = None
                if loop.state.iteration >= loop.next_eval or loop.state.iteration >= cfg.iterations:
                    loop.next_eval = (loop.state.iteration // cfg.eval_every + 1) * cfg.eval_every
                    auc = record(plan.round, plan.stage, plan.lr)["test_auc"]
                if cfg.checkpoint_every and plan.round % cfg.checkpoint_every == 0:
                    checkpoint()
                    last_checkpoint = plan.round
                if bar is not None:
                    bar.update(plan, plan.steps, auc)
            if last_checkpoint != loop.state.round:
                checkpoint()
            return self._finish(loop, writer, started)
        except DivergenceError as exc:
            if writer is not None:
                writer.event("run stopped: %s", exc, level=logging.ERROR)
            raise
        finally:
            if bar is not None:
                bar.close()
            if writer is not None:
                writer.close()

    def _finish(self, loop: LoopState, writer: RunWriter | None, started: float) -> RunResult:
        state, history = loop.state, loop.history
        flat = self.replica.flat
        flat.load(state)
        n_w, m = flat.num_weights, flat.aux_size
        a, b = state.v[n_w : n_w + m].copy(), state.v[n_w + m : n_w + 2 * m].copy()
        model_state = flat.model_state_dict()
        aucs = [h["test_auc"] for h in history]
        best = int(np.nanargmax(aucs)) if np.any(np.isfinite(aucs)) else len(history) - 1
        summary = {
            "algorithm": self.config.algorithm,
            "final_test_auc": history[-1]["test_auc"],
            "best_test_auc": history[best]["test_auc"],
            "best_iteration": history[best]["iteration"],
            "iterations": state.iteration,
            "rounds": state.round,
            "bytes_up": loop.bytes_up,
            "bytes_down": loop.bytes_down,
            "wall_s": round(loop.wall_offset + time.perf_counter() - started, 3),
            "samples_per_s": round(loop.samples / loop.train_s, 1) if loop.train_s else None,
            "positive_ratio": [round(float(x), 6) for x in self.positive_ratio],
            "run_dir": None if writer is None else str(writer.dir),
        }
        cv = None if state.c_v is None else (state.c_v, state.c_alpha)
        if writer is not None:
            writer.finish({"model": model_state, "a": torch.from_numpy(a), "b": torch.from_numpy(b),
                           "alpha": torch.from_numpy(state.alpha.copy()),
                           "task_names": list(self.source.task_names)}, summary)
        return RunResult(self.config, model_state, a, b, state.alpha.copy(), cv, history, summary, state,
                         None if writer is None else writer.dir)


def run(
    config,
    *,
    source: DataSource | None = None,
    executor: Executor | None = None,
    save: bool = True,
    on_eval: Callable[[dict], None] | None = None,
    progress: bool = False,
    initial_model_state: dict[str, torch.Tensor] | None = None,
) -> RunResult:
    """Train one federation as ``config`` says and return its :class:`RunResult`.

    Args:
        config: a validated :class:`fdam_ray.config.Config`.
        source: the data (default: the dataset the config names).
        executor: how clients run (default: the config's ``executor``).
        save: write a run folder (see :mod:`fdam_ray.outputs`) under ``config.out_dir``.
        on_eval: called with every evaluation record as it is made.
        progress: show a progress bar over iterations.
        initial_model_state: network weights to start from (a ``state_dict``; default: the
            ``model_weights`` file if set, else the seeded initialisation). With
            ``pretrain_iterations`` > 0 they start the pre-training run (:mod:`fdam_ray.pretrain`),
            and this run starts from its body with a fresh classifier head.
    """
    source = source if source is not None else make_source(config)
    if source.num_clients != config.num_clients:
        raise ValueError(f"the data has {source.num_clients} clients but num_clients={config.num_clients}")
    weights_from = "initial_model_state"
    if initial_model_state is None and config.model_weights:
        initial_model_state = read_weights(config.model_weights)
        weights_from = f"model_weights '{config.model_weights}'"
    pretrained = None
    if config.pretrain_iterations:
        from fdam_ray.pretrain import pretrain

        pretrained, initial_model_state = pretrain(config, source=source, save=save, progress=progress,
                                                   initial_model_state=initial_model_state)
        weights_from = "pre-trained weights"
    executor = executor if executor is not None else make_executor(config.executor)
    with executor:
        fed = Federation(config, source, executor)
        if initial_model_state is not None:
            load_weights(fed.replica.flat.model, initial_model_state, source=weights_from)
        result = fed.run(run_dir=(lambda: make_run_dir(config)) if save else None, on_eval=on_eval, progress=progress)
    result.pretrain = pretrained
    return result


def resume(
    run_dir: str | Path,
    changes: dict | None = None,
    *,
    source: DataSource | None = None,
    on_eval: Callable[[dict], None] | None = None,
    progress: bool = False,
) -> RunResult:
    """Continue the run in ``run_dir`` from its last checkpoint.

    ``changes`` may alter only fields in :data:`fdam_ray.config.RESUME_MAY_CHANGE`
    (how the run executes, or a longer ``iterations``); anything else means a
    different run and is refused.
    """
    from fdam_ray.checkpoint import load_checkpoint
    from fdam_ray.config import RESUME_MAY_CHANGE, ConfigError, build_config

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"--resume: '{run_dir}' is not a run folder")
    if not (run_dir / "checkpoint.pt").exists():
        raise ValueError(f"--resume: '{run_dir}' has no checkpoint.pt (not a run folder, or its run stopped "
                         "before the first checkpoint)")
    payload = load_checkpoint(run_dir / "checkpoint.pt")
    saved = build_config(payload["config"])
    changes = dict(changes or {})
    wanted = build_config({**saved.to_dict(), **changes})
    differ = [k for k in saved.to_dict() if saved.to_dict()[k] != wanted.to_dict()[k] and k not in RESUME_MAY_CHANGE]
    if differ:
        detail = ", ".join(f"{k}: {getattr(saved, k)!r} -> {getattr(wanted, k)!r}" for k in differ)
        raise ConfigError(f"cannot resume '{run_dir}' with a different config ({detail}); only "
                          f"{', '.join(sorted(RESUME_MAY_CHANGE))} may change")
    source = source if source is not None else make_source(wanted)
    with make_executor(wanted.executor) as executor:
        return Federation(wanted, source, executor).run(run_dir=run_dir, on_eval=on_eval, progress=progress,
                                                         resume=payload)
