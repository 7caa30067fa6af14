"""Served traffic on a simulated Mac: llama-server's continuous batching of ``slots`` parallel
sequences on one chip, closed-loop users against it, and the capacity at an SLO (issue 22.6).

Every figure is simulated (the batch costs are workers/simulated_batched.py's, on the calibrated
single-stream model of workers/simulated.py). The requests it serves are ``RequestRecord``s and
their figures are workers/slo.py's ``figures``: one definition of TTFT, ITL, per-user tok/s and
goodput for simulated and measured load alike. Rules (numbered as the code cites them):

1. A server config is llama-server's ``-np SLOTS -c SLOTS x CTX`` (each slot its own KV cache of
   CTX positions, not unified) on one configuration of the other knobs; its GPU memory is
   workers/placement.py's one estimate for ``SLOTS x CTX`` positions. A config over the chip's
   working set is refused (out of memory), as the single-stream model refuses one; a request whose
   prompt and generated tokens exceed CTX is refused too (llama-server would cut it short).
2. Load: ``users`` closed-loop users; each sends a request (``prompt_tokens`` in, ``gen_tokens``
   out), waits for its last token and sends the next at once. Users start spread evenly (seeded
   order) over one single-stream request's time, so that they do not arrive as one burst; each
   user's first ``warmup`` requests are warm-up (never judged, slo.py rule 4).
3. Requests queue first in, first out for a free slot; a request waiting for one spends that time
   in its TTFT (when users outnumber slots).
4. Each server step is one batch: a decode token for every slot that is generating, then prompt
   tokens of slots still reading their prompt, in slot order, up to ``n_batch`` tokens in all
   (llama-server's update_slots). Its seconds are simulated_batched's mixed batch (a chunk of
   prompt beside the decode tokens) or its decode step, times seeded noise (lognormal, 3 %, as
   the simulated node's samples have).
5. A slot whose last prompt token is in a step produces its first token at that step's end (the
   request's TTFT), then one token per step; the request ends with its last token (e2e). So the
   per-user rate is the steps' rate, the aggregate rate over the active slots.
6. Capacity at an SLO: the most concurrent users whose measured requests meet the SLO (slo.py
   rules 1-3), found by doubling the users from 1, then by bisection between the last level that
   met it and the first that did not; never more than ``MAX_USERS``. Each level is simulated with
   its own seed, whatever the SLO: a looser SLO is judged on the same records.
7. Capacity with no config given searches the slots (1, 2, 4, ... to ``MAX_SLOTS``, while they fit)
   with the context each request needs (its prompt and generated tokens, rounded up to
   ``CTX_STEP``: a larger context only costs memory here) and llama-server's other defaults; the
   config serving the most users wins, the fewer slots on a tie.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from workers import placement
from workers.errors import BadInput
from workers.hardware import GIB, Fingerprint
from workers.models import ModelInfo
from workers.objective import CAP
from workers.simulated import SimulatedNode, model_shape
from workers.simulated_batched import StepModel, step_model
from workers.slo import SLO, LoadFigures, RequestRecord, figures, most_users
from workers.trial import BenchParams, FailureKind, Sample, TrialResult, TrialSpec

NOISE_CV = 0.03  # rule 4: the simulated node's noise (SimulatedNode.noise_cv)
MAX_USERS = 1024  # rule 6
MAX_SLOTS = 256  # rule 7: llama-server's -np as a node config bounds it (nodeconfig.SERVER_PARAM_BOUNDS)
CTX_STEP = 256  # rule 7
MIN_MEASURED = 32  # requests judged per level at the least (rule 2: each user sends enough of them)
MEASURED_PER_USER = 2  # requests each user sends after its warm-up, at the least
SERVER_BATCH, SERVER_UBATCH = 2048, 512  # llama-server's -b and -ub defaults
AUTO_SLOTS = 4  # llama-server's -np auto (tools/server/server.cpp)


@dataclass(frozen=True)
class ServerConfig:
    """Rule 1: llama-server's slots and context per slot, and the configuration of its other knobs."""

    slots: int
    ctx_per_slot: int
    params: BenchParams

    @property
    def n_ctx(self) -> int:
        """llama-server's -c: the context of all slots together."""
        return self.slots * self.ctx_per_slot

    def flags(self) -> str:
        return f"-np {self.slots} -c {self.n_ctx} {self.params.llama_cpp_flags('llama-server')}"

    def to_dict(self) -> dict:
        return {"slots": self.slots, "ctx_per_slot": self.ctx_per_slot, "params": self.params.to_dict()}

    @classmethod
    def of(cls, params: BenchParams, shape: ModelInfo) -> ServerConfig:
        """A node config's llama-server knobs as this model sees them: its slots (llama-server's
        auto: 4) and its context (the model's training context by default) split among them."""
        slots = params.n_parallel or AUTO_SLOTS
        n_ctx = params.n_ctx or shape.context_length or 4096
        return cls(slots, max(n_ctx // slots, 1), params)


@dataclass(frozen=True)
class ServedLoad:
    """Rule 2: the closed-loop load of one level."""

    users: int
    prompt_tokens: int
    gen_tokens: int
    warmup: int = 1  # requests per user never judged
    requests: int = MIN_MEASURED  # measured requests, at the least

    @property
    def measured_per_user(self) -> int:
        return max(MEASURED_PER_USER, math.ceil(self.requests / self.users))

    def check(self) -> None:
        if self.users < 1 or self.prompt_tokens < 1 or self.gen_tokens < 1:
            raise BadInput(f"served load needs at least 1 user, 1 prompt token and 1 generated token "
                           f"(got {self.users}, {self.prompt_tokens}, {self.gen_tokens})")


def default_params(chip: Fingerprint, shape: ModelInfo) -> BenchParams:
    """llama-server's defaults on a Mac: every layer on the GPU, -t the P-cores, -b 2048 -ub 512,
    flash attention auto."""
    return BenchParams(n_gpu_layers=shape.n_layer + 1, n_threads=chip.p_cores, n_batch=SERVER_BATCH,
                       n_ubatch=SERVER_UBATCH, flash_attn="auto")


def context_for(prompt_tokens: int, gen_tokens: int) -> int:
    """Rule 7: the context per slot a request needs, rounded up to ``CTX_STEP``."""
    return CTX_STEP * math.ceil((prompt_tokens + gen_tokens) / CTX_STEP)


def refusal(chip: Fingerprint, shape: ModelInfo, config: ServerConfig, load: ServedLoad | None = None) -> str | None:
    """Rule 1: why ``config`` cannot serve (out of memory, or a request longer than a slot), else None."""
    if config.slots < 1 or config.ctx_per_slot < 1:
        return f"a server needs at least 1 slot of at least 1 position (got {config.slots} x {config.ctx_per_slot})"
    if load is not None and load.prompt_tokens + load.gen_tokens > config.ctx_per_slot:
        return (f"context per slot {config.ctx_per_slot} < {load.prompt_tokens} prompt + {load.gen_tokens} "
                f"generated tokens")
    if config.params.kv_problem:
        return config.params.kv_problem
    need = placement.gpu_need(shape, config.params, config.n_ctx)
    limit = chip.memory_bytes * placement.WORKING_SET_FRACTION
    if placement.gpu_layers(shape, config.params)[0] and need.total > limit:
        return (f"out of memory: GPU share {need.total / GIB:.1f} GiB ({config.slots} slots x {config.ctx_per_slot} "
                f"positions of KV cache {need.kv_cache / GIB:.1f} GiB) > working-set limit {limit / GIB:.1f} GiB")
    return None


@dataclass
class _Slot:
    """A busy slot: whose request it serves, since when, and how far it is (rules 3-5)."""

    user: int
    arrival: float
    warmup: bool
    prompt_left: int
    ctx: int = 0  # positions in the slot's KV cache
    generated: int = 0
    ttft: float | None = None


def simulate_load(chip: Fingerprint, shape: ModelInfo, config: ServerConfig, load: ServedLoad, seed: int = 0,
                  steps: StepModel | None = None) -> list[RequestRecord]:
    """Rules 2-5: every request of one level of closed-loop load, as the load loop would record it
    (simulated). BadInput where the config is refused (rule 1)."""
    load.check()
    why = refusal(chip, shape, config, load)
    if why:
        raise BadInput(why)
    steps = steps or step_model(chip, shape, config.params)
    rng = random.Random(f"{seed}:{chip.label}:{shape.sha256}:{config.to_dict()}:{load}")
    per_user = load.warmup + load.measured_per_user
    lone_request_s = (steps.mixed_s(load.prompt_tokens, 0, 0, 0)
                      + (load.gen_tokens - 1) * steps.decode_s(1, load.prompt_tokens + load.gen_tokens // 2))
    order = list(range(load.users))
    rng.shuffle(order)
    arrivals = [(lone_request_s * i / load.users, user) for i, user in enumerate(order)]  # rule 2
    heapq.heapify(arrivals)
    sent = [0] * load.users
    queue: deque[tuple[int, float]] = deque()
    slots: list[_Slot | None] = [None] * config.slots
    records: list[RequestRecord] = []
    now = 0.0
    n_batch = config.params.n_batch
    while arrivals or queue or any(slots):
        while arrivals and arrivals[0][0] <= now:
            at, user = heapq.heappop(arrivals)
            queue.append((user, at))
        for i, slot in enumerate(slots):  # rule 3: first in, first out
            if slot is None and queue:
                user, at = queue.popleft()
                slots[i] = _Slot(user, at, sent[user] < load.warmup, load.prompt_tokens)
                sent[user] += 1
        active = [s for s in slots if s is not None]
        if not active:
            now = arrivals[0][0]
            continue
        decoding = [s for s in active if s.prompt_left == 0]  # rule 4
        budget = max(n_batch - len(decoding), 0)
        chunks: list[tuple[_Slot, int]] = []
        for s in active:
            if s.prompt_left and budget:
                take = min(s.prompt_left, budget)
                chunks.append((s, take))
                budget -= take
        positions = sum(s.ctx for s in decoding)
        prompt = sum(take for _, take in chunks)
        depth = round(sum(s.ctx * take for s, take in chunks) / prompt) if prompt else 0
        step_s = steps.mixed_s(prompt, depth, len(decoding), positions)
        now += step_s * math.exp(rng.gauss(0.0, NOISE_CV))
        for s in decoding:  # rule 5
            s.generated += 1
            s.ctx += 1
        for s, take in chunks:
            s.prompt_left -= take
            s.ctx += take
            if not s.prompt_left:
                s.generated, s.ttft = 1, now - s.arrival
        for i, s in enumerate(slots):
            if s is not None and s.generated >= load.gen_tokens:
                records.append(RequestRecord(start_s=s.arrival, prompt_tokens=load.prompt_tokens,
                                             gen_tokens=s.generated, ttft_s=s.ttft, e2e_s=now - s.arrival,
                                             warmup=s.warmup, users=load.users))
                slots[i] = None
                if sent[s.user] < per_user:
                    heapq.heappush(arrivals, (now, s.user))
    return records


def served_figures(chip: Fingerprint, shape: ModelInfo, config: ServerConfig, load: ServedLoad, slo: SLO,
                   seed: int = 0, steps: StepModel | None = None) -> LoadFigures:
    """The figures of one level of load (slo.py's ``figures`` of the simulated records)."""
    return figures(simulate_load(chip, shape, config, load, seed, steps), slo)


@dataclass(frozen=True)
class Capacity:
    """Rule 6's answer for one chip: the users served at the SLO and the config serving them."""

    chip: str
    model: str
    slo: str
    users: int  # 0: not even one user meets the SLO
    config: ServerConfig | None
    figures: LoadFigures | None  # at ``users``
    why_not_more: str  # what breaks the SLO at the next level searched, or why nothing fits
    simulated: bool = True
    levels: dict[int, bool] = field(default_factory=dict)  # users -> met the SLO, every level simulated

    @property
    def aggregate_tps(self) -> float | None:
        return self.figures.throughput_tps if self.figures else None

    @property
    def tps_p10(self) -> float | None:
        return self.figures.percentiles.get("tps_p10") if self.figures else None

    @property
    def ttft_p90(self) -> float | None:
        return self.figures.percentiles.get("ttft_p90") if self.figures else None

    @property
    def limited_by(self) -> str:
        """What stops more users, in a word: the SLO term broken at the next level ("ttft_p90"),
        "memory", "context" or "none"."""
        why = self.why_not_more
        if self.figures is None and self.users == 0 and why.startswith("out of memory"):
            return "memory"
        if why.startswith("context per slot"):
            return "context"
        if " breaks " in why:
            return why.split(" ", 1)[0]
        return "failed requests" if "failed" in why else "none"

    def row(self) -> dict:
        """The record the CLI prints (labelled simulated)."""
        config = self.config
        return {
            "chip": self.chip, "model": self.model, "slo": self.slo, "users": self.users,
            "limited_by": self.limited_by,
            "slots": config.slots if config else None, "ctx_per_slot": config.ctx_per_slot if config else None,
            "aggregate_tps": _rounded(self.aggregate_tps, 1), "tps_p10": _rounded(self.tps_p10, 1),
            "ttft_p90_s": _rounded(self.ttft_p90, 3), "flags": config.flags() if config else None,
            "why_not_more": self.why_not_more, "simulated": self.simulated,
        }


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _search_users(meets: Callable[[int], bool], max_users: int) -> tuple[int, int | None]:
    """Rule 6: slo.py's one search over users (doubling, then bisection)."""
    good, bad, _ = most_users(meets, max_users)
    return good, bad


def capacity_of(chip: Fingerprint, shape: ModelInfo, config: ServerConfig, slo: SLO, prompt_tokens: int,
                gen_tokens: int, seed: int = 0, max_users: int = MAX_USERS) -> Capacity:
    """Rule 6 for one config (refused configs serve 0 users, with the reason)."""
    model = f"{shape.shape_name} {shape.quant}"
    load = ServedLoad(1, prompt_tokens, gen_tokens)
    load.check()
    if prompt_tokens + gen_tokens > config.ctx_per_slot:  # rule 1: on no chip at all
        raise BadInput(refusal(chip, shape, config, load))
    why = refusal(chip, shape, config, load)
    if why:
        return Capacity(chip.label, model, str(slo), 0, config, None, why)
    steps = step_model(chip, shape, config.params)
    seen: dict[int, LoadFigures] = {}

    def meets(users: int) -> bool:
        if users not in seen:
            load = ServedLoad(users, prompt_tokens, gen_tokens)
            seen[users] = served_figures(chip, shape, config, load, slo, seed=seed, steps=steps)
        return seen[users].meets_slo

    users, bad = _search_users(meets, max_users)
    why_not = seen[bad].why if bad is not None else f"every level up to {max_users} users met the SLO"
    return Capacity(chip.label, model, str(slo), users, config, seen.get(users), why_not,
                    levels={u: f.meets_slo for u, f in sorted(seen.items())})


def capacity(chip: Fingerprint, shape: ModelInfo, slo: SLO, prompt_tokens: int = 280, gen_tokens: int = 128,
             config: ServerConfig | None = None, seed: int = 0, max_users: int = MAX_USERS) -> Capacity:
    """The most concurrent users ``chip`` serves ``shape`` to within ``slo`` (rule 6), with the
    given config or the best of rule 7's search."""
    if config is not None:
        return capacity_of(chip, shape, config, slo, prompt_tokens, gen_tokens, seed, max_users)
    ServedLoad(1, prompt_tokens, gen_tokens).check()
    params = default_params(chip, shape)
    ctx = context_for(prompt_tokens, gen_tokens)
    best: Capacity | None = None
    slots = 1
    while slots <= MAX_SLOTS:
        config = ServerConfig(slots, ctx, params)
        if best is not None and refusal(chip, shape, config) is not None:
            break  # rule 7: more slots need more memory still
        found = capacity_of(chip, shape, config, slo, prompt_tokens, gen_tokens, seed, max_users)
        if best is None or found.users > best.users:
            best = found
        slots *= 2
    return best


def capacity_per_chip(chips: list[Fingerprint], shape: ModelInfo, slo: SLO, prompt_tokens: int = 280,
                      gen_tokens: int = 128, slots: int | None = None, ctx_per_slot: int | None = None,
                      seed: int = 0) -> list[Capacity]:
    """``capacity`` on each chip: of ``slots`` slots of ``ctx_per_slot`` positions (default: what a
    request needs, rule 7) with llama-server's other defaults, or of rule 7's search when
    ``slots`` is None."""
    if ctx_per_slot is not None and slots is None:
        raise BadInput("--ctx-per-slot needs --slots (without them the slots and context are searched)")
    out = []
    for chip in {chip.label: chip for chip in chips}.values():  # bins parse_chip cannot tell apart, once
        config = None
        if slots is not None:
            ctx = ctx_per_slot if ctx_per_slot is not None else context_for(prompt_tokens, gen_tokens)
            config = ServerConfig(slots, ctx, default_params(chip, shape))
        out.append(capacity(chip, shape, slo, prompt_tokens, gen_tokens, config, seed))
    return out


# ---------------------------------------------------------------- the worker backend


def measure(node: SimulatedNode, spec: TrialSpec) -> TrialResult:
    """A served trial on a simulated Mac (issue 22.6): this module's continuous batching under the
    trial's closed-loop users, its records judged and sampled as a measured served trial's are
    (workers/served.py's level_of and window_samples); no file needed for a sim:// model."""
    import time
    import zlib

    from workers import served, slo

    started = time.time()
    try:
        shape = node.shape_for(spec.model_path) if node.shape_for else model_shape("llama2-7b", "q4_0")
    except BadInput as exc:
        return TrialResult.failure(spec.trial_key, str(exc), FailureKind.BAD_CONFIG, simulated=True)

    load, w = spec.served, spec.workload
    target = slo.parse_slo(load.slo)
    if load.rate is not None:
        return TrialResult.failure(spec.trial_key, "a simulated Mac serves closed-loop users (--users), "
                                   "not Poisson arrivals", FailureKind.BAD_CONFIG, simulated=True)
    config = ServerConfig.of(spec.params, shape)
    longest = ServedLoad(1, w.n_prompt + load.prompt_spread, w.n_gen)
    why = refusal(node.chip, shape, config, longest)
    if why:
        kind = FailureKind.OUT_OF_MEMORY if why.startswith("out of memory") else FailureKind.BAD_CONFIG
        return TrialResult.failure(spec.trial_key, why, kind, simulated=True, started_at=started,
                                   finished_at=time.time())
    levels: list[dict] = []

    def run(users: int, windows: int) -> dict:
        records = simulate_load(
            node.chip, shape, config,
            ServedLoad(users, w.n_prompt, w.n_gen, requests=load.requests * windows),
            seed=zlib.crc32(f"{node.seed}:{spec.trial_key}:{len(levels)}".encode()))
        levels.append(served.level_of(records, users, None, target, windows=windows))
        return levels[-1]

    if load.capacity:
        users, _ = served.capacity_levels(lambda n: run(n, 1)["figures"]["meets_slo"], load.max_users)
        samples = [Sample(CAP, 0, users, 1.0)]
    else:
        samples = served.window_samples(run(load.users, load.windows)["windows"])
    sim_seconds = sum(max((r["start_s"] + (r["e2e_s"] or 0) for r in lv["records"]), default=0.0)
                      for lv in levels)
    if node.time_scale > 0:
        time.sleep(sim_seconds * node.time_scale)  # the trial's duration, scaled; not synchronisation
    effective = {**spec.params.to_dict(), "n_parallel": config.slots, "n_ctx": config.n_ctx}
    return TrialResult(
        trial_key=spec.trial_key, ok=True, samples=samples, started_at=started, finished_at=time.time(),
        measure_s=sim_seconds, simulated=True, backend_info=node.backend_info(), effective=effective,
        served={"levels": levels, "build": {"backend": "simulated", "commit": None},
                "argv": config.flags().split(), "slo": str(target),
                "failed_requests": sum(lv["figures"]["failed"] for lv in levels)})
