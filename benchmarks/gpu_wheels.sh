#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py needs on a bare GPU image that cannot reach a package registry (issue 26).
#
#   bash benchmarks/gpu_wheels.sh          # here, where pip reaches the registry: fills .whl/ (git-ignored)
#
# The image (docs/gpu.md) has torch, accelerate, tokenizers, safetensors, anyio, jinja2, typer, rich, tqdm and
# cloudpickle, but an older transformers than the engine accepts and no aiosqlite. So .whl/ gets: interlens
# itself (built from this tree: scheduler/ and store/ install inside it), the transformers this environment
# runs, and aiosqlite, as Python 3.12 wheels. On the GPU machine, with .whl carried:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && PYTHONPATH=/tmp/site python3 -u benchmarks/gpu_check.py --out "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl
mkdir .whl
"$python" -m pip wheel -q --no-deps -w .whl .
pins=$("$python" -c 'import importlib.metadata as m; print(*(f"{n}=={m.version(n)}" for n in ("transformers", "aiosqlite")))')
# shellcheck disable=SC2086  # the pins are words
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
ls -l .whl
du -sh .whl
