"""Which Ray addresses are kept on loopback."""

import pytest

from runtime.engine.ray_cluster import is_loopback_address, loopback_environment


@pytest.mark.parametrize(
    "address",
    [None, "", "local", "127.0.0.1:6379", "localhost:6379", "ray://127.0.0.1:10001", "[::1]:6379"],
)
def test_loopback_addresses(address):
    assert is_loopback_address(address)
    assert loopback_environment(address) == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.mark.parametrize(
    "address", ["10.77.0.1:6390", "ray://head.cluster.local:10001", "192.0.2.5:6379"]
)
def test_cluster_addresses_keep_rays_own_choice(address):
    assert not is_loopback_address(address)
    assert loopback_environment(address) == {}
