"""The paper's outer loop (Yuan et al. 2021, Alg. 1 and 3): stages of communication rounds, with evaluation.

    start the K clients; p from their label counts; their weights; server state of round 0
    for each round of the schedule:
        at the first round of a new stage: end the last stage (CODA: alpha from one round of score sums)
        every client (or the round's sample of S clients) runs I local steps from the global state;
            the server folds the updates as they arrive
        the server adopts the new global state (and adds it to the stage's running sum)
        evaluate every eval_every iterations and at the end

This module only orchestrates. Each equation lives in one place under :mod:`fdam_ray.algorithms` (see
its docstring for the map); the executor runs the clients; what is written, shown or reported hangs off
one :class:`~fdam_ray.outputs.Observer`. Assembling a federation from a config (data, executor, initial
weights, pre-training, resume, outputs) is :mod:`fdam_ray.assembly.recipe`'s job.

Everything the loop carries from round to round is in
:class:`~fdam_ray.checkpoint.LoopState`; a :class:`~fdam_ray.checkpoint.Checkpoint`
is that, the clients' states (control variates, sampler positions) and the
config, so a resumed run continues the same run.
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

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.algorithms.stages import score_sums_nbytes
from fdam_ray.checkpoint import Checkpoint, LoopState
from fdam_ray.clients.client import Replica
from fdam_ray.clients.inputs import all_finite
from fdam_ray.core.schedules import Position, Schedule, ScheduleSection
from fdam_ray.core.state import ClientUpdate, GlobalState, RoundPlan, StepStats, reads_store_arrays
from fdam_ray.data import DataSource
from fdam_ray.executors import Executor
from fdam_ray.executors.base import ExecutorSetup, RunsOfRounds
from fdam_ray.executors.deadlines import MissedRounds, as_sampled_round
from fdam_ray.executors.errors import PlacementError
from fdam_ray.features.sites import client_label
from fdam_ray.loop.evaluation import Evaluator
from fdam_ray.loop.one_at_a_time import one_federation_at_a_time
from fdam_ray.loop.plug import Plug, PlugStart
from fdam_ray.loop.summary import (
    RunResult,
    control_variates,
    keep_best,
    model_payload,
    run_summary,
    selected_evaluation,
    warn_if_test_set_changed,
)
from fdam_ray.loop.unplaced import checkpoint_unplaced, note_rebuilt, rebuilt_states
from fdam_ray.models import network_record
from fdam_ray.objectives import global_positive_ratio
from fdam_ray.outputs import Observer, RunStart, Snapshot

reads_store_arrays(__name__)  # the driver only checks the states fetched from the store for finiteness
log = logging.getLogger(__name__)


class DivergenceError(RuntimeError):
    """The global state, a client's update or its loss became NaN or infinite."""


