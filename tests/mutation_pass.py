"""A repeatable mutation pass: one deliberate bug at a time, then the tests that should catch it.

    python tests/mutation_pass.py                       # every mutation; writes docs/mutation-report.md
    python tests/mutation_pass.py --only p_mean_of_ratios grad_clip_removed
    python tests/mutation_pass.py --list

Each mutation in :data:`MUTATIONS` names a file, an exact piece of its text
(which must occur exactly once), the replacement, and the pytest arguments
that should fail with it. The pass checks every mutation's text before it
changes anything and stops with "original text not found in FILE" when a
file has moved on, so a mutation is never skipped in silence. For each
mutation it writes the mutated file, runs the tests with this interpreter
(``sys.executable``) under a time limit, and puts the original back, also on
Ctrl+C or a crash (the original bytes and modification time are restored).
A mutation is *killed* when the tests fail (or run past the limit), and
*survives* when they pass. A survivor's ``why`` says why that is acceptable
(an equivalent mutation); every other survivor is a missing test.

Not collected by pytest (the name does not start with ``test_``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "docs" / "mutation-report.md"
BEGIN, END = "<!-- generated: begin -->", "<!-- generated: end -->"


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    original: str
    replacement: str
    tests: tuple[str, ...]  # pytest arguments
    what: str  # the bug, in words
    why: str = ""  # for a mutation expected to survive: why it is harmless


ORACLE = "tests/unit/algorithms/test_oracle.py"
OBJ = "tests/unit/toplevel/test_objectives.py"
SERVER = "tests/unit/algorithms/test_server.py"
SCHED = "tests/unit/loop/test_schedules.py"
DATA = "tests/data/test_data.py"
FED = "tests/loop/test_federation.py"
METRICS = "tests/unit/toplevel/test_metrics.py"
STAGES = "tests/unit/algorithms/test_stages.py"
SAMPLING = "tests/unit/algorithms/test_sampling.py"
CKPT = ("tests/loop/test_runs.py", "-k", "checkpoint or resume or atomic or unpickle")
IMG = "tests/data/test_imagefolder.py"

# fmt: off
MUTATIONS: list[Mutation] = [
    # -- the objective (docs/algorithms.md s.1)
    Mutation("obj_weights_swapped", "fdam_ray/objectives.py",
             "per = (1 - p) * (h - a) ** 2 * pos + p * (h - b) ** 2 * neg",
             "per = p * (h - a) ** 2 * pos + (1 - p) * (h - b) ** 2 * neg",
             (OBJ, ORACLE), "class weights (1-p) and p of the square terms swapped"),
    Mutation("obj_square_drops_one", "fdam_ray/objectives.py",
             "per = per + 2 * (1 + alpha) * cross",
             "per = per + 2 * alpha * cross",
             (OBJ, ORACLE), "auc_square's 2(1 + alpha) becomes 2 alpha"),
    Mutation("obj_margin_dropped", "fdam_ray/objectives.py",
             "per = per + 2 * alpha * (q * margin * valid + cross)",
             "per = per + 2 * alpha * (q * valid + cross)",
             (OBJ, ORACLE), "auc_margin ignores the margin m (m = 1 always)"),
    Mutation("obj_alpha_sq_unweighted", "fdam_ray/objectives.py",
             "per = per - q * alpha**2 * valid",
             "per = per - alpha**2 * valid",
             (OBJ, ORACLE), "the -p(1-p) alpha^2 term loses its p(1-p)"),
    Mutation("obj_missing_labels_counted", "fdam_ray/pauc.py",
             "task_means = per.sum(0)[has] / count[has]",
             "task_means = per.sum(0)[has] / len(per)",
             (OBJ,), "a task's mean divides by the batch size, counting samples without a label for it"),
    Mutation("closed_form_alpha_unprojected", "fdam_ray/objectives.py",
             "return np.maximum(0.0, margin + gap)",
             "return margin + gap",
             (OBJ, FED), "CODA's closed-form alpha for auc_margin not projected onto alpha >= 0"),
    # -- the global positive ratio p (s.1)
    Mutation("p_mean_of_ratios", "fdam_ray/objectives.py",
             "    return pos / lab\n",
             "    return np.mean([np.asarray(a, np.float64) / b for a, b in zip(positives, labelled)], 0)\n",
             (ORACLE,), "p is the mean of the clients' ratios instead of pooled counts"),
    # -- stage ends on the server state (s.5)
    Mutation("reference_always_last", "fdam_ray/algorithms/stages.py",
             'if reference_point == "average" and server.ref_count:',
             "if False:",
             (STAGES,), "the proximal centre is the last iterate even with reference_point: average"),
    Mutation("ref_sum_kept_across_stages", "fdam_ray/algorithms/stages.py",
             "    server.ref_sum[:] = 0.0\n",
             "",
             (STAGES,), "the next stage's average also counts the previous stage's iterates"),
    Mutation("control_variates_not_reset", "fdam_ray/algorithms/drift.py",
             "if reset and state.c_v is not None:",
             "if False:",
             (STAGES,), "the global c survives a stage end although reset_control_variates is on"),
    Mutation("coda_alpha_unweighted", "fdam_ray/algorithms/stages.py",
             "w = 1.0 if weights is None else float(weights[x.client_id])",
             "w = 1.0",
             (STAGES,), "CODA's alpha ignores the client weights"),
    # -- client sampling and client weights (s.3b)
    Mutation("draw_with_replacement", "fdam_ray/algorithms/sampling.py",
             "size=clients_per_round, replace=False",
             "size=clients_per_round, replace=True",
             (SAMPLING,), "a round may draw the same client twice"),
    Mutation("partial_c_forgets_the_rest", "fdam_ray/algorithms/server.py",
             "    total += prev\n",
             "",
             (SAMPLING,), "under sampling, c becomes the sampled clients' change alone instead of c plus it"),
    Mutation("weights_ignored_in_means", "fdam_ray/clients/client.py",
             "None if weights is None else float(weights[0])  # w_k",
             "None  # w_k",
             (SAMPLING,), "client weights left out of the sums a host folds its clients into"),
    # -- the local step (s.2)
    Mutation("grad_clip_removed", "fdam_ray/algorithms/local.py",
             "if self.grad_clip is not None:",
             "if False:",
             (ORACLE,), "grad_clip ignored"),
    Mutation("grad_clip_on_a_b", "fdam_ray/algorithms/local.py",
             "d[: flat.num_weights].clamp_(-self.grad_clip, self.grad_clip)",
             "d.clamp_(-self.grad_clip, self.grad_clip)",
             (ORACLE,), "grad_clip also clips the gradients of a and b"),
    Mutation("prox_sign", "fdam_ray/optim.py",
             "d.sub_(prox_ref)",
             "d.add_(prox_ref)",
             (ORACLE,), "the proximal term pulls away from v_ref"),
    Mutation("weight_decay_dropped", "fdam_ray/optim.py",
             "pull = prox_weight + weight_decay",
             "pull = prox_weight",
             (ORACLE,), "weight decay ignored"),
    Mutation("alpha_descends", "fdam_ray/optim.py",
             "alpha.add_(g_alpha, alpha=lr)",
             "alpha.add_(g_alpha, alpha=-lr)",
             (ORACLE,), "alpha takes a descent step instead of an ascent step"),
    Mutation("alpha_unprojected_locally", "fdam_ray/optim.py",
             "if nonnegative:",
             "if False:",
             (ORACLE, FED), "no projection of alpha onto alpha >= 0 after a local step"),
    Mutation("cv_alpha_correction_sign", "fdam_ray/algorithms/drift.py",
             "g_alpha.add_(self.corr_alpha)",
             "g_alpha.sub_(self.corr_alpha)",
             (ORACLE,), "alpha's control-variate correction with the wrong sign"),
    Mutation("cv_scale_without_lr", "fdam_ray/algorithms/drift.py",
             "scale = 1.0 / (steps * lr)",
             "scale = 1.0 / steps",
             (ORACLE,), "c^k update divides by I instead of I eta"),
    # -- the server step (s.3)
    Mutation("server_no_extrapolation", "fdam_ray/algorithms/server.py",
             "if self.global_lr != 1.0:",
             "if False:",
             (SERVER, ORACLE), "eta_g ignored (plain averaging always)"),
    Mutation("server_alpha_unprojected", "fdam_ray/algorithms/server.py",
             'np.maximum(alpha, 0, out=alpha)',
             "pass",
             (SERVER, ORACLE), "the server's alpha not projected for auc_margin"),
    Mutation("server_counters_summed", "fdam_ray/algorithms/server.py",
             "np.maximum(total, getattr(other, name), out=total)",
             "np.add(total, getattr(other, name), out=total)",
             (SERVER,), "integer buffers (num_batches_tracked) summed instead of their max"),
    Mutation("server_buffers_not_averaged", "fdam_ray/algorithms/server.py",
             "elif rule in (Rule.EXTRAPOLATE, Rule.MEAN):",
             "elif rule is Rule.EXTRAPOLATE:",
             (SERVER,), "BatchNorm statistics summed over clients, not averaged"),
    Mutation("server_cv_not_averaged", "fdam_ray/algorithms/server.py",
             "        total *= inv\n        return total\n",
             "        return total\n",
             (SERVER, ORACLE), "global c_v is the sum of the clients' c^k, not their mean"),
    # -- the proximal centre and the family modules (algorithms/fedprox*.py, coda.py)
    Mutation("round_centre_not_moved", "fdam_ray/algorithms/local.py",
             'if self.proximal == "round" and self.prox_weight:',
             "if False:",
             ("tests/unit/algorithms/test_fedprox.py",),
             "FedProx's proximal centre is never set to the round's starting point"),
    Mutation("fedprox_centred_on_the_stage", "fdam_ray/algorithms/fedprox.py",
             '    proximal = "round"',
             '    proximal = "stage"',
             ("tests/unit/algorithms/test_fedprox.py",), "FedProx pulls towards the stage's reference point"),
    Mutation("fedprox_auc_centred_on_the_stage", "fdam_ray/algorithms/fedprox_auc.py",
             '    proximal = "round"',
             '    proximal = "stage"',
             ("tests/unit/algorithms/test_fedprox.py",), "FedProx-AUC pulls towards the stage's reference point"),
    Mutation("codasca_without_drift_correction", "fdam_ray/algorithms/coda.py",
             'preset("codasca", Coda, AUC_OBJECTIVES, "control_variates",',
             'preset("codasca", Coda, AUC_OBJECTIVES, "none",',
             (ORACLE,), "CODASCA runs without control variates (it becomes CODA+)"),
    Mutation("coda_keeps_alpha_at_stage_end", "fdam_ray/algorithms/coda.py",
             "    needs_score_sums = True\n",
             "    needs_score_sums = False\n",
             (FED,), "CODA's stage end never recomputes alpha in closed form"),
    # -- schedules (s.5)
    Mutation("stage_switch_late", "fdam_ray/core/schedules.py",
             "return p.done >= p.stage * self.stage_length",
             "return p.done > p.stage * self.stage_length",
             (SCHED, ORACLE), "a stage ends one round after s x T0 iterations when it falls on a round end"),
    Mutation("stage_lr_decays_once_too_often", "fdam_ray/core/schedules.py",
             "return lr / lr_decay ** (stage - 1)",
             "return lr / lr_decay ** stage",
             (SCHED, ORACLE), "stage s uses lr / decay^s instead of lr / decay^(s-1)"),
    Mutation("geometric_lr_constant", "fdam_ray/core/schedules.py",
             "return max(1, round(local_steps * factor)), lr / factor",
             "return max(1, round(local_steps * factor)), lr",
             (SCHED,), "the geometric schedule keeps lr constant as I_s grows"),
    Mutation("last_round_not_shortened", "fdam_ray/core/schedules.py",
             "steps = min(steps, self.iterations - p.done)",
             "steps = steps",
             (SCHED, ORACLE), "the last round runs I steps past the iteration budget"),
    # -- partitions
    Mutation("ih_ratio_is_imratio", "fdam_ray/data/partition.py",
             "ratio = imratio / (1 - imratio)",
             "ratio = imratio",
             (DATA,), "IH keeps imratio x negatives positives (pos/(pos+neg) below imratio)"),
    Mutation("stratified_keep_short", "fdam_ray/data/partition.py",
             "for i in np.argsort(-(exact - keep), kind=\"stable\")[: total - keep.sum()]:",
             "for i in np.argsort(-(exact - keep), kind=\"stable\")[:0]:",
             (DATA,), "class-stratified subsampling keeps the floors only (too few samples)"),
    Mutation("dirichlet_accepts_one_sided_clients", "fdam_ray/data/partition.py",
             "if all(is_pos[o].any() and (~is_pos[o]).any() for o in out):",
             "if True:",
             (DATA,), "a Dirichlet draw that leaves a client without positives or negatives is kept"),
    # -- metrics and evaluation (s.6)
    Mutation("auc_mean_over_nan", "fdam_ray/metrics.py",
             "return float(np.nanmean(aucs)) if np.any(~np.isnan(aucs)) else float(\"nan\")",
             "return float(np.mean(aucs))",
             (METRICS, FED), "the mean AUC over tasks is NaN when one task's AUC is undefined"),
    Mutation("auc_missing_labels_kept", "fdam_ray/metrics.py",
             "keep = ~np.isnan(labels[:, t])",
             "keep = np.ones(len(labels), dtype=bool)",
             (METRICS, FED), "a task's AUC keeps the samples without a label for it"),
    Mutation("test_auc_mean_of_client_aucs", "fdam_ray/loop/evaluation.py",
             "scores, labels = pooled([(p.scores, p.labels) for p in parts if isinstance(p, Scores)])",
             "scores, labels = parts[0].scores, parts[0].labels  # type: ignore[union-attr]",
             (FED,), "the test AUC is the first client's AUC, not one AUC over the pooled scores"),
    # -- checkpoints
    Mutation("checkpoint_arrays_come_back_as_tensors", "fdam_ray/checkpoint.py",
             "return obj[_ARRAY].numpy()",
             "return obj[_ARRAY]",
             CKPT, "numpy arrays in a checkpoint come back as torch tensors"),
    Mutation("checkpoint_unpickles_anything", "fdam_ray/files/torchload.py",
             "return torch.load(path, map_location=\"cpu\", weights_only=True)",
             "return torch.load(path, map_location=\"cpu\", weights_only=False)",
             CKPT, "a checkpoint is read with full unpickling (runs code from the file)"),
    Mutation("checkpoint_write_in_place", "fdam_ray/checkpoint.py",
             "fd, tmp = tempfile.mkstemp(prefix=f\".{path.name}.\", suffix=\".tmp\", dir=folder)",
             "fd, tmp = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), str(path)",
             CKPT, "a checkpoint is overwritten in place (a crash mid-write destroys the previous one)"),
    # -- image-folder augmentation
    Mutation("imagefolder_augment_ignored", "fdam_ray/data/imagefolder.py",
             "augment = self.augment and client_id is not None",
             "augment = False",
             (IMG,), "augment=true has no effect on image folders"),
    Mutation("imagefolder_augments_test_split", "fdam_ray/data/imagefolder.py",
             "augment = self.augment and client_id is not None",
             "augment = self.augment",
             (IMG,), "augment=true also augments the test split"),
]
# fmt: on


class TextNotFound(SystemExit):
    pass


def check(mutations: list[Mutation]) -> None:
    """Every mutation's original text occurs exactly once in its file (fail loudly otherwise)."""
    names = [m.name for m in mutations]
    if len(set(names)) != len(names):
        raise SystemExit(f"duplicate mutation names: {sorted({n for n in names if names.count(n) > 1})}")
    for m in mutations:
        path = ROOT / m.file
        if not path.is_file():
            raise TextNotFound(f"{m.name}: original text not found in {m.file} (no such file)")
        count = path.read_text().count(m.original)
        if count == 0:
            raise TextNotFound(f"{m.name}: original text not found in {m.file}: {m.original!r}")
        if count > 1:
            raise SystemExit(f"{m.name}: original text occurs {count} times in {m.file}; make it unique")


