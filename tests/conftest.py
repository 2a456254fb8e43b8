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


@pytest.fixture(scope="session")
def netns_hosts(tmp_path_factory):
    """Two hosts (network namespaces on a bridge, each running sshd), torn down at the end."""
    from tests.netns_hosts import NetnsHosts, missing_requirement
    why = missing_requirement()
    if why:
        pytest.skip(f"SSH hosts in network namespaces: {why}")
    hosts = NetnsHosts.start(tmp_path_factory.mktemp("hosts"), count=2)
    try:
        yield hosts
    finally:
        hosts.stop()


@pytest.fixture(scope="session")
def isolated_hosts(tmp_path_factory):
    """Two more hosts, each with a /tmp of its own in which only the tests' folders are seen."""
    from tests.netns_hosts import NetnsHosts, missing_requirement
    why = missing_requirement()
    if why:
        pytest.skip(f"SSH hosts in network namespaces: {why}")
    hosts = NetnsHosts.start(tmp_path_factory.mktemp("isolated"), count=2, private_tmp=(0, 1),
                             keep=tmp_path_factory.getbasetemp(), tag="i")
    try:
        yield hosts
    finally:
        hosts.stop()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A one-node Slurm cluster (munged, slurmctld, slurmd), torn down at the end."""
    from tests.slurm_cluster import SlurmCluster, missing_requirement
    why = missing_requirement()
    if why:
        pytest.skip(f"one-node Slurm cluster: {why}")
    cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()
