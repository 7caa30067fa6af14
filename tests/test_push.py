"""`model push` on a real Ray cluster: a verified copy renamed into place, a different file left alone
unless forced, and a node SIGKILLed mid-push giving that node's error line, no traceback, no temp file.

Every node of the test cluster shares this machine's disk, so the tests push to a destination path
of their own (``dest``); on a fleet the destination is the model's path on the head.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import uuid
from pathlib import Path

import pytest

from orchestrator import dispatch
from tests.conftest import wait_until
from workers import agent
from workers.errors import BadInput


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def leftovers(directory: Path) -> list[Path]:
    return list(directory.glob(f"*{agent.PART_SUFFIX}"))


@pytest.fixture
def real_node(ray_cluster) -> dispatch.BenchNode:
    node_id = ray_cluster["real_node"].node_id
    return next(n for n in dispatch.bench_nodes() if n.ray_node_id == node_id)


@pytest.mark.cluster
def test_a_push_copies_verifies_and_renames(real_node, model_path, model_info, tmp_path):
    dest = tmp_path / "models" / "smollm2.gguf"
    outcome = dispatch.push_model(str(model_path), model_info.sha256, [real_node], dest=str(dest),
                                  chunk_bytes=16 << 20)
    assert outcome == {real_node.ray_node_id: "copied"}
    assert sha256(dest) == model_info.sha256 and not leftovers(dest.parent)
    again = dispatch.push_model(str(model_path), model_info.sha256, [real_node], dest=str(dest))
    assert again == {real_node.ray_node_id: "present"}


@pytest.mark.cluster
def test_a_different_file_is_replaced_only_with_force(real_node, model_path, model_info, tmp_path):
    dest = tmp_path / "smollm2.gguf"
    dest.write_bytes(b"someone else's model")
    outcome = dispatch.push_model(str(model_path), model_info.sha256, [real_node], dest=str(dest))
    assert outcome == {real_node.ray_node_id: "refused: a different file is there (use --force)"}
    assert dest.read_bytes() == b"someone else's model" and not leftovers(tmp_path)
    forced = dispatch.push_model(str(model_path), model_info.sha256, [real_node], dest=str(dest),
                                 force=True)
    assert forced == {real_node.ray_node_id: "replaced"}
    assert sha256(dest) == model_info.sha256 and not leftovers(tmp_path)


@pytest.mark.cluster
def test_a_source_changed_since_registration_is_bad_input(real_node, tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"version 1")
    registered = sha256(source)
    source.write_bytes(b"version 2")
    with pytest.raises(BadInput, match="changed since it was registered"):
        dispatch.push_model(str(source), registered, [real_node], dest=str(tmp_path / "out.gguf"))
    assert not (tmp_path / "out.gguf").exists()


def test_a_copy_that_does_not_verify_is_not_renamed(tmp_path):
    """The node's half, called directly: a bad copy never reaches the path and its temp is gone."""
    dest = tmp_path / "m.gguf"
    dest.write_bytes(b"the old file")
    part = agent.begin_model(str(dest))
    agent.write_model_chunk(part, 0, b"truncated cop")
    assert agent.finish_model(str(dest), part, sha256(dest), force=True) == "failed: sha256 mismatch"
    assert dest.read_bytes() == b"the old file" and not leftovers(tmp_path)
    with pytest.raises(ValueError):
        agent.write_model_chunk(str(dest), 0, b"x")  # only a push's temp file is ever written


@pytest.mark.cluster
def test_a_node_killed_mid_push_is_that_nodes_error(ray_cluster, tmp_path, capsys):
    from orchestrator.dispatch import BENCH_RESOURCE, CHIP_LABEL
    from tests.test_orphans import kill_raylet

    cluster = ray_cluster["cluster"]
    chip = f"push-test-{uuid.uuid4().hex[:8]}"
    victim, survivor = (cluster.add_node(num_cpus=1, resources={BENCH_RESOURCE: 1},
                                         labels={CHIP_LABEL: chip}) for _ in range(2))
    try:
        cluster.wait_for_nodes()
        nodes = {n.ray_node_id: n for n in dispatch.bench_nodes(chip)}
        order = [nodes[victim.node_id], nodes[survivor.node_id]]
        source = tmp_path / "big.gguf"
        source.write_bytes(os.urandom(48 << 20))
        dest_dir = tmp_path / "node"
        dest = dest_dir / "big.gguf"
        result: dict = {}
        pusher = threading.Thread(target=lambda: result.update(dispatch.push_model(
            str(source), sha256(source), order, dest=str(dest), chunk_bytes=256 << 10)))
        pusher.start()
        # mid-push: the victim's temp file holds some chunks, not all
        wait_until(lambda: dest_dir.is_dir() and any(p.stat().st_size >= 1 << 20
                                                     for p in leftovers(dest_dir)),
                   timeout=120, interval=0.01)
        partial = leftovers(dest_dir)
        assert partial and all(p.stat().st_size < source.stat().st_size for p in partial)
        kill_raylet(victim, capsys)
        pusher.join(timeout=300)
        assert not pusher.is_alive()
        assert result == {victim.node_id: "failed: node lost", survivor.node_id: "copied"}
        assert sha256(dest) == sha256(source)
        assert not leftovers(dest_dir)  # the victim's, removed when the next push to that path began
    finally:
        for node in (victim, survivor):
            with contextlib.suppress(Exception):
                cluster.remove_node(node, allow_graceful=True)  # a forced removal is reported later, into another test
