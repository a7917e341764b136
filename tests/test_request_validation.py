# SPDX-License-Identifier: Apache-2.0
"""Per-request keys driven with arbitrary JSON (hypothesis): every value is either accepted, and then
the policy it configures runs on real tensors without an error, an overflow or a NaN, or refused
with a :class:`RequestConfigError` whose one-line message names the ``kvevict_*`` key and quotes at
most a short prefix of the value. Nothing else may happen (the engine-level twin, which sends the
same kind of requests to a real server, is ``tests/engine/test_hardening.py``)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.policy_reference import build
from vllm_kvevict.config import (
    MAX_PARAMS_CHARS,
    REQUEST_KEYS,
    KVEvictConfigError,
    RequestConfigError,
    parse_config,
    request_config,
    request_overrides,
)
from vllm_kvevict.policies import POLICIES, get_policy

SERVER = parse_config({"policy": "keydiff", "budget": 64})

# Arbitrary JSON, with the magnitudes that break naive code: huge and negative integers, floats
# near 0 and the limits, NaN/inf (vLLM's JSON parser accepts them), long strings, deep nesting.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0.0, 1e-300, 1e300, 0.5, 1.0, -0.0])
    | st.text(max_size=12)
    | st.text(min_size=200, max_size=400)
)
json_values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=12,
)


def _param_values(name: str) -> st.SearchStrategy:
    """Dicts over the policy's own parameter names (nested ones too), with arbitrary values."""
    fields = POLICIES[name].Params.model_fields
    if not fields:
        return st.dictionaries(st.text(max_size=6), json_values, max_size=2)
    keys = st.sampled_from(sorted(fields) + ["bogus"])
    good = {
        "window": st.integers(-2, 300),
        "kernel": st.integers(-2, 80),
        "bits": st.integers(-2, 80),
        "pooling": st.sampled_from(["avg", "max", "sum"]),
        "base": st.sampled_from(["h2o", "tova", "snapkv", "x"]),
        "snapkv": st.fixed_dictionaries({}, optional={"window": st.integers(-1, 300), "kernel": st.integers(-1, 99)}),
    }
    value = st.one_of(json_values, *good.values())
    return st.dictionaries(keys, value, max_size=4)


@st.composite
def overrides(draw) -> dict:
    xargs: dict = {}
    if draw(st.booleans()):
        xargs["kvevict_policy"] = draw(st.sampled_from(sorted(POLICIES)) | json_values)
    if draw(st.booleans()):
        xargs["kvevict_budget"] = draw(st.integers(-5, 5000) | json_values)
    if draw(st.booleans()):
        xargs["kvevict_enabled"] = draw(st.sampled_from([True, False, 0, 1]) | json_values)
    if draw(st.booleans()):
        p = xargs.get("kvevict_policy")
        policy = p if isinstance(p, str) and p in POLICIES else draw(st.sampled_from(sorted(POLICIES)))
        params = draw(_param_values(policy) | json_values)
        xargs["kvevict_params"] = json.dumps(params, allow_nan=True) if draw(st.booleans()) else params
    if draw(st.integers(0, 3)) == 0:
        xargs["kvevict_trigger"] = draw(st.sampled_from(["chunked", "once"]) | json_values)
    if draw(st.integers(0, 3)) == 0:
        xargs["kvevict_recall"] = draw(st.sampled_from([True, False, 0, 1]) | json_values)
    if draw(st.integers(0, 9)) == 0:
        xargs["kvevict_" + draw(st.text(max_size=60))] = draw(json_values)
    return xargs


def _run_policy(cfg) -> None:
    """The configured policy on small real tensors: no exception, finite kept K/V."""
    policy = get_policy(cfg.policy, cfg.policy_params)
    n = max(cfg.budget + 8, 24)
    if n > 512:  # keep the example fast: the budget only decides how many tokens are kept
        n = 512
    view, _ = build(policy, H=2, G=2, n=n, d=8, budget=min(cfg.budget, n - 1))
    if policy.needs.observes:
        policy.observe(view)
    keep = min(cfg.budget, n - 1)
    kept, merged = policy.evict(view, keep)
    assert kept.shape == (2, keep)
    if merged is not None:
        assert all(torch.isfinite(t).all() for t in merged)


