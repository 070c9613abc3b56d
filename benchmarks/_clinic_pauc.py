"""Part (b) of ``benchmarks/clinic.py``: pAUC(FPR <= 0.1) of models trained with AUC-M, the federated pAUC objective
and the pAUC objective on pooled data, paired seeds, with a figure of their ROC curves from the pooled counts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from fdam_ray.loop import evaluation

BETA = 0.1
TEMPERATURE = 0.1  # pauc_temperature of both pAUC trainings
METHODS = (("AUC-M (federated)", {"objective": "auc_margin"}),
           ("pAUC (federated)", {"objective": "pauc_one_way", "pauc_temperature": TEMPERATURE}),
           ("pAUC (pooled data, K = 1)", {"algorithm": "centralized", "objective": "pauc_one_way",
                                          "pauc_temperature": TEMPERATURE}))
QUICK = {"digits": {"iterations": 500, "eval_every": 500}, "hospitals": {"iterations": 400, "eval_every": 400}}


def roc_of_counts(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FPR and TPR at every threshold between cells, from one task's pooled counts ``(2, K)`` (cells ordered by
    score, lowest first): the share of each class in the cells above the threshold, from (0, 0) to (1, 1)."""
    neg, pos = (np.asarray(c, np.float64) for c in counts)
    fpr = np.concatenate(([0.0], np.cumsum(neg[::-1]))) / neg.sum()
    tpr = np.concatenate(([0.0], np.cumsum(pos[::-1]))) / pos.sum()
    return fpr, tpr


def pauc_of_roc(fpr: np.ndarray, tpr: np.ndarray, beta: float = BETA) -> float:
    """The area under the ROC curve (straight between its points; a vertical step where a cell holds positives
    only) over FPR in [0, beta], divided by beta: segment by segment, each cut at beta."""
    area = 0.0
    for x0, x1, y0, y1 in zip(fpr[:-1], fpr[1:], tpr[:-1], tpr[1:], strict=True):
        a, b = min(x0, beta), min(x1, beta)
        if b > a:
            slope = (y1 - y0) / (x1 - x0)
            area += (b - a) * (2 * y0 + slope * (a - x0 + b - x0)) / 2
    return area / beta


def trained(run: Callable[[dict], object], config: dict) -> tuple[dict, np.ndarray]:
    """The final evaluation record of one training and its pooled test counts (the clinical read-out's)."""
    kept: list[np.ndarray] = []
    original = evaluation.Evaluator._clinical_fields

    def keep(self, parts):
        out = original(self, parts)
        kept.append(np.asarray(self._counts))
        return out

    evaluation.Evaluator._clinical_fields = keep
    try:
        result = run({**config, "clinical": "on", "pauc_max_fpr": BETA})
    finally:
        evaluation.Evaluator._clinical_fields = original
    return result.history[-1], kept[-1]


def pauc_part(studies: list[str], quick: bool, seeds: int, out: str,
              runs: dict[str, Callable[[dict], object]]) -> tuple[str, str]:
    """Run part (b); returns its Markdown (table, figure, reading) and the RESULT fields it adds."""
    rows, curves, summary = [], {}, {}
    for study in studies:
        got: dict[str, list[float]] = {name: [] for name, _ in METHODS}
        for seed in range(seeds):
            for name, config in METHODS:
                record, counts = trained(runs[study], {**config, "seed": seed, **(QUICK[study] if quick else {})})
                fpr, tpr = roc_of_counts(counts[0])
                own = pauc_of_roc(fpr, tpr)
                reported = record["test_pauc"] / BETA
                if abs(own - reported) > 1e-5:  # the library's read-out against this file's own ROC area
                    raise RuntimeError(f"{study} {name} seed {seed}: pAUC {reported} reported, {own} from the counts")
                got[name].append(own)
                rows.append(f"| {study} | {seed} | {name} | {own:.4f} | {record['test_pauc_mcclish']:.4f} | "
                            f"{record['test_auc']:.4f} |")
                print(f"{study} seed {seed} {name}: pAUC/beta {own:.4f} AUC {record['test_auc']:.4f}", flush=True)
                if seed == 0:
                    curves[(study, name)] = (fpr, tpr)
        aucm, fed, central = (np.array(got[name]) for name, _ in METHODS)
        summary[study] = {"gain": fed - aucm, "gap": central - fed, "means": [v.mean() for v in (aucm, fed, central)]}
    figure = Path(out).with_name(Path(out).stem + "_pauc.png") if out else None
    if figure is not None:
        draw(curves, studies, figure)
    best = max(studies, key=lambda s: summary[s]["gain"].mean())
    lines = ["## (b) Training for partial AUC", "",
             f"pAUC(FPR <= {BETA}) / {BETA} of the final model (pooled test counts, the clinical read-out; this "
             f"file checks it against its own ROC area), McClish-standardised pAUC and AUC; pauc_temperature = "
             f"{TEMPERATURE}; {seeds} paired seed(s) (data, initial weights and batches shared by the three).", "",
             "| study | seed | training | pAUC / beta | McClish | AUC |", "|---|---|---|---|---|---|", *rows, "",
             "| study | AUC-M | pAUC federated | pAUC pooled | federated - AUC-M (per seed) | pooled - federated |",
             "|---|---|---|---|---|---|"]
    for s in studies:
        m, gain, gap = summary[s]["means"], summary[s]["gain"], summary[s]["gap"]
        lines.append(f"| {s} | {m[0]:.4f} | {m[1]:.4f} | {m[2]:.4f} | {gain.mean():+.4f} "
                     f"({', '.join(f'{g:+.4f}' for g in gain)}) | {gap.mean():+.4f} |")
    if figure is not None:
        lines += ["", f"![ROC curves, pAUC region shaded]({figure.name})"]
    result = (f"pauc_gain_over_aucm={summary[best]['gain'].mean():+.4f} "
              f"pauc_gap_to_central={summary[best]['gap'].mean():+.4f} pauc_study={best}")
    return "\n".join(lines), result


def draw(curves: dict, studies: list[str], path: Path) -> None:
    """Per study the ROC curves (seed 0) over FPR in [0, 0.3], the pAUC region FPR <= beta shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(studies), figsize=(5 * len(studies), 3.8), dpi=120, squeeze=False)
    for ax, study in zip(axes[0], studies, strict=True):
        ax.axvspan(0, BETA, color="grey", alpha=0.15, label=f"FPR <= {BETA}")
        for name, _ in METHODS:
            fpr, tpr = curves[(study, name)]
            ax.step(fpr, tpr, where="post", label=name)
        ax.set_xlim(0, 0.3)
        ax.set_ylim(0.5, 1.005)
        ax.set_xlabel("false positive rate")
        ax.set_ylabel("true positive rate")
        ax.set_title(f"{study}: ROC from the pooled test counts (seed 0)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
