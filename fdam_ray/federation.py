"""The driver loop: rounds, stages, evaluation, metrics and run outputs.

One round (ALGORITHMS.md s.3): the executor runs every client from the global
state, the :class:`RoundReducer` folds their updates as they arrive and
applies the server step. At a stage end the proximal centre moves (to the
average of the stage's round-end global iterates, or the last one), CODA
recomputes alpha in closed form, and control variates are zeroed unless the
config keeps them. A new stage starts from the last global iterate (the
paper's analysis restarts from the stage output; with the default
``reference_point: average`` the two differ only in the start point, and
restarting a deep network from an average of iterates would also need its
BatchNorm statistics recomputed).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import yaml

from fdam_ray.algorithms import Algorithm
from fdam_ray.client import Replica, resolve_device
from fdam_ray.data import DataSource, make_source
from fdam_ray.evaluation import Evaluator
from fdam_ray.executors import Executor, make_executor
from fdam_ray.objectives import closed_form_alpha
from fdam_ray.schedules import Schedule
from fdam_ray.state import ClientInfo, GlobalState

log = logging.getLogger(__name__)


class DivergenceError(RuntimeError):
    """The global state or a client's loss became NaN or infinite."""


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


def global_positive_ratio(infos: list[ClientInfo]) -> np.ndarray:
    """p per task: all clients' positives over all clients' labelled samples."""
    pos = np.sum([i.positives for i in infos], axis=0).astype(np.float64)
    lab = np.sum([i.labelled for i in infos], axis=0).astype(np.float64)
    for t, (n_pos, n_lab) in enumerate(zip(pos, lab, strict=True)):
        if n_pos == 0 or n_pos == n_lab:
            side = "positive" if n_pos == 0 else "negative"
            raise ValueError(f"task {t}: no client has a {side} training label, so AUC cannot be optimised")
    return pos / lab


def make_run_dir(config) -> Path:
    """Create the run folder (refusing to reuse a non-empty one)."""
    root = Path(config.out_dir)
    if config.run_name:
        path = root / config.run_name
        if path.exists() and any(path.iterdir()):
            raise ValueError(f"run folder '{path}' already exists and is not empty; choose another run_name")
    else:
        base = f"{datetime.now():%Y%m%d-%H%M%S}-{config.algorithm}-{config.dataset}"
        path, n = root / base, 1
        while path.exists():
            path, n = root / f"{base}-{n}", n + 1
    path.mkdir(parents=True, exist_ok=True)
    return path


