"""Fixtures shared by the whole-job tests."""
import pytest

from tests.cluster_utils import final_weights, run_cpu, train_losses, write_params


@pytest.fixture(scope="session")
def oracle(tmp_path_factory):
    """The CPU run every distributed run is compared with: (params, losses, final weights)."""
    tmp = tmp_path_factory.mktemp("oracle")
    params = write_params(tmp)
    result = run_cpu(params, tmp / "cpu")
    assert result.returncode == 0, result.stderr
    return params, train_losses(tmp / "cpu"), final_weights(tmp / "cpu")
