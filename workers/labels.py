"""The Ray labels and the custom resource a fleet node carries: what `worker start` sets and what the
head and the node itself read back. A leaf module (it imports nothing of the project), so every
side can name them without importing another's module (rule 21.5: no import circle)."""

from __future__ import annotations

BENCH_RESOURCE = "fleettune_bench"  # one slot per node: never two benchmarks on it at once
CHIP_LABEL = "fleettune.io/chip"
GPU_CORES_LABEL = "fleettune.io/gpu-cores"
MEMORY_LABEL = "fleettune.io/memory-gb"
HOSTNAME_LABEL = "fleettune.io/hostname"  # optional: a name to show instead of the OS hostname
SIMULATE_LABEL = "fleettune.io/simulate"  # value: a chip bin as "M2_Ultra.76.192"
SCENARIO_LABEL = "fleettune.io/scenario"
TIME_SCALE_LABEL = "fleettune.io/time-scale"
SPEED_LABEL = "fleettune.io/speed"  # a simulated node's speed relative to its chip (a degraded Mac)
TRIAL_S_LABEL = "fleettune.io/trial-s"  # a simulated node whose every trial takes this many seconds
