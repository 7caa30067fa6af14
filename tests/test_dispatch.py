"""The Dispatcher contract, on the in-process fleet the tests and benchmarks share."""

from __future__ import annotations

import pytest

from orchestrator.dispatch import Dispatcher, RayDispatcher
from orchestrator.virtual import VirtualFleet
from workers import simulated
from workers.trial import BenchParams, TrialSpec, Workload

CHIP = simulated.parse_chip("M1 Pro/16")


def spec(key: str) -> TrialSpec:
    return TrialSpec(model_path="sim://llama2-7b/q4_0", model_sha256="", params=BenchParams(n_gpu_layers=33),
                     workload=Workload(64, 16, 1), trial_key=key)


def test_both_dispatchers_have_every_method_of_the_protocol():
    for method in ("submit", "wait", "result", "cancel", "alive_nodes"):
        assert callable(getattr(Dispatcher, method))
        assert callable(getattr(VirtualFleet, method)) and callable(getattr(RayDispatcher, method)), method


def test_a_trial_holds_its_node_until_collected_and_a_cancelled_one_frees_it():
    fleet = VirtualFleet(CHIP, 2)
    assert fleet.alive_nodes(CHIP.chip_key) == fleet.nodes and fleet.alive_nodes("apple-m9-1g") == []
    first = fleet.submit(spec("search-1"), CHIP.chip_key, node_id=fleet.nodes[0])
    second = fleet.submit(spec("search-2"), CHIP.chip_key)
    with pytest.raises(RuntimeError, match="more trials submitted than nodes"):
        fleet.submit(spec("search-3"), CHIP.chip_key)
    fleet.cancel(second)
    fleet.cancel(second)  # a second cancel is ignored
    third = fleet.submit(spec("search-3"), CHIP.chip_key)  # the cancelled trial's node is free again
    done = fleet.wait([first, second, third], 1.0)
    assert done == [first, third]  # the cancelled trial never comes back
    assert fleet.wait([first, third], 0) == done  # finished, not collected: still handed out
    result = fleet.result(first, "search-1")
    assert result.ok and result.simulated and result.node_id == fleet.nodes[0]
    assert fleet.wait([first, third], 0) == [third]


def test_per_wait_hands_out_results_only_while_the_head_blocks():
    fleet = VirtualFleet(CHIP, 4, per_wait=3)
    refs = [fleet.submit(spec(f"search-{i}"), CHIP.chip_key) for i in range(4)]
    assert fleet.wait(refs, 0) == []  # a poll
    assert fleet.wait(refs, 0.5) == refs[:3]
    assert fleet.wait(refs, 0.5) == refs


def test_a_node_that_died_under_a_pinned_trial_is_sent_no_more_while_rays_node_table_lists_it(monkeypatch):
    """Ray's node table can list a node as alive for a while after a trial pinned to it failed with
    its death; the next pinned trial sent there fails at once (TaskUnschedulableError), so the
    study loop would send one after another. The dispatcher leaves such a node out, and reads
    Ray's list again after every lost node (its cache would otherwise hold it for ``nodes_ttl_s``)."""
    from types import SimpleNamespace

    import ray

    from orchestrator import dispatch
    from workers.trial import FailureKind

    listed = ["node-a", "node-b"]  # what Ray's node table says, whatever has happened
    asked = []

    def bench_nodes(chip_key=None):
        asked.append(chip_key)
        return [SimpleNamespace(ray_node_id=n) for n in listed]

    errors = {"lost-node-a": ray.exceptions.TaskUnschedulableError("pinned to a dead node"),
              "crash-node-b": ray.exceptions.WorkerCrashedError()}
    monkeypatch.setattr(dispatch, "bench_nodes", bench_nodes)
    monkeypatch.setattr(dispatch, "on_node", lambda func, node_id=None, **options: SimpleNamespace(
        remote=lambda spec: f"{spec.trial_key}-{node_id}"))
    dispatcher = RayDispatcher(nodes_ttl_s=3600)
    dispatcher._ray = SimpleNamespace(exceptions=ray.exceptions, get=lambda ref: (_ for _ in ()).throw(errors[ref]))

    assert dispatcher.alive_nodes(CHIP.chip_key) == listed and len(asked) == 1
    ref = dispatcher.submit(spec("lost"), CHIP.chip_key, node_id="node-a")
    result = dispatcher.result(ref, "confirm-1")
    assert not result.ok and result.error == "node lost" and result.kind is FailureKind.NODE_LOST
    assert dispatcher.alive_nodes(CHIP.chip_key) == ["node-b"] and len(asked) == 2  # asked again, a left out
    # a crashed worker (its node may live on) is a lost trial, not a dead node
    crashed = dispatcher.submit(spec("crash"), CHIP.chip_key, node_id="node-b")
    assert dispatcher.result(crashed, "search-2").kind is FailureKind.NODE_LOST
    assert dispatcher.alive_nodes(CHIP.chip_key) == ["node-b"] and len(asked) == 3