def run_tests(args: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """('passed' | 'failed' | 'timeout', seconds, the first failing test or the last line of output)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # never cache the bytecode of a mutated file
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider", *args]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        outcome = "passed" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        outcome = "timeout"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    failed = [line.split(" - ")[0].removeprefix("FAILED ") for line in out.splitlines() if line.startswith("FAILED ")]
    errors = [line.split(" - ")[0] for line in out.splitlines() if line.startswith("ERROR ")]
    first = (failed or errors or out.strip().splitlines()[-1:] or [""])[0]
    return outcome, time.perf_counter() - started, first


def apply_and_test(m: Mutation, timeout: float) -> tuple[str, float, str]:
    path = ROOT / m.file
    raw = path.read_bytes()
    stat = path.stat()
    text = raw.decode()
    if text.count(m.original) != 1:
        raise TextNotFound(f"{m.name}: original text not found in {m.file} (exactly once): {m.original!r}")
    try:
        path.write_text(text.replace(m.original, m.replacement))
        return run_tests(m.tests, timeout)
    finally:
        path.write_bytes(raw)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _interrupt(signum, frame):  # SIGTERM: unwind like Ctrl+C, so the file is restored
    raise KeyboardInterrupt


def report(rows: list[dict], command: str) -> str:
    killed = sum(r["outcome"] != "passed" for r in rows)
    survived = [r for r in rows if r["outcome"] == "passed"]
    lines = [
        BEGIN,
        "# Mutation pass",
        "",
        f"Command: `{command}` (definitions: the table `MUTATIONS` in `tests/mutation_pass.py`).",
        "",
        "One deliberate bug at a time in the package, then the tests listed for it. Killed = the tests failed "
        "(or ran past the time limit); survived = they passed.",
        "",
        f"**{len(rows)} mutations: {killed} killed, {len(survived)} survived.**",
        "",
        "| mutation | file | the bug | tests run | outcome | first failing test | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m: Mutation = r["mutation"]
        tests = " ".join(a for a in m.tests)
        lines.append(f"| `{m.name}` | `{m.file}` | {m.what} | `{tests}` | {r['outcome_text']} | "
                     f"{'`' + r['caught'] + '`' if r['outcome'] == 'failed' else '-'} | {r['seconds']:.0f} |")
    if survived:
        lines += ["", "## Survivors", ""]
        for r in survived:
            m = r["mutation"]
            lines.append(f"- `{m.name}`: {m.why or 'NO TEST CATCHES THIS: a test is missing.'}")
    return "\n".join([*lines, END])


def write_report(path: Path, block: str) -> None:
    """Replace the generated block of ``path`` (or create the file), keeping the text around it."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block + "\n")
        return
    old = path.read_text()
    if old.count(BEGIN) != 1 or old.count(END) != 1:
        raise SystemExit(f"{path} has no single generated block to replace; add '{BEGIN}' and '{END}'")
    before, rest = old.split(BEGIN, 1)
    path.write_text(before + block + rest.split(END, 1)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", help="names of the mutations to run (default all)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per mutation's tests (default 300)")
    parser.add_argument("--report", default=str(REPORT), help="report file (default docs/mutation-report.md)")
    parser.add_argument("--no-report", action="store_true", help="print only")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the first run of every listed test file without mutations")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    chosen = MUTATIONS
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTATIONS})
        if unknown:
            raise SystemExit(f"unknown mutations: {unknown}")
        chosen = [m for m in MUTATIONS if m.name in args.only]
    check(chosen)
    if args.list:
        for m in chosen:
            print(f"{m.name:40s} {m.file:32s} {m.what}")
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    if not args.no_baseline:  # a failing test without any mutation would count every mutation as killed
        suites = tuple(dict.fromkeys(a for m in chosen for a in m.tests if a.startswith("tests/")))
        outcome, seconds, tail = run_tests(suites, args.timeout * 3)
        print(f"baseline (no mutation): {outcome} in {seconds:.0f} s", flush=True)
        if outcome != "passed":
            raise SystemExit(f"the tests fail without any mutation; fix that first:\n{tail}")
    rows = []
    for i, m in enumerate(chosen, 1):
        outcome, seconds, caught = apply_and_test(m, args.timeout)
        text = {"passed": "**survived**", "failed": "killed", "timeout": "killed (time limit)"}[outcome]
        rows.append({"mutation": m, "outcome": outcome, "outcome_text": text, "seconds": seconds, "caught": caught})
        print(f"[{i}/{len(chosen)}] {m.name}: {text.strip('*')} ({seconds:.0f} s) {caught}", flush=True)
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    text = report(rows, f"python tests/mutation_pass.py {argv_text}".strip())
    if not args.no_report:
        write_report(Path(args.report), text)
    print(text)
    survived = [r["mutation"] for r in rows if r["outcome"] == "passed"]
    return 1 if any(not m.why for m in survived) else 0


if __name__ == "__main__":
    sys.exit(main())
