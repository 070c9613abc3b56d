"""Where the test helpers and test modules are, for processes the tests start (Ray workers, ``fdam`` commands):
this folder (the helpers) and every folder of test modules, which pytest imports by their basenames."""

from __future__ import annotations

import os
from pathlib import Path

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TEST_PATH = os.pathsep.join([TESTS_DIR, *sorted({str(p.parent) for p in Path(TESTS_DIR).rglob("test_*.py")})])
