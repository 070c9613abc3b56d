"""Without the 'images' or 'plots' extra, the modules that use them still import, and using them says in one
line which extra to install (from the wheel or the checkout, never by a bare name from an index)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

BLOCK = textwrap.dedent("""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("PIL", "torchvision", "matplotlib"):
                raise ModuleNotFoundError(f"No module named {name!r}")
    sys.meta_path.insert(0, Block())
    import importlib.util
    real = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] in ("PIL", "torchvision", "matplotlib") \\
        else real(name, *a)
""")


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def test_image_and_plot_modules_import_without_their_extras_and_using_them_names_the_extra():
    done = run("""
        import numpy as np
        import fdam_ray.data.chestxray, fdam_ray.data.images, fdam_ray.data.cifar, fdam_ray.data.imagefolder
        import fdam_ray.plots
        from fdam_ray.files.extras import MissingExtraError
        out = []
        for call in (lambda: fdam_ray.data.images.read_gray("x.png", 8),
                     lambda: fdam_ray.data.images.cifar_transform((0.5,), (0.5,), augment=False),
                     lambda: fdam_ray.data.chestxray.chestxray_transform(augment=True),
                     lambda: fdam_ray.plots._pyplot()):
            try:
                call()
            except MissingExtraError as exc:
                out.append(str(exc))
        print("\\n".join(out))
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 4
    for line, extra in zip(lines, ("images", "images", "images", "plots"), strict=True):
        assert f"'{extra}' extra" in line and f"[{extra}]" in line and not re.search(r"pip install\s+fdam.ray\b", line)
    assert "needs pillow" in lines[0] and "needs torchvision" in lines[1] and "needs matplotlib" in lines[3]
