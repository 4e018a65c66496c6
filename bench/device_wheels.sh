#!/usr/bin/env bash
# The wheels bench/served_gpu.py needs on a GPU machine that has Python 3.12, torch, transformers
# and Triton but no Ray, Serve or their dependencies, and no package index: downloaded here into
# .whl/ (git-ignored through .git/info/exclude), Ray's trimmed of ray/jars (its 34 MB Java jar,
# never loaded by Python serving), the dashboard's web client and RLlib; xxhash, prometheus-client
# and redis for the cache server of a tiered deployment; pytest for the GPU tests
# (`python3 -m pytest -m gpu`). About 58 MB.
#
#   bash bench/device_wheels.sh            # then, there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site python3 bench/served_gpu.py --out $OUT/served_gpu.json
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=.whl
grep -qx "/$OUT/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$OUT/" >> .git/info/exclude; }
rm -rf "$OUT" && mkdir -p "$OUT"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$OUT" \
  ray==2.60.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection==0.4.5 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2 \
  openai==3.57.0 jiter==0.19.0 distro sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 \
  truststore==0.10.5 jsonschema==4.26.0 jsonschema-specifications referencing==0.37.0 rpds-py \
  protobuf==7.36.2 grpcio==1.85.3 grpcio-reflection==1.85.1 aiohttp-cors==0.8.1 colorful==0.5.8 \
  watchfiles==1.3.0 typer==0.29.2 rich==15.0.0 click==8.5.1 \
  xxhash==4.1.0 prometheus-client==0.26.0 redis==8.1.0 \
  pytest==8.4.2 pluggy==1.7.0 iniconfig==2.3.1 pytest-timeout==2.4.0
ray_whl=$(ls "$OUT"/ray-*.whl)
work=$(mktemp -d)
unzip -q "$ray_whl" -d "$work"
rm -rf "$work/ray/jars" "$work/ray/dashboard/client/build" "$work/ray/rllib"
record=$(ls "$work"/ray-*.dist-info/RECORD)
grep -v -e '^ray/jars/' -e '^ray/dashboard/client/build/' -e '^ray/rllib/' "$record" > "$record.new"
mv "$record.new" "$record"
rm "$ray_whl"
(cd "$work" && zip -q -r -9 "$OLDPWD/$ray_whl" .)
rm -rf "$work"
du -sh "$OUT"
