"""The `tune` flow: join (or start) Ray, find the chip's bench nodes, record them, run the study."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from orchestrator import dispatch
from orchestrator.db import Database, repo
from orchestrator.stopping import StopRequest, pause_on_signals
from orchestrator.studies import (
    ChipTarget,
    Progress,
    StudyConfig,
    StudyOutcome,
    StudyPaused,
    StudyRunner,
)
from workers.agent import NodeInfo
from workers.errors import BadInput
from workers.hardware import Fingerprint, fingerprint_live
from workers.simulated import is_sim_model


def record_nodes(db: Database, infos: list[NodeInfo]) -> dict[str, int]:
    """Store each node with its fingerprint; returns ray node id -> nodes.id."""
    ids = {}
    with db.session() as s:
        for info in infos:
            node = repo.upsert_node(
                s,
                ray_node_id=info.ray_node_id,
                hostname=info.hostname,
                fingerprint=Fingerprint.from_dict(info.fingerprint),
                llama_build=info.llama_build,
                simulated=info.simulated,
            )
            ids[info.ray_node_id] = node.id
    return ids


def nodes_by_chip(infos: list[NodeInfo], simulated_only: bool) -> dict[str, list[NodeInfo]]:
    """Nodes grouped by chip; a simulated model (sim://) can only run on simulated nodes."""
    by_chip: dict[str, list[NodeInfo]] = {}
    for info in infos:
        if simulated_only and not info.simulated:
            continue
        by_chip.setdefault(info.fingerprint.get("chip_key") or "?", []).append(info)
    return by_chip


def choose_chip(
    infos: list[NodeInfo], chip_key: str | None, simulated_only: bool = False
) -> tuple[Fingerprint, list[NodeInfo]]:
    """The chip the study runs on: the one asked for, or the only one in the cluster."""
    by_chip = nodes_by_chip(infos, simulated_only)
    if chip_key and simulated_only and chip_key not in by_chip and any(
        i.fingerprint.get("chip_key") == chip_key for i in infos
    ):
        raise BadInput(f"a simulated model runs only on simulated nodes; {chip_key} has none")
    if chip_key:
        if chip_key not in by_chip:
            present = ", ".join(sorted(by_chip)) or "none"
            raise BadInput(f"unknown chip {chip_key!r}: no bench node has it (present: {present})")
        chosen = by_chip[chip_key]
    elif len(by_chip) == 1:
        chosen = next(iter(by_chip.values()))
    elif not by_chip:
        raise BadInput("no bench node in the Ray cluster (start one with `fleettune worker start`)")
    else:
        raise BadInput(f"several chips in the cluster ({', '.join(sorted(by_chip))}); pass --chip")
    return Fingerprint.from_dict(chosen[0].fingerprint), chosen


def _runner(db, cfg, fingerprint, chosen, on_progress, warm: bool = False,
            stop: StopRequest | None = None) -> StudyRunner:
    target = ChipTarget(fingerprint, {}, simulated=any(i.simulated for i in chosen),
                        ray_nodes=tuple(i.ray_node_id for i in chosen))
    key = target.key
    if warm and not cfg.resume and not cfg.warm_start:
        from orchestrator.schedules import warm_start

        configs = warm_start(db, key, cfg.model, str(cfg.objective), target.simulated)
        cfg = replace(cfg, warm_start=tuple(configs))
    return StudyRunner(
        db,
        dispatch.RayDispatcher(),
        cfg,
        target,
        on_progress=on_progress,
        stop=stop,
    )


def tune_all_chips(
    db: Database,
    cfg: StudyConfig,
    *,
    address: str | None = None,
    on_progress: Callable[[str, Progress], None] | None = None,
    warm: bool = True,
    stop: StopRequest | None = None,
) -> list[StudyOutcome]:
    """One study per chip present in the cluster, all at once, each on its own chip's nodes.

    SIGINT, SIGTERM and SIGHUP pause every one of them; when any study paused, the others still
    run to their end and then ``StudyPaused`` names the paused ones (exit 3).
    """
    if cfg.name:
        raise BadInput("--study names one study; with --all-chips the names are chosen per chip")
    cfg.validate()
    stop = stop if stop is not None else StopRequest()
    # after joining Ray: ray.init sets its own SIGTERM handler (an exit), which ours replaces
    with dispatch.connected(address, local_chip_key=None if address else fingerprint_live().chip_key), \
            pause_on_signals(stop):
        infos = dispatch.describe_nodes(dispatch.bench_nodes())
        by_chip = nodes_by_chip(infos, is_sim_model(cfg.model.path))
        if not by_chip:
            raise BadInput("no bench node in the Ray cluster (start one with `fleettune worker start`)")
        runners = []
        for key, chosen in sorted(by_chip.items()):
            report = (lambda p, k=key: on_progress(k, p)) if on_progress else None
            runner = _runner(db, cfg, Fingerprint.from_dict(chosen[0].fingerprint), chosen, report, warm, stop)
            runner.prepare()  # every study is validated before any of them runs
            runners.append((runner, chosen))
        for runner, chosen in runners:
            runner.target.node_ids.update(record_nodes(db, chosen))

        return run_studies([r for r, _ in runners], stop)


def run_studies(runners: list[StudyRunner], stop: StopRequest) -> list[StudyOutcome]:
    """Run prepared studies at once, one thread each, the calling thread left free for signals.

    A study that pauses (a signal sets ``stop`` for all of them; no node left pauses one) does
    not stop the others; when any paused, ``StudyPaused`` names each after all have ended.
    """
    from concurrent.futures import ThreadPoolExecutor

    def run(runner: StudyRunner) -> StudyOutcome | StudyPaused:
        try:
            return runner.run()
        except StudyPaused as exc:
            return exc

    with ThreadPoolExecutor(max_workers=max(len(runners), 1), thread_name_prefix="study") as pool:
        futures = [pool.submit(run, r) for r in runners]
        while not all(f.done() for f in futures):  # wake often enough for a signal's handler
            stop.wait(0.2)
        outcomes = [f.result() for f in futures]
    paused = [o for o in outcomes if isinstance(o, StudyPaused)]
    if paused:
        raise StudyPaused("; ".join(str(p) for p in paused))
    return outcomes


def tune(
    db: Database,
    cfg: StudyConfig,
    *,
    address: str | None = None,
    chip_key: str | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    on_ready: Callable[[StudyRunner], None] | None = None,
    warm: bool = True,
    stop: StopRequest | None = None,
) -> StudyOutcome:
    """Run one study end to end; in embedded mode Ray is started here and stopped at the end.

    SIGINT, SIGTERM and SIGHUP pause the study (``StudyPaused``, exit 3)."""
    cfg.validate()
    local_key = None if address else fingerprint_live().chip_key
    stop = stop if stop is not None else StopRequest()
    # after joining Ray: ray.init sets its own SIGTERM handler (an exit), which ours replaces
    with dispatch.connected(address, local_chip_key=local_key), pause_on_signals(stop):
        nodes = dispatch.bench_nodes(chip_key)
        if not nodes and chip_key:
            raise BadInput(f"unknown chip {chip_key!r}: no bench node has it")
        infos = dispatch.describe_nodes(nodes)
        fingerprint, chosen = choose_chip(infos, chip_key, is_sim_model(cfg.model.path))
        runner = _runner(db, cfg, fingerprint, chosen, on_progress, warm, stop)
        runner.prepare()  # validates before it writes anything
        runner.target.node_ids.update(record_nodes(db, chosen))
        if on_ready:
            on_ready(runner)
        return runner.run()
