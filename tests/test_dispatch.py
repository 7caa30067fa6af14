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
