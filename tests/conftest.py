"""Fixtures shared by the whole-job tests, and the guard that keeps the `cluster` marker right:
a test that starts a process is marked `cluster` (pytestmark, @pytest.mark.cluster, or a fixture
of PROCESS_FIXTURES), so that `python -m pytest -m "not cluster"` runs the rest in under a minute."""
import subprocess
from contextlib import contextmanager

import pytest

from tests.cluster_utils import final_weights, run_cpu, train_losses, write_params


@pytest.fixture(params=["C loops", "numpy"])
def conversion_path(request, monkeypatch):
    """Run a test on each path of the 16-bit conversions (cs_runtime/numerics/precision.py):
    the optional C loops (setup.py builds them where a C compiler is found) and the numpy
    passes, which must give the same bits."""
    from cs_runtime.numerics import precision
    if request.param == "numpy":
        monkeypatch.setattr(precision, "_compiled", None)
    elif precision._compiled is None:
        pytest.skip("the conversions' C loops are not built (no C compiler at install): the numpy path alone")
    return request.param


@pytest.fixture
def fresh_backend():
    """A cstorch test starts and ends with no backend made (cs_torch keeps one per process)."""
    from cs_torch.backends import reset_backend   # here, not at the top: conftest loads without torch too
    reset_backend()
    yield
    reset_backend()


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
def sixteen_hosts(tmp_path_factory):
    """Sixteen hosts, for a job of a cluster's shape (16 hosts x 16 tasks)."""
    from tests.netns_hosts import NetnsHosts, missing_requirement
    why = missing_requirement()
    if why:
        pytest.skip(f"SSH hosts in network namespaces: {why}")
    hosts = NetnsHosts.start(tmp_path_factory.mktemp("sixteen"), count=16, tag="m")
    try:
        yield hosts
    finally:
        hosts.stop()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A one-node Slurm cluster (munged, slurmctld, slurmd), torn down at the end. Its node has a
    /tmp of its own in which only the tests' folders are seen, as a real node's /tmp is not the
    submit host's: the job's keys must reach it by srun's environment."""
    from tests.slurm_cluster import SlurmCluster, missing_requirement
    why = missing_requirement()
    if why:
        pytest.skip(f"one-node Slurm cluster: {why}")
    cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm"), private_tmp_keeping=tmp_path_factory.getbasetemp())
    try:
        yield cluster
    finally:
        cluster.stop()


# Fixtures that start processes: a test using one is a cluster test.
PROCESS_FIXTURES = {"oracle", "netns_hosts", "isolated_hosts", "sixteen_hosts", "slurm_cluster"}


def pytest_collection_modifyitems(items):
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)


@contextmanager
def processes_noticed(item):
    """For a test without the cluster marker: the test fails, after it has run, if it started a process."""
    if item.get_closest_marker("cluster"):
        yield
        return
    real, started = subprocess.Popen, []

    class Noticed(real):
        def __init__(self, args, *rest, **kwargs):
            started.append(args)
            super().__init__(args, *rest, **kwargs)

    subprocess.Popen = Noticed
    try:
        yield
    finally:
        subprocess.Popen = real
    if started:
        pytest.fail(f"{item.nodeid} starts processes ({started[0]!r}...): mark it @pytest.mark.cluster",
                    pytrace=False)


# Setup too, so that a fixture of any scope an unmarked test brings up is held to it;
# not teardown, where the last test of a session stops what earlier ones started.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with processes_noticed(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with processes_noticed(item):
        return (yield)
