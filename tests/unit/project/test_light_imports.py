"""The light commands stay light: ``fdam --version`` and ``fdam fields`` import neither torch nor Ray nor
scikit-learn, and ``import fdam_ray.losses`` brings torch and NumPy but no scikit-learn, SciPy or pandas.

Each check runs in a fresh interpreter (``python -c``), since this test process has imported them all already.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

HEAVY = ("torch", "ray", "sklearn", "scipy", "pandas", "matplotlib", "torchvision")


def loaded_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; what it printed last (JSON) and which HEAVY modules it had loaded."""
    probe = textwrap.dedent(code) + textwrap.dedent(f"""
        import json, sys
        print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    *shown, last = done.stdout.strip().splitlines()
    return {"stdout": "\n".join(shown), "loaded": json.loads(last)}


def test_version_and_fields_import_neither_torch_nor_ray_nor_sklearn():
    seen = loaded_after("""
        import contextlib, io
        from fdam_ray.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main(["--version"])
            except SystemExit:
                pass
            assert main(["fields"]) == 0 and main(["fields", "executor"]) == 0 and main(["fields", "lr"]) == 0
        print(out.getvalue())
    """)
    assert seen["loaded"] == []
    lines = seen["stdout"].splitlines()
    assert lines[0].startswith("fdam ") and any(line.startswith("executor ") for line in lines)
    assert any(line.startswith("local_steps ") for line in lines)  # the whole table was printed too


def test_fields_help_lists_the_sections_without_the_heavy_modules():
    seen = loaded_after("""
        import contextlib, io
        from fdam_ray.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main(["fields", "-h"])
            except SystemExit:
                pass
        print(out.getvalue())
    """)
    assert seen["loaded"] == [] and "algorithm, schedule" in seen["stdout"]


def test_losses_import_torch_and_numpy_only():
    seen = loaded_after("""
        import sys
        import fdam_ray.losses
        assert "torch" in sys.modules and "numpy" in sys.modules
    """)
    assert seen["loaded"] == ["torch"]
