#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make test's pytest: the tests that start no engine on two processes (pytest-xdist; each is one
# core's work: the Triton interpreter, the schedule explorer), then the engine tests one at a time
# (each `vllm serve` binds the cores it is given). Arguments go to both runs. Fails when either run
# fails, or when neither collected a test (pytest's exit code 5 in both).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${KVEVICT_VENV:-.venv}/bin/python"

"$PY" -m pytest -m "not engine" -n "${KVEVICT_TEST_WORKERS:-2}" --dist loadfile "$@"
unit=$?
"$PY" -m pytest -m engine "$@"
engine=$?
echo "make test: tests without an engine exit $unit, engine tests exit $engine" >&2
if [[ $unit -eq 5 && $engine -eq 5 ]]; then
  echo "make test: pytest collected no tests" >&2
  exit 1
fi
for rc in $unit $engine; do
  [[ $rc -eq 0 || $rc -eq 5 ]] || exit "$rc"
done
exit 0
