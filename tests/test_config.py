# SPDX-License-Identifier: Apache-2.0
"""The pydantic configuration: defaults, merging of the env var and --additional-config, one-line errors."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from vllm_kvevict.config import (
    ENV_VAR,
    KVEvictConfigError,
    RequestConfigError,
    config_from_vllm,
    parse_config,
    request_config,
    request_overrides,
)
from vllm_kvevict.policies import POLICIES


class _FakeVllmConfig:  # only the attribute config_from_vllm reads
    def __init__(self, additional_config):
        self.additional_config = additional_config


def test_defaults():
    cfg = parse_config({})
    assert cfg.enabled is True and cfg.policy == "keydiff" and cfg.budget == 2048


def test_policy_params_and_summary():
    cfg = parse_config({"policy": "streamingllm", "budget": 100, "streamingllm": {"sink_tokens": 8}})
    assert cfg.policy_params.sink_tokens == 8
    assert cfg.summary() == "policy=streamingllm, budget=100, sink_tokens=8"
    assert parse_config({"enabled": False}).summary() == "eviction disabled"


@pytest.mark.parametrize(
    "data, expected",
    [
        (
            {"budgett": 3},
            "unknown key 'kvevict.budgett'; allowed keys: budget, cache_windows, caote, copy_rewritten, criticalkv, enabled, fastcaote, h2o, knorm, kvmerger, limits, lshe, policy, random, recall, snapkv, streamingllm, stride, trigger",
        ),
        ({"streamingllm": {"sinks": 1}}, "unknown key 'kvevict.streamingllm.sinks'; allowed keys: sink_tokens"),
        ({"budget": "abc"}, "kvevict.budget: Input should be a valid integer"),
        ({"budget": 2.5}, "kvevict.budget: Input should be a valid integer"),
        ({"enabled": "maybe"}, "kvevict.enabled: Input should be a valid boolean"),
        (
            {"budget": 0},
            "kvevict.budget: Input should be greater than or equal to 1 (got 0; allowed: an integer in [1, 1073741824])",
        ),
        (
            {"budget": True},
            "kvevict.budget: Input should be a valid integer (got true; allowed: an integer in [1, 1073741824])",
        ),
        ({"budget": "12"}, 'kvevict.budget: Input should be a valid integer (got "12"'),
        ({"enabled": 1}, "kvevict.enabled: Input should be a valid boolean (got 1; allowed: true or false)"),
        (
            {"policy": "random", "random": {"seed": 2**64}},
            "kvevict.random.seed: Input should be less than or equal to 2147483647",
        ),
        (
            {"policy": "kvmerger", "kvmerger": {"sigma": 1e-300}},
            "kvevict.kvmerger.sigma: Input should be greater than or equal to 0.001 (got 1e-300; allowed: a finite number in [0.001, 1000000.0])",
        ),
        (
            {"policy": "snapkv", "snapkv": {"window": 4096}},
            "kvevict.snapkv.window: Input should be less than or equal to 128 (got 4096; allowed: an integer in [1, 128])",
        ),
        (
            {"trigger": "sometimes"},
            'kvevict.trigger: Input should be \'chunked\' or \'once\' (got "sometimes"; allowed: one of "chunked", "once", null)',
        ),
        ({"policy": "x" * 500}, "kvevict.policy: String should have at most 64 characters"),
        (
            {"policy": "streamingllm", "budget": 4},
            "kvevict.budget: budget 4 is below the minimum 5 for policy 'streamingllm'",
        ),
        (
            {"policy": "streamingllm", "budget": 10, "streamingllm": {"sink_tokens": 10}},
            "kvevict.budget: budget 10 is below the minimum 11",
        ),
        ({"policy": "h3o"}, "kvevict.policy: unknown policy 'h3o'; allowed values: " + ", ".join(sorted(POLICIES))),
    ],
)
def test_errors_are_one_line_naming_field_and_allowed(data, expected):
    with pytest.raises(KVEvictConfigError) as ei:
        parse_config(data)
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith("invalid kvevict configuration (--additional-config): ")
    assert expected in msg


def test_not_an_object():
    with pytest.raises(KVEvictConfigError, match="'kvevict' must be a JSON object"):
        config_from_vllm(_FakeVllmConfig({"kvevict": [1, 2]}))


def test_env_and_additional_config_merge(monkeypatch):
    monkeypatch.setenv(
        ENV_VAR, json.dumps({"policy": "streamingllm", "budget": 64, "streamingllm": {"sink_tokens": 2}})
    )
    cfg = config_from_vllm(_FakeVllmConfig({"kvevict": {"budget": 128}, "other_plugin": {"x": 1}}))
    assert (cfg.policy, cfg.budget, cfg.policy_params.sink_tokens) == ("streamingllm", 128, 2)
    # the env var alone
    assert config_from_vllm(_FakeVllmConfig({})).budget == 64


def test_env_errors_name_the_env_var(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "{not json")
    with pytest.raises(KVEvictConfigError, match=f"\\({ENV_VAR}\\): not valid JSON"):
        config_from_vllm(_FakeVllmConfig({}))
    monkeypatch.setenv(ENV_VAR, json.dumps({"policy": "nope"}))
    with pytest.raises(KVEvictConfigError, match=f"\\({ENV_VAR}\\): kvevict.policy: unknown policy 'nope'"):
        config_from_vllm(_FakeVllmConfig({}))


def test_frozen():
    cfg = parse_config({})
    with pytest.raises(ValidationError):
        cfg.budget = 3


def test_trigger_defaults_to_the_policy():
    assert parse_config({"policy": "keydiff"}).window(32).trigger == "chunked"
    assert parse_config({"policy": "criticalkv", "budget": 64}).window(32).trigger == "once"
    assert parse_config({"policy": "kvmerger"}).window(32).trigger == "once"
    assert parse_config({"policy": "criticalkv", "budget": 64, "trigger": "chunked"}).window(32).trigger == "chunked"


def test_request_params_merge_over_the_servers():

    server = parse_config({"policy": "caote", "budget": 64, "caote": {"base": "snapkv"}})
    over = request_overrides({"kvevict_params": json.dumps({"snapkv": {"window": 8}})})
    cfg = request_config(server, over)
    assert cfg.policy_params.base == "snapkv" and cfg.policy_params.snapkv.window == 8
    # The parameters belong to the request's policy, also when the request changes the policy.
    cfg = request_config(server, request_overrides({"kvevict_policy": "lshe", "kvevict_params": '{"bits": 8}'}))
    assert cfg.policy == "lshe" and cfg.policy_params.bits == 8
    bad = [
        ({"kvevict_params": "{not json"}, "kvevict_params"),
        ({"kvevict_params": "[1]"}, "kvevict_params"),
        ({"kvevict_params": '{"bitz": 8}', "kvevict_policy": "lshe"}, "kvevict_params.bitz"),
        ({"kvevict_params": '{"bits": 99}', "kvevict_policy": "lshe"}, "kvevict_params.bits"),
        ({"kvevict_params": '{"x": 1}', "kvevict_policy": "keydiff"}, "kvevict_params"),
    ]
    for xargs, key in bad:
        with pytest.raises(RequestConfigError) as ei:
            request_config(server, request_overrides(xargs))
        assert ei.value.key == key, (xargs, ei.value.key, str(ei.value))


@pytest.mark.parametrize(
    "limits, expected",
    [
        ({"keys": ["kvevict_budgte"]}, "kvevict.limits.keys: unknown request key 'kvevict_budgte'"),
        ({"policies": ["h3o"]}, "kvevict.limits.policies: unknown policy 'h3o'"),
        ({"min_budget": 300, "max_budget": 200}, "kvevict.limits: min_budget 300 is above max_budget 200"),
        ({"disable": "no"}, "kvevict.limits.disable: Input should be a valid boolean"),
        ({"max": 5}, "unknown key 'kvevict.limits.max'"),
    ],
)
def test_bad_limits_are_refused_at_startup(limits, expected):
    with pytest.raises(KVEvictConfigError) as ei:
        parse_config({"limits": limits})
    assert expected in str(ei.value)


def test_limits_refuse_overrides_naming_key_and_limit():
    """Each limit refuses what it names and nothing else; the defaults allow every key."""
    on = parse_config({"recall": {"enabled": True}})
    assert request_config(on, request_overrides({"kvevict_recall": True})).recall.enabled
    strict = {
        "keys": ["kvevict_policy", "kvevict_budget", "kvevict_enabled", "kvevict_recall"],
        "policies": ["keydiff"],
        "min_budget": 64,
        "max_budget": 128,
        "disable": False,
        "recall": False,
    }
    server = parse_config({"budget": 100, "limits": strict})
    for ok in (
        {"kvevict_budget": 64},
        {"kvevict_budget": 128},
        {"kvevict_policy": "keydiff"},
        {"kvevict_enabled": True},
    ):
        request_config(server, request_overrides(ok))
    refused = {
        "kvevict_budget": [63, 129],
        "kvevict_policy": ["snapkv"],
        "kvevict_enabled": [False],
        "kvevict_recall": [True],
        "kvevict_trigger": ["once"],
        "kvevict_params": ['{"window": 8}'],
    }
    for key, values in refused.items():
        for v in values:
            with pytest.raises(RequestConfigError) as ei:
                request_config(server, request_overrides({key: v}))
            assert ei.value.key == key and str(ei.value).startswith(f"{key}: ")
            assert "kvevict.limits" in str(ei.value)
    # one limit at a time: it refuses its own key only
    singles = {
        "disable": (False, "kvevict_enabled", False),
        "recall": (False, "kvevict_recall", True),
        "policies": (["keydiff"], "kvevict_policy", "snapkv"),
        "max_budget": (128, "kvevict_budget", 129),
    }
    for name, (value, _, _) in singles.items():
        one = parse_config({"limits": {name: value}})
        for other, (_, key, v) in singles.items():
            if other == name:
                with pytest.raises(RequestConfigError):
                    request_config(one, request_overrides({key: v}))
            else:
                request_config(one, request_overrides({key: v}))
    with pytest.raises(RequestConfigError, match="allowed keys: none"):
        request_config(parse_config({"limits": {"keys": []}}), request_overrides({"kvevict_budget": 64}))


def test_limits_and_copies_are_not_part_of_the_window_key():
    """What clients may ask and when blocks are copied aside do not change a window: one key."""
    from vllm_kvevict.request import resolve

    salts = {
        resolve(parse_config(c), None, 32).window_salt
        for c in ({}, {"limits": {"max_budget": 4096}}, {"copy_rewritten": "always"})
    }
    assert len(salts) == 1
    assert resolve(parse_config({"budget": 100}), None, 32).window_salt not in salts


def test_the_limits_examples_in_the_docs_are_what_the_server_says():
    """docs/operations.md, "Limits on clients": its configuration parses, and each quoted refusal
    is the message the plugin gives (a row "with keys allowing it" adds the request's key)."""
    import re
    from pathlib import Path

    text = Path(__file__).resolve().parents[1].joinpath("docs", "operations.md").read_text()
    section = text.split("## Limits on clients", 1)[1].split("\n## ", 1)[0]
    config = json.loads(re.search(r"--additional-config '(\{.*?\})'", section, re.S).group(1))["kvevict"]
    rows = re.findall(r"^\| `(\{.*?\})`( with .*?)? \| `(.*)` \|$", section, re.M)
    assert len(rows) == 5
    for request, extra, message in rows:
        xargs = json.loads(request)
        limits = dict(config["limits"])
        if extra:
            limits["keys"] = [*limits["keys"], *xargs]
        server = parse_config({**config, "limits": limits})
        with pytest.raises(RequestConfigError) as ei:
            request_config(server, request_overrides(xargs))
        assert str(ei.value) == message


def test_the_docs_list_the_request_keys_and_quote_their_errors():
    """configuration.md's per-request table has exactly the six keys; operations.md's "Bad input"
    table quotes the plugin's own messages for an unknown key, an unknown policy and a budget below
    the policy's minimum (the others are quoted in the engine tests)."""
    import re
    from pathlib import Path

    from vllm_kvevict.config import REQUEST_KEYS

    docs = Path(__file__).resolve().parents[1] / "docs"
    per_request = docs.joinpath("configuration.md").read_text().split("## Per request", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| `(kvevict_\w+)` \|", per_request, re.M) == list(REQUEST_KEYS)
    bad = docs.joinpath("operations.md").read_text().split("## Bad input", 1)[1].split("\n## ", 1)[0]
    assert all(k in bad.split("\n\n", 2)[1] for k in REQUEST_KEYS)  # the keys the section names
    quoted = dict(re.findall(r"^\| ([^|]+?) \| `(.*)` \|$", bad, re.M))
    server = parse_config({"policy": "streamingllm", "budget": 64})
    cases = {
        "unknown key": {"kvevict_budgte": 64},
        "below the policy's minimum": {"kvevict_budget": 3},
    }
    for row, xargs in cases.items():
        with pytest.raises(RequestConfigError) as ei:
            request_config(server, request_overrides(xargs))
        assert str(ei.value) == quoted[row], row
    with pytest.raises(RequestConfigError) as ei:
        request_config(server, request_overrides({"kvevict_policy": "h3o"}))
    assert str(ei.value).startswith(quoted["unknown policy"].removesuffix("..."))


def test_recall_shorthand_on_the_server_as_per_request():
    """``"recall": true`` on the server means what ``kvevict_recall: true`` means on a request."""
    assert parse_config({"recall": True}).recall == parse_config({"recall": {"enabled": True}}).recall
    assert not parse_config({"recall": False}).recall.enabled
    assert request_config(parse_config({}), request_overrides({"kvevict_recall": True})).recall == (
        parse_config({"recall": True}).recall
    )
    with pytest.raises(KVEvictConfigError, match="kvevict.recall: Input should be a valid dictionary"):
        parse_config({"recall": 1})


def test_the_docs_name_the_policies_that_evict_while_decoding():
    """configuration.md and eviction.md name the same policies as not evicting while decoding,
    and they are the ones whose ``Needs.decode`` is false (``none`` never evicts)."""
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    code = sorted(n for n, c in POLICIES.items() if n != "none" and not c(None).needs.decode)
    for name, pattern in (
        ("configuration.md", r"policies that evict while decoding \(all but ((?:`\w+`(?:, | and )?)+)\)"),
        ("eviction.md", r"Policies that evict while decoding \(every policy but ((?:`\w+`(?:, | and )?)+),"),
    ):
        found = re.search(pattern, docs.joinpath(name).read_text())
        assert found, name
        assert sorted(re.findall(r"`(\w+)`", found.group(1))) == code, name


def test_recall_decode_scores_the_answer_with_recall_s_equation():
    """``recall.decode = "recall"``: once a request's prompt is complete its compactions run
    SnapKV's equation with the recall's window, kernel and max pooling (the window clipped below
    the budget); otherwise, and for merging or fallen-back requests, the request's own policy."""
    from vllm_kvevict.backends import fault
    from vllm_kvevict.policies.snapkv import SnapKV
    from vllm_kvevict.request import RequestState, resolve

    on = {"policy": "keydiff", "budget": 200, "recall": {"enabled": True, "window": 16}}  # decode: recall
    st = resolve(parse_config(on), None, 32)
    dp = st.decode_policy
    assert isinstance(dp, SnapKV) and (dp.params.window, dp.params.kernel, dp.params.pooling) == (16, 31, "max")
    assert dp is st.decode_policy  # resolved once
    state = RequestState(st)
    assert fault.policy_of(state) is st.policy and fault.policy_of(state, True) is dp
    state.recall_failed = True  # its window is its policy's: so is the rest of its compactions
    assert fault.policy_of(state, True) is st.policy
    state.fell_back_from = "keydiff"
    assert fault.policy_of(state, True) is fault.SAFE_POLICY
    small = resolve(parse_config({**on, "budget": 8}), None, 32).decode_policy
    assert small.params.window == 7 and small.params.min_budget() <= 8
    for cfg in (
        {**on, "recall": {"enabled": True, "decode": "policy"}},
        {**on, "recall": {"enabled": False, "decode": "recall"}},
        {**on, "policy": "kvmerger"},  # merges: nothing to recall
    ):
        st = resolve(parse_config(cfg), None, 32)
        assert st.decode_policy is st.policy
    with pytest.raises(KVEvictConfigError, match="decode"):
        parse_config({"recall": {"decode": "answer"}})


def test_a_stride_below_the_window_says_windows_are_not_shared():
    """``cache_windows`` with a ``chunked`` stride below ``W`` caches no window (a compaction
    would rewrite an earlier point's): the server says why at start-up, and agrees with what
    each request then does (``RequestSettings.shares_windows``)."""
    from vllm_kvevict.request import resolve

    cases = [
        ({"budget": 512, "stride": 256}, True),
        ({"budget": 512, "stride": 500}, False),  # both round up to 512 blocks of 32
        ({"budget": 512}, False),
        ({"budget": 512, "stride": 256, "cache_windows": False}, False),
        ({"budget": 512, "stride": 256, "trigger": "once"}, False),
        ({"policy": "criticalkv", "budget": 512, "stride": 256}, False),  # its own trigger: once
    ]
    for data, warned in cases:
        cfg = parse_config(data)
        why = cfg.windows_not_shared(32)
        assert (why is not None) == warned, data
        if warned:
            assert "stride 256" in why and "(512)" in why
            assert not resolve(cfg, None, 32).shares_windows