@settings(
    max_examples=600, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(overrides())
def test_any_override_is_accepted_and_runs_or_refused_naming_the_key(xargs):
    try:
        cfg = request_config(SERVER, request_overrides(xargs))
    except RequestConfigError as err:
        msg = str(err)
        assert err.key in {k[:64] for k in xargs} or err.key.split(".")[0] in REQUEST_KEYS, (err.key, xargs)
        top = err.key.split(".")[0]
        assert "\n" not in msg and (top in msg if top in REQUEST_KEYS else msg.startswith("unknown request key")), msg
        assert len(msg) < 600, f"message echoes too much of the input ({len(msg)} characters)"
        return
    assert isinstance(cfg.budget, int) and not isinstance(cfg.budget, bool) and 1 <= cfg.budget
    _run_policy(cfg)


@pytest.mark.parametrize(
    "xargs, key, fragment",
    [
        ({"kvevict_budget": True}, "kvevict_budget", "Input should be a valid integer"),
        ({"kvevict_budget": 64.0}, "kvevict_budget", "allowed: an integer in [1, "),
        ({"kvevict_enabled": 2}, "kvevict_enabled", "allowed: true or false"),
        ({"kvevict_enabled": "false"}, "kvevict_enabled", "Input should be a valid boolean"),
        (
            {"kvevict_policy": "random", "kvevict_params": '{"seed": 18446744073709551616}'},
            "kvevict_params.seed",
            "allowed: an integer in [0, 2147483647]",
        ),
        (
            {"kvevict_policy": "lshe", "kvevict_params": '{"seed": -1}'},
            "kvevict_params.seed",
            "greater than or equal to 0",
        ),
        ({"kvevict_policy": "kvmerger", "kvevict_params": '{"sigma": 1e-300}'}, "kvevict_params.sigma", "[0.001, "),
        ({"kvevict_policy": "kvmerger", "kvevict_params": '{"threshold": NaN}'}, "kvevict_params.threshold", "finite"),
        ({"kvevict_policy": "snapkv", "kvevict_params": '{"window": 100000}'}, "kvevict_params.window", "[1, 128]"),
        (
            {"kvevict_policy": "caote", "kvevict_params": '{"snapkv": {"kernel": 4}}'},
            "kvevict_params.snapkv.kernel",
            "must be odd",
        ),
        ({"kvevict_params": "x" * (MAX_PARAMS_CHARS + 1)}, "kvevict_params", f"at most {MAX_PARAMS_CHARS} characters"),
        ({"kvevict_params": "[" * 5000}, "kvevict_params", "at most"),
        (
            {"kvevict_policy": "lshe", "kvevict_params": '{"a": {"b": {"c": {"d": {"e": 1}}}}}'},
            "kvevict_params",
            "nested at most 4 deep",
        ),
        ({"kvevict_policy": "p" * 10_000}, "kvevict_policy", "at most 64 characters"),
        ({"kvevict_trigger": "sometimes"}, "kvevict_trigger", "'chunked' or 'once'"),
        ({"kvevict_recall": 2}, "kvevict_recall", "allowed: true or false"),
    ],
)
def test_refusals_name_the_key_and_range(xargs, key, fragment):
    with pytest.raises(RequestConfigError) as ei:
        request_config(SERVER, request_overrides(xargs))
    assert ei.value.key == key
    assert fragment in str(ei.value) and str(ei.value).startswith(key)
    assert len(str(ei.value)) < 600


def test_vllm_xargs_booleans_arrive_as_integers():
    # vLLM types vllm_xargs values as str | int | float | list: JSON false reaches us as 0.
    assert request_config(SERVER, request_overrides({"kvevict_enabled": 0})).enabled is False
    assert request_config(SERVER, request_overrides({"kvevict_enabled": 1})).enabled is True


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    st.dictionaries(
        st.sampled_from(["policy", "budget", "enabled", "trigger", "snapkv", "random", "lshe", "x"]),
        json_values,
        max_size=4,
    )
)
def test_server_configuration_is_accepted_or_one_line(data):
    try:
        cfg = parse_config(data)
    except KVEvictConfigError as err:
        assert "\n" not in str(err) and len(str(err)) < 700
        return
    assert math.isfinite(cfg.budget)
    _run_policy(cfg)
