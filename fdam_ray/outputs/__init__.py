"""A run folder and what goes into it.

    config.yaml      the resolved config (reloads to the same run); mode 0600, as train.log and checkpoint.pt
    metrics.jsonl    one JSON record per evaluation
    metrics.csv      the same, flattened (task_auc.<task>, client_auc.<id> columns)
    train.log        one line per evaluation, plus events (stage switches, why a run stopped) and the package's
                     warnings while the run writes (client actors replaced or dropped); credentials in any URI a
                     line names are replaced by *** (fdam_ray.settings.redact)
    events/          TensorBoard event files (tensorboard: auto, the default, writes them where the tensorboard
                     package is installed)
    checkpoint.pt    the latest checkpoint (atomic, versioned; see fdam_ray.checkpoint)
    model.pt         the final model: {"model": state_dict, "a", "b", "alpha", "task_names"}
    best_model.pt    with val_fraction > 0: the model at the best validation AUC (model.pt's format)
    summary.json     best and final test AUC (with val_fraction > 0: best_* selected by select_by), rounds, bytes
                     moved, wall time, samples/s; strict JSON: a number that is not defined (the AUC of samples of
                     one class, NaN) is null, and its key in ``notes`` says why
    .lock            who writes the folder now (pid, host, start); see :mod:`fdam_ray.files.runlock`
    recipe.yaml      stage 1 of a two-stage run: the whole run's config and stage 2's folder
                     (:mod:`fdam_ray.assembly.pretrain`)

Everything a run writes, shows or reports hangs off one :class:`Observer`
interface: the run folder (:class:`RunFolder`, which also decides when a
checkpoint is written), the progress bar (:class:`Progress`), a per-evaluation
callback (:class:`EvalCallback`) and a Ray Tune trial's reports
(:mod:`fdam_ray.tuning.trial`). The driver loop calls the hooks; it holds no
output flags of its own.

By concern:

    observer.py      the Observer hooks, their fan-out (Observers), EvalCallback
    records.py       the flat and grouped names of a record's numbers (metrics.csv, Tune, TensorBoard, trackers)
    writer.py        RunWriter: the folder's files as the run goes
    run_folder.py    RunFolder: the folder as an observer, when checkpoints are written, a stop asked for
                     (SIGTERM; the flag, request_stop and RunStopped are fdam_ray.features.interrupts',
                     re-exported here)
    agreement.py     check_one_run: a resume refuses a folder whose files come from different runs
    progress.py      Progress: the console progress bar
"""

from __future__ import annotations

from fdam_ray.features.interrupts import (  # the stop flag's home: re-exported
    RunStopped,
    clear_stop_request,
    request_stop,
)
from fdam_ray.outputs.observer import EvalCallback, Observer, Observers, RunStart, Snapshot
from fdam_ray.outputs.progress import Progress, terminal_size
from fdam_ray.outputs.records import flatten_record, grouped_name, grouped_scalars, scalars
from fdam_ray.outputs.run_folder import OutputSection, RunFolder, make_run_dir
from fdam_ray.outputs.writer import RunWriter

__all__ = [
    "EvalCallback", "Observer", "Observers", "OutputSection", "Progress", "RunFolder", "RunStart", "RunStopped",
    "RunWriter", "Snapshot", "clear_stop_request", "flatten_record", "grouped_name", "grouped_scalars",
    "make_run_dir", "request_stop", "scalars", "terminal_size",
]
