"""Run an ``fdam`` command on the head node of a running cluster (for ``ray submit``).

    ray submit deploy/aws-gpu.yaml deploy/fdam_job.py -- train gpus_per_actor=0.25 iterations=20000

``ray submit`` runs this file with Python on the head node; it joins the
cluster that runs there (``RAY_ADDRESS=auto``, token mode on) instead of
starting a second Ray, then hands its arguments to ``fdam``.
"""

import os
import sys

os.environ.setdefault("RAY_ADDRESS", "auto")
os.environ.setdefault("RAY_AUTH_MODE", "token")

from fdam_ray.cli import main  # after the environment is set

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
