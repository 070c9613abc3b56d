"""Secret fields stay in the run folder: no tracker is given them as a parameter (fdam_ray.outputs.trackers)."""

from __future__ import annotations

import pytest

from fdam_ray.config import FIELD_BY_NAME, build_config
from fdam_ray.outputs.trackers import tracker_params
from fdam_ray.settings.sections import SECRET_FIELDS

SEED = 918273645


def _config():
    return build_config(algorithm="coda_plus", dp="client", model="mlp", dp_noise_multiplier=1.0, dp_noise_seed=SEED,
                        trackers=["mlflow"])


def test_the_noise_seed_is_a_secret_field_and_every_secret_field_is_a_field():
    assert "dp_noise_seed" in SECRET_FIELDS
    assert set(SECRET_FIELDS) <= set(FIELD_BY_NAME)


def test_no_secret_field_goes_to_a_tracker_and_every_other_field_does():
    given = _config().to_dict()
    assert given["dp_noise_seed"] == SEED
    params = tracker_params(given)
    assert not set(params) & set(SECRET_FIELDS)
    assert set(params) == set(given) - set(SECRET_FIELDS)
    assert str(SEED) not in repr(params)


def test_a_sweep_trials_parameters_leave_the_secret_out_too():
    pytest.importorskip("ray")
    from fdam_ray.tuning.callbacks import trial_params

    base = {"algorithm": "coda_plus", "dp": "client", "model": "mlp", "dp_noise_multiplier": 1.0, "dp_noise_seed": SEED}
    params = trial_params(base, {"lr": 0.05})
    assert params["lr"] == 0.05 and "dp_noise_seed" not in params and str(SEED) not in repr(params)


def test_the_mlflow_batch_carries_no_secret():
    from fdam_ray.outputs.trackers import log_mlflow_params

    pytest.importorskip("mlflow")
    sent = []

    class Client:
        def log_batch(self, run_id, params):
            sent.extend(params)

    log_mlflow_params(Client(), "run", tracker_params(_config().to_dict()))
    assert sent and not [p for p in sent if p.key in SECRET_FIELDS or str(SEED) in p.value]