class Federation:
    """Runs one federation from a config; see :func:`run`."""

    def __init__(self, config, source: DataSource, executor: Executor) -> None:
        self.config = config
        self.source = source
        self.executor = executor
        self.algorithm = Algorithm.from_config(config)
        self.replica = Replica(config, source, device=resolve_device(config.device))
        self.num_clients = source.num_clients

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
        self.infos = infos
        state = self.replica.flat.initial_state()
        if self.algorithm.control_variates:
            state.c_v = np.zeros_like(state.v)
            state.c_alpha = np.zeros_like(state.alpha)
        return state

    def _recompute_alpha(self, state: GlobalState) -> None:
        m = self.executor.score_moments(state)
        mean_pos = np.sum([x.sum_pos for x in m], 0) / np.maximum(np.sum([x.num_pos for x in m], 0), 1)
        mean_neg = np.sum([x.sum_neg for x in m], 0) / np.maximum(np.sum([x.num_neg for x in m], 0), 1)
        state.alpha = closed_form_alpha(mean_pos, mean_neg, self.config.objective, self.config.margin).astype(
            np.float32
        )

    def run(self, *, save: bool, on_eval: Callable[[dict], None] | None = None) -> RunResult:
        cfg = self.config
        state = self._start()
        run_dir = make_run_dir(cfg) if save else None
        metrics_file = None
        if run_dir is not None:
            (run_dir / "config.yaml").write_text(yaml.safe_dump(_plain(cfg.to_dict()), sort_keys=False))
            metrics_file = open(run_dir / "metrics.jsonl", "w", encoding="utf-8")
        evaluator = Evaluator(self.replica, self.source, self.executor)
        history: list[dict] = []
        bytes_up = bytes_down = samples = 0
        train_s = 0.0
        loss_sum, loss_rounds = 0.0, 0
        started = time.perf_counter()
        K = self.num_clients

        def record(plan_round: int, stage: int, lr: float) -> None:
            nonlocal loss_sum, loss_rounds
            rec = {
                "iteration": state.iteration, "round": plan_round, "stage": stage, "lr": lr,
                "train_loss": loss_sum / loss_rounds if loss_rounds else None,
                **evaluator(state),
                "bytes_up": bytes_up, "bytes_down": bytes_down,
                "wall_s": round(time.perf_counter() - started, 3),
                "samples_per_s": round(samples / train_s, 1) if train_s else None,
            }
            loss_sum, loss_rounds = 0.0, 0
            history.append(rec)
            log.info("iteration %d round %d stage %d: test AUC %.4f", rec["iteration"], plan_round, stage,
                     rec["test_auc"])
            if metrics_file is not None:
                metrics_file.write(json.dumps(rec) + "\n")
                metrics_file.flush()
            if on_eval is not None:
                on_eval(rec)

        try:
            reference = state.v.copy()
            self.executor.begin_stage(reference, True)
            bytes_down += K * reference.nbytes
            ref_sum, ref_count = np.zeros_like(state.v, dtype=np.float64), 0
            record(0, 1, cfg.lr)
            next_eval = cfg.eval_every
            plan = None
            for plan, ends_stage in Schedule(cfg).plans():
                t0 = time.perf_counter()
                reducer = self.algorithm.reducer(state)
                self.executor.run_round(state, plan, reducer.fold)
                bytes_down += K * state.nbytes
                bytes_up += reducer.bytes_up
                state = reducer.finish(steps=plan.steps)
                train_s += time.perf_counter() - t0
                samples += sum(s.samples for s in reducer.stats)
                losses = [s.loss for s in reducer.stats]
                if not (np.isfinite(losses).all() and np.isfinite(state.v).all() and np.isfinite(state.alpha).all()):
                    bad = [s.client_id for s in reducer.stats if not np.isfinite(s.loss)]
                    raise DivergenceError(
                        f"round {plan.round}: the state became NaN or infinite"
                        + (f" (loss of client(s) {bad})" if bad else "") + "; lower lr or set grad_clip"
                    )
                loss_sum += float(np.mean(losses))
                loss_rounds += 1
                if cfg.reference_point == "average":
                    ref_sum += state.v
                    ref_count += 1
                if ends_stage:
                    if self.algorithm.recompute_alpha:
                        self._recompute_alpha(state)
                    reference = (ref_sum / ref_count).astype(np.float32) if cfg.reference_point == "average" \
                        else state.v.copy()
                    ref_sum[:], ref_count = 0.0, 0
                    if cfg.reset_control_variates and state.c_v is not None:
                        state.c_v = np.zeros_like(state.c_v)
                        state.c_alpha = np.zeros_like(state.c_alpha)
                    self.executor.begin_stage(reference, cfg.reset_control_variates)
                    bytes_down += K * reference.nbytes
                if state.iteration >= next_eval or state.iteration >= cfg.iterations:
                    record(plan.round, plan.stage, plan.lr)
                    next_eval = (state.iteration // cfg.eval_every + 1) * cfg.eval_every
        finally:
            if metrics_file is not None:
                metrics_file.close()
        return self._finish(state, history, run_dir, started, train_s, samples)

    def _finish(self, state, history, run_dir, started, train_s, samples) -> RunResult:
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
            "bytes_up": history[-1]["bytes_up"],
            "bytes_down": history[-1]["bytes_down"],
            "wall_s": round(time.perf_counter() - started, 3),
            "samples_per_s": round(samples / train_s, 1) if train_s else None,
            "positive_ratio": [round(float(x), 6) for x in self.positive_ratio],
            "run_dir": None if run_dir is None else str(run_dir),
        }
        cv = None if state.c_v is None else (state.c_v, state.c_alpha)
        if run_dir is not None:
            torch.save(
                {"model": model_state, "a": torch.from_numpy(a), "b": torch.from_numpy(b),
                 "alpha": torch.from_numpy(state.alpha.copy()), "task_names": list(self.source.task_names)},
                run_dir / "model.pt",
            )
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return RunResult(self.config, model_state, a, b, state.alpha.copy(), cv, history, summary, state, run_dir)


def _plain(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def run(
    config,
    *,
    source: DataSource | None = None,
    executor: Executor | None = None,
    save: bool = True,
    on_eval: Callable[[dict], None] | None = None,
) -> RunResult:
    """Train one federation as ``config`` says and return its :class:`RunResult`.

    Args:
        config: a validated :class:`fdam_ray.config.Config`.
        source: the data (default: the dataset the config names).
        executor: how clients run (default: the config's ``executor``).
        save: write the run folder (config, metrics.jsonl, model.pt, summary.json).
        on_eval: called with every evaluation record as it is made.
    """
    source = source if source is not None else make_source(config)
    if source.num_clients != config.num_clients:
        raise ValueError(f"the data has {source.num_clients} clients but num_clients={config.num_clients}")
    executor = executor if executor is not None else make_executor(config.executor)
    with executor:
        return Federation(config, source, executor).run(save=save, on_eval=on_eval)
