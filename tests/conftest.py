from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared helpers (raytest, oracle, ...)
from testpath import TEST_PATH  # (after the path insert above)

# Test modules other test modules reuse (the oracle cases, the hosted-run helpers, the sweep readers) are
# imported by their basename, as pytest imports them, wherever in the tree they sit.
sys.path.extend(p for p in TEST_PATH.split(os.pathsep)[1:] if p not in sys.path)
torch.set_num_threads(1)
# The suite runs on the CPU wherever it runs: its bit-for-bit comparisons assume CPU kernels, and a GPU in
# view would move device=auto runs and Ray's resource counts onto it (CUDA starts lazily, so hiding it here,
# before any test touches it, holds for this process, its subprocesses and the Ray workers it starts).
# The GPU paths are checked on a GPU machine by benchmarks/gpu_check.py.
os.environ["CUDA_VISIBLE_DEVICES"] = ""


from sample_clients import gaussian_clients  # noqa: E402 (after the path insert above)


@pytest.fixture
def clients_and_test():
    return gaussian_clients()


@pytest.fixture(autouse=True)
def fresh_wandb_settings():
    """W&B keeps the settings of its first run in the process (``WANDB_DIR`` included) until torn down: each test
    that runs W&B gets the environment it sets."""
    yield
    wandb = sys.modules.get("wandb")
    if wandb is not None and hasattr(wandb, "teardown"):
        wandb.teardown()


@pytest.fixture(autouse=True)
def store_reader_filters():
    """pytest's per-test capture of warnings drops filters set at import: the package's read-only-array filters
    (fdam_ray.core.state.reads_store_arrays) are set again for each test, as a run keeps them."""
    from fdam_ray.core.state import STORE_READERS, reads_store_arrays

    for module in sorted(STORE_READERS):
        reads_store_arrays(module)


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_running(request):
    """A test module that starts Ray shuts it down (raytest.ray_session does): one left running makes the next
    module's own start fail ("ray.init twice") and its store figures wrong, far from the cause. Shut down here and
    named as an error of the module that left it."""
    import ray

    running_before = ray.is_initialized()
    yield
    if not running_before and ray.is_initialized():
        ray.shutdown()
        pytest.fail(f"{request.module.__name__} left Ray running: start it with raytest.ray_session() (which shuts "
                    "it down), or shut it down in the test", pytrace=False)
