"""The same PPO job against a real multi-node Ray cluster: a head and two workers started with
``ray start``, each in a network namespace this test creates, slots placed across the nodes by a
spread placement group, gloo between the namespaces. It must follow the single-machine run."""

import json
import subprocess
import sys

import pytest

from tests.support.ray_netns import netns_ray_cluster

pytestmark = pytest.mark.ray

JOB = [sys.executable, "-m", "runtime.ppo.cluster_run", "--slots", "4", "--steps", "2"]


def test_the_job_runs_unchanged_on_a_three_node_cluster():
    local = subprocess.run(JOB, capture_output=True, text=True, timeout=300, check=True)
    alone = json.loads(local.stdout.strip().splitlines()[-1])
    assert alone["cluster_nodes"] == 1

    with netns_ray_cluster(3) as cluster:
        result = cluster.run_in_head(JOB, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    spread = json.loads(result.stdout.strip().splitlines()[-1])
    assert spread["address"] == cluster.ray_address
    assert spread["cluster_nodes"] == 3, spread["slots"]
    assert {s["address"] for s in spread["slots"]} == {cluster.address(n) for n in range(3)}
    for there, here in zip(spread["stats"], alone["stats"], strict=True):
        assert there["mean_response_length"] == here["mean_response_length"]
        for key in ("mean_reward", "kl", "policy_loss", "value_loss"):
            assert there[key] == pytest.approx(here[key], rel=1e-4, abs=1e-6), key
