# SPDX-License-Identifier: Apache-2.0
# Sourced by setup.sh and setup_vllm033.sh (after they set ROOT, VENV and PY): the stamp that makes
# them idempotent, and the venv itself. The stamp hashes the calling script, this file and
# pyproject.toml; when it matches and the environment still imports, nothing is installed again.

venv_skip_if_up_to_date() {  # $1: the calling script
  stamp_file="$VENV/.kvevict-setup-stamp"
  want_stamp="$(cat "$1" "$ROOT/scripts/venv_common.sh" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
  if [[ "${KVEVICT_FORCE:-0}" != 1 && -f "$stamp_file" && "$(cat "$stamp_file")" == "$want_stamp" ]] \
     && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ['vllm_kvevict', 'vllm', 'torch'])))" >/dev/null 2>&1; then
    echo "setup: up to date ($VENV)"
    exit 0
  fi
  echo "setup: creating/updating $VENV with $PY"
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
}

venv_done() {
  echo "$want_stamp" > "$stamp_file"
  echo "setup: done ($VENV)"
}
