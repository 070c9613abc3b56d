"""How to install one of fdam-ray's extras, said without a package index.

fdam-ray is installed from its wheel or its source checkout, never by a bare
name from a public index (that name could belong to someone else). Every
message that asks for an optional package builds its hint here, so the
wording and the routes are the same everywhere. :data:`EXTRAS` names the
extras of ``setup.cfg`` (a unit test checks that the two agree).
"""

from __future__ import annotations

EXTRAS = ("images", "plots", "flower", "privacy", "trackers", "mlflow", "wandb", "tensorboard", "dicom", "bench",
          "optuna", "docs", "dev")


class MissingExtraError(ImportError, ValueError):
    """An optional dependency is not installed (a ValueError too, so the CLI reports it plainly)."""


def extra_hint(extra: str, package: str | None = None) -> str:
    """One line: how to add ``extra`` to this fdam-ray (from its wheel or its checkout), or just ``package``."""
    if extra not in EXTRAS:
        raise ValueError(f"extra_hint: unknown extra {extra!r}; known: {', '.join(EXTRAS)}")
    alone = f"; or only {package}: pip install {package}" if package else ""
    return (f"install fdam-ray's '{extra}' extra from the wheel or checkout fdam-ray came from: "
            f"pip install \"./fdam_ray-<version>-py3-none-any.whl[{extra}]\", or pip install -e \".[{extra}]\" "
            f"in the checkout{alone}")


def require(module: str, extra: str, what: str, package: str | None = None) -> None:
    """Raise :class:`MissingExtraError` (one line: ``what`` needs it, and how to install ``extra``) when ``module``
    cannot be imported; ``package`` is its name on pip when that differs (Pillow's module is PIL)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"{what} needs {package or module}: {extra_hint(extra, package or module)}")
