#!/usr/bin/env bash
# Download the wheels bench/gpu_check.py needs on a GPU machine with no network whose Python (3.12) already
# has torch, transformers, peft, numpy, httpx, rich and typer: the project's light dependencies and the
# worker's server (for the HTTP tests). Into .whl/ (git-ignored; about 8 MiB, well under the 60 MiB limit).
# Usage: bash bench/gpu_wheels.sh [python]   (the python whose pip downloads; default python3)
# PYVER=3.11 WHL=/tmp/w bash bench/gpu_wheels.sh   fetches for another Python into another folder (to rehearse).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
PKGS=(
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
  tenacity==9.2.1 sniffio==1.3.1 anyio==4.16.0
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 annotated-doc==0.0.7
  opentelemetry-api==1.45.2
  openai==3.57.0 jiter==0.19.0 distro==1.9.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
)
WHL=${WHL:-.whl}
mkdir -p "$WHL"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHL" "${PKGS[@]}"
du -sh "$WHL"