class Federation:
    """Runs one assembled federation (see :mod:`fdam_ray.assembly.recipe` for the assembly).

    Args:
        source: the data source spec (the driver reads only its test part, and only when clients do not score it).
        executor: how the clients run.
        setup: what the executor runs its clients by (cut from the config at the top): the built algorithm, the
            client section (the driver's replica is built from it too) and the deadline section.
        schedule: the schedule's section.
        eval_every: evaluate every this many iterations (at the first round end after it) and at the end.
        driver_device: where the driver's replica lives (it loads states and, when asked, scores the test set).
        observer: what the run reports to (run folder, progress bar, callbacks, Tune).
        plug: the mechanisms acting on the run (:mod:`fdam_ray.loop.plug`; differential privacy), called at its
            hooks; the default does nothing.
        histogram_bins: B when the clients send score histograms (``test_scores: histogram``), else None.
        forced: a participation record to replay (round -> clients), read and checked at the top.
        rebuilds: the record's rebuilt clients (round -> clients, :mod:`fdam_ray.executors.rebuilds`), rebuilt then.
        positive_ratio: the objective's p where the config fixes it, else None (the global p from the clients').
        select_by: the validation figure selecting the best evaluation (``val_auc``, ``val_pauc``, ``val_tpauc``).
    """

    def __init__(self, *, source: DataSource, executor: Executor, setup: ExecutorSetup, schedule: ScheduleSection,
                 eval_every: int, driver_device: torch.device, observer: Observer, plug: Plug | None = None,
                 histogram_bins: int | None = None, forced: dict[int, list[int]] | None = None,
                 rebuilds: dict[int, list[int]] | None = None, positive_ratio: float | None = None,
                 select_by: str = "val_auc") -> None:
        self.source = source
        self.executor = executor
        self.setup, self.client, self.algorithm = setup, setup.client, setup.algorithm
        self.positive_ratio_override = positive_ratio
        self.schedule = schedule
        self.eval_every = eval_every
        self.observer = observer
        self.replica = Replica(setup.client, source, device=driver_device)
        self.validation, self.select_by = setup.client.val_fraction > 0, select_by  # select on validation parts
        self.deadlines = setup.deadline
        self.forced, self.rebuilds = forced or {}, rebuilds or {}
        self.missed = MissedRounds(cut_by=self.deadlines.cut_by)
        self._unrecorded: dict[str, list[int]] = {}  # rounds recorded since the last metrics record
        self.plug, self.histogram_bins = Plug() if plug is None else plug, histogram_bins

    def _label(self, client_id: int) -> str:
        """How a client is shown: its name (``client_names``), else its index."""
        return client_label(client_id, self.client.client_names)

    # -- start -----------------------------------------------------------------------
    def _start(self, plug_state: dict | None = None) -> GlobalState:
        """Start the clients, fix the global p, and return the initial global state (from the replica)."""
        setup = self.plug.setup(self.setup, PlugStart(self.executor, self.source, self.replica.flat, plug_state))
        infos = self.executor.start(setup, self.source)
        size = self.replica.flat.state_size
        for info in infos:
            if info.state_size != size:
                raise RuntimeError(f"client {self._label(info.client_id)} has {info.state_size} model values, the "
                                   f"driver {size}")
            if self.replica.objective.has_auxiliary and not np.all(info.positives):
                log.warning("client %s has no positive training label for some task; it still takes part "
                            "(its local objective uses the global p)", self._label(info.client_id))
        p = (global_positive_ratio([i.positives for i in infos], [i.labelled for i in infos])
             if self.positive_ratio_override is None
             else np.full(self.source.num_tasks, self.positive_ratio_override))
        self.positive_ratio = p
        self.num_clients = len(infos)
        self.plug.started([i.num_train for i in infos])
        self.client_weights = self.algorithm.weights([i.num_train for i in infos])
        self.sampler = self.plug.sampler(self.algorithm.sampler(self.num_clients, self.client.seed))
        if self.replica.objective.has_auxiliary:
            self.replica.objective.set_positive_ratio(p)
            self.executor.configure(p)
        return self.replica.flat.initial_state()

    # -- one stage end, one round ------------------------------------------------------
    def _end_stage(self, loop: LoopState) -> None:
        alpha = None
        if self.algorithm.needs_score_sums:  # CODA: one extra round of score sums
            sums = self.executor.score_sums(loop.state)
            loop.bytes_down += self.executor.active_clients * loop.state.nbytes
            loop.bytes_up += score_sums_nbytes(sums)
            alpha = self.algorithm.stage_alpha(sums, self.positive_ratio, self.client_weights)
        self.algorithm.end_stage(loop.server, alpha=alpha)
        self.executor.begin_stage(loop.server.reference, self.algorithm.reset_control_variates)
        loop.bytes_down += self.executor.active_clients * loop.server.reference.nbytes

    def _participants(self, plan: RoundPlan) -> tuple[RoundPlan, list[int] | None, list[int] | None]:
        """The round's plan (marked partial for a sampled round, with what the plug carries to the clients), its
        sampled clients and the clients it runs (a replayed record's set, else the sample; None: every client)."""
        sampled = self.sampler.draw(plan.round)
        clients = self.forced.get(plan.round, sampled)  # a replayed record's set
        if clients is not None:  # a sampled round: c stays the mean over all clients (s.3b)
            plan = dataclasses.replace(plan, partial=True)
        return self.plug.round_plan(plan), sampled, clients

    def _check_updates(self, round_index: int, stats: list[StepStats]) -> None:
        """Each client checks its own update (in parallel, where its buffers live); the driver reads the flag."""
        for st in stats:
            if not (st.finite and math.isfinite(st.loss)):
                raise DivergenceError(f"round {round_index}: client {self._label(st.client_id)} sent a NaN or "
                                      f"infinite update (loss {st.loss}); lower lr or set grad_clip")

    def _round(self, loop: LoopState, plan: RoundPlan) -> None:
        t0 = time.perf_counter()
        self.algorithm.before_round(self.executor, loop, self.positive_ratio)  # pAUC: the normaliser's count pass
        plan, sampled, clients = self._participants(plan)
        total = None if clients is None else self.algorithm.drift.total_weight(self.num_clients, self.client_weights)
        reducer = self.plug.reducer(self.algorithm.reducer(loop.state, weights=self.client_weights,
                                                           partial_total=total), plan)

        def fold(update: PartialSum | ClientUpdate) -> None:
            self._check_updates(plan.round, update.stats if isinstance(update, PartialSum) else [update.stats])
            reducer.fold(update)

        asked = self.executor.active_clients
        if plan.round in self.rebuilds:  # a replayed record's rebuilt clients: fresh, c^k = this round's c
            self.executor.rebuild(self.rebuilds[plan.round], loop.state)
        if clients is None:
            self.executor.run_round(loop.state, plan, fold)
        else:
            self.executor.run_round(loop.state, plan, fold, clients)
        if self.deadlines.round_deadline is not None and not plan.partial and reducer.count < asked:
            # a client missed the deadline of a round every client ran: fold it as a round of those that made it
            drift = self.algorithm.drift
            as_sampled_round(reducer, self.executor, plan.round,
                             drift.total_weight(self.num_clients, self.client_weights), drift)
        if self.deadlines.tolerant or self.executor.leaves_clients_out:
            self._note_participants(loop, plan.round, sampled, clients, [st.client_id for st in reducer.stats])
        note_rebuilt(loop, self.executor)
        state = reducer.finish(steps=plan.steps)
        if not all_finite([torch.from_numpy(x) for x in (state.v, state.alpha, state.buffers)]):
            raise _state_diverged(plan.round)
        self._count(loop, clients, reducer.count, reducer.bytes_up, reducer.stats)
        self.plug.after_round(plan, clients, reducer.count)
        loop.privacy = self.plug.state()
        loop.train_s += time.perf_counter() - t0
        self.algorithm.after_round(loop.server, state)

    def _count(self, loop: LoopState, clients: list[int] | None, count: int, bytes_up: int,
               stats: list[StepStats]) -> None:
        """What a round adds to the loop's counters: the bytes its broadcast sent (to every active client, or to
        the ``count`` sampled ones that took part), the bytes its clients sent, samples, and its mean loss."""
        sent = self.executor.broadcast_nbytes(loop.state)  # rounded transfers move fewer bytes
        loop.bytes_down += (self.executor.active_clients if clients is None else count) * sent
        loop.bytes_up += bytes_up
        loop.samples += sum(st.samples for st in stats)
        if stats:  # a noise-only round (an empty Poisson draw under dp: client) has no loss to average
            loop.loss_sum += float(np.mean([st.loss for st in stats]))
            loop.loss_rounds += 1

    def _rounds(self, executor: RunsOfRounds, loop: LoopState, run: list[tuple[RoundPlan, Position]],
                done: Callable[[RoundPlan, Position, bool], None], read: bool) -> int:
        """Run ``run`` (plans, each with the schedule's position after it) in one go on the executor
        (:meth:`~fdam_ray.executors.base.Executor.run_rounds`): the server step is applied where the clients are
        and the driver receives the state once, after the last applied round. Calls ``done(plan, position, last)``
        for every applied round, in order; returns how many were applied: all, or none when an actor failed in the
        run (the executor undid it; its rounds then run one at a time, :meth:`_round`); ``read``: the driver reads
        the state after the run (:meth:`_ends_run`, or a stage ends)."""
        t0 = time.perf_counter()
        self.algorithm.before_round(self.executor, loop, self.positive_ratio)  # pAUC: once per run of rounds
        drawn = [self._participants(plan) for plan, _ in run]  # (plan, sampled, clients)
        planned = [(plan, clients) for plan, _, clients in drawn]
        out = executor.run_rounds(loop.state, planned, self.algorithm.reference_point == "average", read=read)
        for i in range(out.applied):
            (plan, clients), stats = planned[i], out.stats[i]
            self._check_updates(plan.round, stats)
            self._count(loop, clients, out.counts[i], out.bytes_up[i], stats)
            if self.deadlines.tolerant:  # a deadline the members keep (transport: collective), or a replay
                self._note_participants(loop, plan.round, drawn[i][1], clients, [st.client_id for st in stats])
        if out.stop == "stale":  # the state after the last applied round: not adopted, as a round at a time
            raise _state_diverged(planned[out.applied - 1][0].round)
        note_rebuilt(loop, self.executor)
        if out.applied:
            assert out.state is not None
            self.algorithm.after_rounds(loop.server, out.state, out.ref_sum, out.applied)
        loop.train_s += time.perf_counter() - t0
        for i in range(out.applied):
            done(run[i][0], run[i][1], i == out.applied - 1)
        if out.stop == "diverged":  # the round after the applied ones: a client's update was not finite
            self._check_updates(planned[out.applied][0].round, out.stats[out.applied])
            raise RuntimeError(f"round {planned[out.applied][0].round} stopped a run of rounds as not finite, but "
                               "every client's update was")
        return out.applied

    def _note_participants(self, loop: LoopState, round_index: int, sampled: list[int] | None,
                           asked: list[int] | None, took_part: list[int]) -> None:
        """Record a round whose participants were not the ``sampled`` plan's (in the checkpoint and the next
        metrics record), and name a client that keeps missing the deadline among those ``asked``."""
        every = list(range(self.num_clients))
        made = sorted(set(took_part))
        if made != sorted(every if sampled is None else sampled):
            loop.participation[str(round_index)] = made
            self._unrecorded[str(round_index)] = made
        self.missed.round(round_index, every if asked is None else asked, made, self._label)

    # -- evaluation and checkpoints ------------------------------------------------------
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
        rec.update(self.plug.record())  # dp: dp_epsilon, dp_delta
        loop.privacy = self.plug.state()  # an evaluation may have counted releases (dp_eval)
        if self.deadlines.tolerant or self.executor.leaves_clients_out:  # rounds since the last record, not as planned
            rec["participation"] = " ".join(f"r{r}={','.join(map(str, ks))}" for r, ks in self._unrecorded.items())
            self._unrecorded = {}
        loop.loss_sum, loop.loss_rounds = 0.0, 0
        warn_if_test_set_changed(loop.history, rec)
        loop.history.append(rec)
        if self.validation:
            keep_best(loop, rec, self.select_by)
            log.info("iteration %d round %d stage %d: val AUC %.4f, test AUC %.4f", rec["iteration"], plan_round,
                     stage, rec["val_auc"], rec["test_auc"])
        else:
            log.info("iteration %d round %d stage %d: test AUC %.4f", rec["iteration"], plan_round, stage,
                     rec["test_auc"])
        return rec

    def _snapshot(self, loop: LoopState, started: float) -> Snapshot:
        """A function returning the checkpoint of this moment (the observers add the config). It shares the loop's
        arrays, so it is written before the next round changes them."""

        def checkpoint() -> Checkpoint:
            now = dataclasses.replace(loop, wall_offset=loop.wall_offset + time.perf_counter() - started,
                                      transfer=self.executor.transfer_state())
            clients = self.executor.client_states()  # None for a dropped client
            return Checkpoint(loop=now, clients=clients, positive_ratio=self.positive_ratio,
                              torch_rng=torch.get_rng_state())

        return checkpoint

    # -- the run ----------------------------------------------------------------------
    def run(self, *, resume: Checkpoint | None = None) -> RunResult:
        """Run (or, with ``resume``, a checkpoint, continue) the federation (one at a time in a process:
        :func:`~fdam_ray.loop.one_at_a_time.one_federation_at_a_time`)."""
        with one_federation_at_a_time():
            return self._run(resume)

    def _run(self, resume: Checkpoint | None) -> RunResult:
        initial = self._start(None if resume is None else resume.loop.privacy)
        started = time.perf_counter()
        if resume is None:
            loop = LoopState(server=self.algorithm.init(initial), next_eval=self.eval_every)
            self.executor.begin_stage(loop.server.reference, True)
            loop.bytes_down += self.executor.active_clients * loop.server.reference.nbytes
        else:
            loop = dataclasses.replace(resume.loop, participation=dict(resume.loop.participation),  # its counters
                                       rebuilt=dict(resume.loop.rebuilt))  # change; the checkpoint keeps its own
            self.executor.begin_stage(loop.server.reference, False)
            # the executors take None for a client that starts afresh (annotated list[dict])
            self.executor.restore_client_states(rebuilt_states(resume.clients, loop.state, self.algorithm.drift))
            self.executor.restore_transfer_state(loop.transfer)
            torch.set_rng_state(resume.torch_rng)
        snapshot = self._snapshot(loop, started)
        observer = self.observer
        error: BaseException | None = None
        try:  # every observer closes however the run ends, also when one fails to start
            observer.start(RunStart(resumed=resume is not None, history=loop.history, round=loop.state.round,
                                    iteration=loop.state.iteration, iterations=self.schedule.iterations))
            for k in [] if resume is None else resume.unplaced_clients():
                observer.event("client %s could not be placed when the checkpoint was written; it starts again "
                               "from its shard with the global control variate", self._label(k),
                               level=logging.WARNING)
            for line in self.executor.placement_lines():  # where each client runs (Ray)
                observer.event("%s", line)
            evaluator = Evaluator(self.replica, self.source, self.executor, validation=self.validation,
                                  histogram_bins=self.histogram_bins, plug=self.plug)
            if resume is None:
                observer.record(self._record(loop, evaluator, 0, 1, self.schedule.lr, started), snapshot)
            schedule = Schedule(self.schedule, loop.position)
            plans = schedule.plans()
            runs = self.executor if isinstance(self.executor, RunsOfRounds) and self.plug.runs_of_rounds else None
            ahead = 1 if runs is None else runs.rounds_ahead()

            def pull() -> tuple[RoundPlan, bool, Position] | None:
                got = next(plans, None)
                return None if got is None else (*got, dataclasses.replace(schedule.position))

            def done(plan: RoundPlan, position: Position, last: bool = True) -> None:
                loop.position = position
                rec = None
                if last and (loop.state.iteration >= loop.next_eval
                             or loop.state.iteration >= self.schedule.iterations):
                    loop.next_eval = (loop.state.iteration // self.eval_every + 1) * self.eval_every
                    rec = self._record(loop, evaluator, plan.round, plan.stage, plan.lr, started)
                    observer.record(rec, snapshot)
                observer.round_end(plan, rec, snapshot if last else None)

            waiting = pull()
            while waiting is not None:
                plan, starts_stage, position = waiting
                if self._stops_before(loop, evaluator, plan, started):
                    break
                if starts_stage:
                    self._end_stage(loop)
                    observer.event("stage %d began at iteration %d (round %d)", plan.stage, plan.iteration,
                                   plan.round)
                run, waiting = [(plan, position)], None
                while len(run) < ahead and not self._ends_run(loop, run[-1][0]):  # a run of rounds (collective)
                    waiting = pull()
                    if waiting is None or waiting[1]:  # a new stage: the driver ends the old one first
                        break
                    run.append(waiting[::2])
                    waiting = None
                read = waiting is not None or self._ends_run(loop, run[-1][0])  # a stage ends, or _ends_run
                applied = (self._rounds(runs, loop, run, done, read)
                           if runs is not None and (len(run) > 1 or runs.runs_every_round()) else 0)
                for plan, position in run[applied:]:  # one at a time (also a run that an actor's failure undid)
                    try:
                        self._round(loop, plan)
                    except PlacementError as exc:
                        self._stop_unplaced(exc, loop, plan, position.stage_rounds - 1, started)
                        raise
                    done(plan, position)
                if waiting is None:
                    waiting = pull()
            return self._finish(loop, started, snapshot)
        except BaseException as exc:
            error = exc
            raise
        finally:
            observer.close(error)

    def _stops_before(self, loop: LoopState, evaluator: Evaluator, plan: RoundPlan, started: float) -> bool:
        """A plug's stop before round ``plan.round`` (dp_max_epsilon: one line; the state evaluated)."""
        line = self.plug.before_round(plan, self.sampler.draw(plan.round))
        if line is None:
            return False
        self.observer.event("%s", line, level=logging.WARNING)
        if loop.history and loop.history[-1]["iteration"] != loop.state.iteration:
            self.observer.record(self._record(loop, evaluator, plan.round - 1, plan.stage, plan.lr, started),
                                 self._snapshot(loop, started))
        return True

    def _ends_run(self, loop: LoopState, plan: RoundPlan) -> bool:
        """Whether the driver needs the global state after ``plan``: an evaluation, the last round, a checkpoint."""
        after = plan.iteration + plan.steps
        return (after >= loop.next_eval or after >= self.schedule.iterations
                or self.observer.needs_state(plan.round))

    def _stop_unplaced(self, exc: PlacementError, loop: LoopState, plan: RoundPlan, stage_rounds: int,
                       started: float) -> None:
        """Clients lost mid-round cannot be placed again: checkpoint the state round ``plan.round`` started from
        (the loop has not changed it; its stage, if the round began one, has begun), see
        :func:`~fdam_ray.loop.unplaced.checkpoint_unplaced`."""
        at_start = dataclasses.replace(loop, position=Position(done=plan.iteration, round=plan.round - 1,
                                                               stage=plan.stage, stage_rounds=stage_rounds))
        checkpoint_unplaced(exc, self.observer, plan.round, self._snapshot(at_start, started))

    def _finish(self, loop: LoopState, started: float, snapshot: Snapshot) -> RunResult:
        state, history = loop.state, loop.history
        best = selected_evaluation(loop, validation=self.validation, by=self.select_by)
        if self.validation and loop.best_val_state is not None:
            self.observer.best_model(self._model_payload(loop.best_val_state), history[best])
        payload = self._model_payload(state)  # the final state, loaded last: the replica holds it
        model_state, a, b = payload["model"], payload["a"].numpy(), payload["b"].numpy()
        summary = run_summary(loop, best, algorithm=self.algorithm.preset.name, validation=self.validation,
                              started=started, positive_ratio=self.positive_ratio,
                              client_names=self.client.client_names, by=self.select_by)
        summary.update(self.plug.summary())
        cv = control_variates(state)
        self.observer.finish(summary, payload, snapshot)
        run_dir = summary["run_dir"]
        return RunResult(None, model_state, a, b, state.alpha.copy(), cv, history, summary, state,
                         None if run_dir is None else Path(run_dir))

    def _model_payload(self, state: GlobalState) -> dict:
        """``model.pt``'s payload of ``state`` (:func:`~fdam_ray.loop.summary.model_payload`)."""
        return model_payload(self.replica.flat, state, self.source,
                             network_record(self.client, self.source.input_shape, self.source.num_tasks))


def _state_diverged(round_index: int) -> DivergenceError:
    return DivergenceError(f"round {round_index}: the global state became NaN or infinite after the server step; "
                           "lower lr or global_lr")

