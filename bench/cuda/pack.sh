#!/usr/bin/env bash
# Pack what bench/cuda/study.sh needs on a machine with no package registry into .device/ (ignored
# by git): wheels for CPython 3.12 on manylinux x86-64 that its image lacks, Ray trimmed of what a
# study never loads (Java, RLlib, Serve, Data, Train, Tune, the dashboard's web build), the
# llama-cpp-python sdist trimmed of models, docs and tests (tools/server and tools/ui kept: llama-server
# builds from them offline), and a tiny GGUF with SmolLM2's tokenizer.
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
D=$ROOT/.device
PY=${PYTHON:-$ROOT/.venv/bin/python}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$D/whl"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps $PLAT -d "$D/whl" optuna==5.0.0 sqlalchemy==2.1.9 alembic==1.20.1 \
    gguf==0.19.0 platformdirs jsonschema referencing rpds-py jsonschema-specifications diskcache \
    colorlog mako greenlet llama-optimus==0.1.9
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps $PLAT -d "$TMP" ray==2.60.0
(cd "$TMP" && mkdir ray && cd ray && unzip -q ../ray-*.whl &&
 rm -rf ray/jars ray/rllib ray/serve ray/data ray/train ray/tune ray/llm ray/dashboard/client/build &&
 tar cJf "$D/ray-trim.tar.xz" .)
$PY -m pip download -q --no-deps --no-binary :all: -d "$TMP" llama-cpp-python==0.3.36
(cd "$TMP" && tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36 &&
 rm -rf .git .github docs tests examples vendor/llama.cpp/{models,docs,benches,media,.github,gguf-py,tests,examples,conversion,.devops} &&
 rm -rf vendor/llama.cpp/ggml/src/ggml-{webgpu,et,metal,hexagon,sycl,vulkan,opencl} &&
 cd .. && tar cJf "$D/llama-src.tar.xz" llama_cpp_python-0.3.36)
"$ROOT/.venv/bin/fleettune" model synth --shape tiny -o "$D/vocab.gguf" > /dev/null
du -sh "$D"
