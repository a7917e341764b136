#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The images' entrypoint: `vllm serve` with the kvevict attention backend, arguments passed through.
#
#   IMAGE MODEL [vllm serve options...]     e.g. IMAGE /models/my-model --served-model-name m
#
# runs `vllm serve MODEL --attention-backend kvevict [image defaults] [your options]`. vLLM wants
# the model as the first argument after `serve`, so it stays there; options after it are argparse's,
# where the last one given wins: yours override the image's defaults and even the backend
# (`--attention-backend custom` is the same backend). The image's defaults are read, one argument
# a line, from /etc/vllm-kvevict/serve-args when it exists (the CPU image: --enforce-eager and
# --block-size 32; the CUDA image has none). The kvevict configuration comes from
# `--additional-config '{"kvevict": {...}}'` or the environment variable KVEVICT_CONFIG='{...}'.
set -euo pipefail

DEFAULTS_FILE=/etc/vllm-kvevict/serve-args
defaults=()
if [[ -f $DEFAULTS_FILE ]]; then
  while IFS= read -r line || [[ -n $line ]]; do
    [[ -z $line || $line == \#* ]] || defaults+=("$line")
  done < "$DEFAULTS_FILE"
fi

if [[ $# -eq 0 ]]; then
  cat >&2 <<'USAGE'
vllm-kvevict: no model given.
usage: IMAGE MODEL [vllm serve options...]
  e.g. docker run -v /srv/models:/models:ro -p 8000:8000 IMAGE /models/MODEL_DIR --served-model-name my-model
  the kvevict configuration: KVEVICT_CONFIG='{"policy": "keydiff", "budget": 2048}' (environment) or
  --additional-config '{"kvevict": {"policy": "keydiff", "budget": 2048}}'
USAGE
  exit 2
fi

case $1 in
  -*) # no positional model: --help, --model M, --config FILE (vLLM moves --model to the front itself)
      exec vllm serve --attention-backend kvevict "${defaults[@]}" "$@" ;;
  *)  model=$1; shift
      exec vllm serve "$model" --attention-backend kvevict "${defaults[@]}" "$@" ;;
esac
