#!/usr/bin/env bash
# The GPU check as one command on a lent machine (tests/gpu/README.md): installs the wheels carried in .whl/ and
# pdkv itself (its C and CUDA kernels compiled by setup.py there, with the image's nvcc), then runs check.py and
# vllm_connector.py (the vLLM connector's worker side with CUDA caches).
# Extra arguments go to check.py (e.g. --parts checksum,transfer_nixl). The JSON lands in $OUT (or /tmp).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/build-inplace
started=$(date +%s)
# PDKV_BUILD_CUDA unset: a failed CUDA build only warns, and check.py then reports why the kernel is missing.
python3 -m pip install --no-deps --no-build-isolation --no-index --no-compile --target build-inplace . >"$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log"; exit 1; }
echo "[gpu check] pdkv built and installed in $(($(date +%s) - started))s" >&2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true
status=0
PYTHONUNBUFFERED=1 python3 tests/gpu/check.py --out "$out/gpu-check.json" "$@" || status=$?
PYTHONUNBUFFERED=1 timeout 300 python3 tests/gpu/vllm_connector.py --out "$out/vllm-connector.json" || status=$?
exit $status
