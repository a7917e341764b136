# SPDX-License-Identifier: Apache-2.0
"""Plugin configuration: one pydantic model, read from vLLM's ``--additional-config`` and an env var.

    vllm serve MODEL --attention-backend kvevict \\
        --additional-config '{"kvevict": {"policy": "streamingllm", "budget": 256}}'
    KVEVICT_CONFIG='{"policy": "keydiff", "budget": 1024}' vllm serve MODEL --attention-backend kvevict

Both hold the same JSON object; when both are given they are merged and ``--additional-config``
wins key by key. Errors are reported as :class:`KVEvictConfigError`, whose message is one line that
names the field and the allowed values. Every field is documented in ``docs/configuration.md``.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from vllm_kvevict import envs
from vllm_kvevict.policies import POLICIES, Needs, PolicyParams
from vllm_kvevict.window import Trigger, WindowConfig, round_up

ENV_VAR = "KVEVICT_CONFIG"
ADDITIONAL_CONFIG_KEY = "kvevict"


class KVEvictConfigError(Exception):
    """A bad kvevict configuration. ``str(err)`` is a single line meant for the user.

    Deliberately not a ``ValueError``: vLLM's config classes are pydantic dataclasses, which would
    wrap a ValueError raised during their validation into a multi-line ValidationError.
    """


def _policy_fields() -> dict[str, Any]:
    # One optional sub-object per policy that has parameters, named after the policy.
    fields: dict[str, Any] = {}
    for name, cls in POLICIES.items():
        if cls.Params is not PolicyParams:
            fields[name] = (cls.Params, Field(default_factory=cls.Params, description=f"parameters of {name}"))
    return fields


#: Upper bound of every budget: far above any context vLLM serves, inside int32 positions.
#: A request's own budget is further bounded by the server's ``max_model_len`` (plugin.py).
MAX_BUDGET = 1 << 30
#: ``kvevict_params`` in a request: at most this many characters of JSON, nested this deep.
MAX_PARAMS_CHARS = 4096
MAX_PARAMS_DEPTH = 4
#: Error messages quote at most this many characters of an offending value.
QUOTE_CHARS = 40


#: Most queries the recall score reads per request and layer (kept outside vLLM's pool).
MAX_RECALL_WINDOW = 128


#: the per-request keys (OpenAI ``vllm_xargs`` / SamplingParams ``extra_args``, in the order the
#: docs list them) -> the configuration field each overrides
REQUEST_KEYS = {
    "kvevict_policy": "policy",
    "kvevict_budget": "budget",
    "kvevict_enabled": "enabled",
    "kvevict_params": "params",  # an object: parameters of the request's policy (its config sub-object)
    "kvevict_trigger": "trigger",
    "kvevict_recall": "recall",  # recall: on or off (its parameters: the server's)
}


class LimitsConfig(BaseModel):
    """What clients may ask for with the per-request keys (docs/operations.md, "Limits on
    clients"): a request beyond them is refused with a 400 naming its key and the limit. The
    defaults allow everything the keys can say."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    keys: tuple[str, ...] | None = Field(
        None, strict=False, description="the per-request keys clients may set; unset: all of them"
    )
    policies: tuple[str, ...] | None = Field(
        None, strict=False, description="the policies a request may choose (kvevict_policy); unset: all"
    )
    min_budget: int = Field(1, ge=1, le=MAX_BUDGET, description="the smallest kvevict_budget a request may ask")
    max_budget: int = Field(MAX_BUDGET, ge=1, le=MAX_BUDGET, description="the largest kvevict_budget a request may ask")
    disable: bool = Field(True, description="whether a request may turn eviction off (kvevict_enabled: false)")
    recall: bool = Field(True, description="whether a request may turn recall on where the server has it off")

    @field_validator("keys", "policies")
    @classmethod
    def _known(cls, v: tuple[str, ...] | None, info: ValidationInfo) -> tuple[str, ...] | None:
        if info.field_name == "keys":
            known, what, allowed = set(REQUEST_KEYS), "request key", f" (allowed: {', '.join(REQUEST_KEYS)})"
        else:
            known, what, allowed = set(POLICIES), "policy", ""
        for name in v or ():
            if name not in known:
                raise ValueError(f"unknown {what} {short_repr(name)}{allowed}")
        return v

    @model_validator(mode="after")
    def _budget_range(self) -> LimitsConfig:
        if self.min_budget > self.max_budget:
            raise ValueError(f"min_budget {self.min_budget} is above max_budget {self.max_budget}")
        return self


@lru_cache(maxsize=1)
def default_recall_bytes() -> int:
    """The recall tiers' host-memory budget per worker process when ``recall.max_bytes`` is unset:
    a sixteenth of the machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 16


class RecallConfig(BaseModel):
    """The recall tier: tokens a compaction evicts are kept outside vLLM's pool, and when the prompt
    completes the window is re-selected from kept and evicted tokens together, with the prompt's
    last queries (docs/eviction.md, "Recall")."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    enabled: bool = Field(False, description="keep evicted tokens and recall the best of them at the prompt's end")
    # No per-request cap by default: a policy's score need not foresee the question (SnapKV's does not), so
    # a cap that drops its lowest-scored tokens loses needles recall would bring back (docs/policies.md,
    # "Recall grid"); host memory is bounded per worker by max_bytes.
    cap: int = Field(
        MAX_BUDGET,
        ge=0,
        le=MAX_BUDGET,
        description="evicted tokens kept per request, layer and KV head (the lowest-scored go first); "
        "default: every one (max_bytes bounds the worker's tiers)",
    )
    window: int = Field(32, ge=1, le=MAX_RECALL_WINDOW, description="the prompt's last queries that score the recall")
    # Wider than SnapKV's 7: a recalled token helps only with its neighbours (a 7-digit number is 8
    # tokens in SmolLM2's tokenizer, after the key the question matches); measured in docs/policies.md.
    kernel: int = Field(31, ge=1, le=63, description="odd width of the max-pooling over neighbouring positions")
    # After the prompt the window holds what recall chose for the question; the request's policy scores the
    # answer's compactions by its own view and can drop it (docs/policies.md, the 5 % column).
    decode: Literal["policy", "recall"] = Field(
        "recall",
        description="what scores a request's compactions once its prompt is complete: its policy, or recall's score "
        "(the attention of its latest `window` queries, max-pooled over `kernel` positions: SnapKV's equation)",
    )
    # Chunked eviction computes every chunk after a compaction against the window alone; the tier
    # holds the rest of the prompt's KV, exact: "all" lets each prefill chunk attend to it too.
    prefill: Literal["window", "all"] = Field(
        "window",
        description="what a prefill chunk attends to: the window (as without recall), or the window and the "
        "whole tier, so the prompt is computed as without eviction (KV in vLLM's pool still bounded by the "
        "window; the attention over window and tier computed in torch, in place of vLLM's kernel in a step of such chunks alone)",
    )
    max_bytes: int | None = Field(
        None,
        ge=0,
        le=2**50,
        description="host memory all recall tiers of one worker process may hold, in bytes, those of cached "
        "windows at most half (the lowest-scored tokens across requests go first); unset: a sixteenth of the "
        "machine's physical memory",
    )

    @property
    def host_bytes(self) -> int:
        """``max_bytes``, or where unset a sixteenth of the machine's physical memory."""
        return default_recall_bytes() if self.max_bytes is None else self.max_bytes

    @field_validator("kernel")
    @classmethod
    def _odd(cls, v: int) -> int:
        if v % 2 == 0:
            raise ValueError("kernel must be odd")
        return v


class _Base(BaseModel):
    # Strict: an integer is a JSON integer (not a bool, float or string), a bool a JSON bool; floats
    # are finite. Every bound is in the field, so a refusal can name the allowed range.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    enabled: bool = Field(True, description="evict at all; false keeps every token (stock vLLM behaviour)")
    policy: str = Field("keydiff", max_length=64, description="eviction policy, one of POLICIES")
    budget: int = Field(2048, ge=1, le=MAX_BUDGET, description="tokens kept per sequence, per layer and KV head")
    trigger: Literal["chunked", "once"] | None = Field(
        None,
        description="chunked: compact at every stride boundary; once: only when the prompt completes; "
        "unset: the policy's own (once for criticalkv and kvmerger, chunked otherwise)",
    )
    stride: int | None = Field(
        None,
        ge=1,
        le=MAX_BUDGET,
        description="tokens between compaction points (chunked trigger), rounded up to whole KV blocks; "
        "unset: the budget rounded up to a block. No prefill chunk crosses a compaction point",
    )
    recall: RecallConfig = Field(default_factory=RecallConfig, description="the recall tier (off by default)")
    limits: LimitsConfig = Field(
        default_factory=LimitsConfig, description="what clients may ask with the per-request keys (server only)"
    )
    cache_windows: bool = Field(
        True,
        description="with prefix caching on, cache each compacted window for later requests with the same prefix "
        "and configuration (docs/architecture.md, 'Compressed windows'); false: pure blocks only",
    )
    copy_rewritten: Literal["shared", "always"] = Field(
        "shared",
        description="when a compaction copies aside the cached blocks it rewrites (so a later request whose "
        "prefix ends between two compaction points starts past the window): shared: only while a request "
        "waits for this one's windows (a document arriving together); always: at every compaction point "
        "(a document sent again later), each copy a block taken beside the window at its fullest while its step "
        "is scheduled, then a cached block",
    )

    @field_validator("recall", mode="before")
    @classmethod
    def _recall_shorthand(cls, v: Any) -> Any:
        """``"recall": true`` (or ``false``), as the per-request ``kvevict_recall`` says it."""
        return {"enabled": v} if isinstance(v, bool) else v

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown policy {short_repr(v)}")
        return v


def _build_model() -> type[_Base]:
    from pydantic import create_model

    model = create_model("KVEvictConfig", __base__=_Base, **_policy_fields())
    model.__doc__ = "The ``kvevict`` configuration object (see docs/configuration.md)."
    return model


class KVEvictConfig(_build_model()):  # type: ignore[misc]
    """The ``kvevict`` configuration object (see docs/configuration.md)."""

    @model_validator(mode="after")
    def _budget_above_protected(self) -> KVEvictConfig:
        floor = self.policy_params.min_budget()
        if self.budget < floor:
            raise ValueError(
                f"budget {self.budget} is below the minimum {floor} for policy {self.policy!r} "
                f"(its protected sink/recent tokens plus one)"
            )
        return self

    @property
    def policy_params(self) -> PolicyParams:
        params = getattr(self, self.policy, None)
        return params if isinstance(params, PolicyParams) else POLICIES[self.policy].Params()

    @property
    def eviction_active(self) -> bool:
        """Whether any token is ever evicted (``enabled`` and a policy other than ``none``)."""
        return self.enabled and self.policy != "none"

    @property
    def policy_needs(self) -> Needs:
        """What the configured policy reads and when it runs (its :class:`Needs`; built once per
        policy and parameters in a process)."""
        return _needs(self.policy, self.policy_params)

    @property
    def effective_trigger(self) -> Trigger:
        return self.trigger or self.policy_needs.trigger

    def window(self, block_size: int) -> WindowConfig:
        """The physical-window parameters for a KV cache with this block size."""
        needs = self.policy_needs
        return WindowConfig(
            budget=self.budget,
            block_size=block_size,
            trigger=self.trigger or needs.trigger,
            decode=needs.decode,
            enabled=self.eviction_active,
            stride=round_up(self.stride, block_size) if self.stride else 0,
        )

    def windows_not_shared(self, block_size: int) -> str | None:
        """Why compacted windows are never cached for reuse under this configuration although
        ``cache_windows`` asks for them (None: they are, or it does not ask): a ``chunked`` stride
        below ``W`` (a compaction would rewrite the window an earlier point cached)."""
        w = self.window(block_size)
        if not (self.cache_windows and w.enabled and w.trigger == "chunked") or w.step >= w.window:
            return None
        return (
            f"stride {w.step} is below the budget rounded up to a block ({w.window}): compacted windows are not "
            "cached for reuse (cache_windows needs a stride of at least that; unset stride for the budget)"
        )

    def summary(self) -> str:
        if not self.enabled:
            return "eviction disabled"
        extra = self.policy_params.model_dump()
        args = "".join(f", {k}={v}" for k, v in extra.items())
        trigger = "" if self.effective_trigger == "chunked" else f", trigger={self.effective_trigger}"
        return f"policy={self.policy}, budget={self.budget}{trigger}{args}"


@lru_cache(maxsize=256)
def _needs(policy: str, params: PolicyParams) -> Needs:
    return POLICIES[policy](params).needs


def _allowed_values(field_path: list[str]) -> str:
    """The allowed values/keys at a location of the config, for error messages."""
    model: type[BaseModel] = KVEvictConfig
    for part in field_path:
        ann = model.model_fields[part].annotation if part in model.model_fields else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            break
    return ", ".join(sorted(model.model_fields))


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``value`` as JSON (or repr), cut to ``limit`` characters: messages never echo a whole input."""
    try:
        return _cut(json.dumps(value), limit)
    except (TypeError, ValueError):
        return short_repr(value, limit)


def short_repr(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` of at most about ``limit`` characters (for names: policies, keys)."""
    return _cut(repr(value), limit)


def _field_at(loc: list[str]):
    """The pydantic FieldInfo at a location of the configuration, or None."""
    model: Any = KVEvictConfig
    info = None
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return None
        info = fields[part]
        model = info.annotation
    return info


def allowed_range(loc: list[str]) -> str:
    """What the field at ``loc`` accepts, from its type and bounds: "an integer in [1, 128]"."""
    import annotated_types as at

    info = _field_at(loc)
    if info is None:
        return ""
    ann = info.annotation
    kind = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(ann)
    if kind is None:
        from typing import get_args

        flat = [b for a in get_args(ann) for b in (get_args(a) or (a,))]  # Literal[...] | None
        if flat and all(isinstance(a, str) or a is type(None) for a in flat):
            return "one of " + ", ".join("null" if a is type(None) else json.dumps(a) for a in flat)
        return ""
    lo: Any = None
    hi: Any = None
    lo_open = hi_open = False
    for m in info.metadata:
        if isinstance(m, at.Ge):
            lo = m.ge
        elif isinstance(m, at.Gt):
            lo, lo_open = m.gt, True
        elif isinstance(m, at.Le):
            hi = m.le
        elif isinstance(m, at.Lt):
            hi, hi_open = m.lt, True
    if lo is None and hi is None:
        return kind
    return (
        f"{kind} in {'(' if lo_open else '['}{lo if lo is not None else '-inf'}, "
        f"{hi if hi is not None else 'inf'}{')' if hi_open else ']'}"
    )


def _config_key(loc: list[str]) -> str:
    return ".".join(["kvevict", *loc])


def _one_line(err: ValidationError, source: str, key=_config_key) -> str:
    e = err.errors(include_url=False)[0]
    loc = [str(p) for p in e["loc"]]
    where = key(loc)
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        parent = loc[:-1]
        text = f"unknown key {short_repr(where)}; allowed keys: {_allowed_values(parent)}"
    elif loc == ["policy"]:
        text = f"{where}: {msg}; allowed values: {', '.join(sorted(POLICIES))}"
    elif not loc:
        text = f"{key(['budget'])}: {msg}"  # model-level (budget vs. policy minimum)
    else:
        allowed = allowed_range(loc)
        text = f"{where}: {msg} (got {quote(e.get('input'))}{'; allowed: ' + allowed if allowed else ''})"
    if len(err.errors()) > 1:
        text += f" (and {len(err.errors()) - 1} more error(s))"
    return f"invalid kvevict configuration ({source}): {text}" if source else text


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _env_config() -> dict[str, Any]:
    raw = envs.KVEVICT_CONFIG
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise KVEvictConfigError(f"invalid kvevict configuration ({ENV_VAR}): not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise KVEvictConfigError(f"invalid kvevict configuration ({ENV_VAR}): expected a JSON object, got {raw!r}")
    return data


def parse_config(data: Any, source: str = "--additional-config") -> KVEvictConfig:
    """Validate a ``kvevict`` dict; raise :class:`KVEvictConfigError` with one line on failure."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise KVEvictConfigError(
            f"invalid kvevict configuration ({source}): 'kvevict' must be a JSON object, got {json.dumps(data)}"
        )
    try:
        return KVEvictConfig.model_validate(data)
    except ValidationError as err:
        raise KVEvictConfigError(_one_line(err, source)) from None


def raw_config(additional_config: Any) -> tuple[dict[str, Any] | None, str]:
    """The merged raw ``kvevict`` dict from the env var and vLLM's additional_config, and its source.

    Returns ``(None, ...)`` when neither holds a kvevict configuration.
    """
    env = _env_config()
    extra = additional_config.get(ADDITIONAL_CONFIG_KEY) if isinstance(additional_config, dict) else None
    if extra is not None and not isinstance(extra, dict):
        raise KVEvictConfigError(
            f"invalid kvevict configuration (--additional-config): 'kvevict' must be a JSON object, got {json.dumps(extra)}"
        )
    sources = [
        s
        for s, d in ((ENV_VAR, env if envs.is_set(ENV_VAR) else None), ("--additional-config", extra))
        if d is not None
    ]
    if not sources:
        return None, "defaults"
    return _merge(env, extra or {}), " + ".join(sources)


def config_from_vllm(vllm_config: Any) -> KVEvictConfig:
    """The plugin config for a ``VllmConfig`` (cached per distinct JSON)."""
    data, source = raw_config(getattr(vllm_config, "additional_config", None))
    return _parse_cached(json.dumps(data or {}, sort_keys=True), source)


@lru_cache(maxsize=16)
def _parse_cached(data_json: str, source: str) -> KVEvictConfig:
    return parse_config(json.loads(data_json), source)


# ---------------------------------------------------------------------------------------------
# Per-request overrides: OpenAI ``vllm_xargs`` / SamplingParams ``extra_args`` (:data:`REQUEST_KEYS`).

_FIELD_TO_KEY = {v: k for k, v in REQUEST_KEYS.items()}


class RequestConfigError(KVEvictConfigError):
    """A bad per-request override; ``key`` is the request key it names."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


def request_overrides(extra_args: Any) -> tuple[tuple[str, Any], ...] | None:
    """The kvevict overrides of a request's ``extra_args`` as a hashable, sorted tuple (or None)."""
    if not extra_args or not isinstance(extra_args, dict):
        return None
    unknown = sorted(k for k in extra_args if isinstance(k, str) and k.startswith("kvevict_") and k not in REQUEST_KEYS)
    if unknown:
        raise RequestConfigError(
            f"unknown request key {short_repr(unknown[0])}; allowed keys: {', '.join(sorted(REQUEST_KEYS))}",
            unknown[0][:64],
        )
    raw = {REQUEST_KEYS[k]: v for k, v in extra_args.items() if k in REQUEST_KEYS}
    if not raw:
        return None
    try:
        typed = _Overrides.model_validate(raw)
    except ValidationError as err:
        raise _request_error(err, _Overrides) from None
    items = {k: v for k, v in typed.model_dump().items() if v is not None}
    if "params" in items:  # hashable: the tuple keys per-request config caches
        items["params"] = json.dumps(items["params"], sort_keys=True)
    return tuple(sorted(items.items()))


def _depth(obj: Any) -> int:
    """Nesting depth of a JSON value (a scalar is 0, ``{}`` is 1)."""
    if isinstance(obj, dict):
        return 1 + max((_depth(v) for v in obj.values()), default=0)
    if isinstance(obj, list):
        return 1 + max((_depth(v) for v in obj), default=0)
    return 0


def _zero_one(v: Any) -> Any:
    # vLLM's ``vllm_xargs`` is typed ``str | int | float | list``: pydantic turns a JSON true/false
    # into 1/0 before we see it, so exactly those two integers stand for the booleans here.
    return bool(v) if type(v) is int and v in (0, 1) else v


class _Overrides(BaseModel):
    """The types of the per-request keys (their values are checked against the server's config later)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
    policy: str | None = Field(None, max_length=64)
    budget: int | None = Field(None, ge=1, le=MAX_BUDGET)
    enabled: Annotated[bool | None, BeforeValidator(_zero_one)] = None
    trigger: Literal["chunked", "once"] | None = None
    recall: Annotated[bool | None, BeforeValidator(_zero_one)] = None
    # vLLM's ``vllm_xargs`` carries strings, numbers and lists: the parameters come as a JSON object
    # in a string (a dict passes too, from the Python API's ``extra_args``).
    params: dict[str, Any] | None = None

    @field_validator("params", mode="before")
    @classmethod
    def _json_object(cls, v: Any) -> Any:
        if isinstance(v, str):
            if len(v) > MAX_PARAMS_CHARS:
                raise ValueError(f"at most {MAX_PARAMS_CHARS} characters of JSON")
            try:
                v = json.loads(v)
            except (ValueError, RecursionError):  # JSONDecodeError, over-long integers, deep nesting
                raise ValueError("must be a JSON object of the policy's parameters") from None
            if not isinstance(v, dict):
                raise ValueError("must be a JSON object of the policy's parameters")
        if isinstance(v, dict):
            try:
                size, depth = len(json.dumps(v)), _depth(v)
            except (TypeError, ValueError, RecursionError):
                raise ValueError("must be a JSON object of the policy's parameters") from None
            if size > MAX_PARAMS_CHARS or depth > MAX_PARAMS_DEPTH:
                raise ValueError(
                    f"at most {MAX_PARAMS_CHARS} characters of JSON, nested at most {MAX_PARAMS_DEPTH} deep"
                )
        return v


_REQUEST_RANGES = {
    "kvevict_policy": "one of " + ", ".join(sorted(POLICIES)),
    "kvevict_budget": f"an integer in [1, {MAX_BUDGET}]",
    "kvevict_enabled": "true or false",
    "kvevict_params": f"a JSON object (in a string) of the policy's parameters, at most {MAX_PARAMS_CHARS} characters",
    "kvevict_trigger": "chunked or once",
    "kvevict_recall": "true or false",
}


def _request_error(err: ValidationError, model: type[BaseModel] | None = None) -> RequestConfigError:
    loc = [str(p) for p in err.errors()[0]["loc"]]

    def key(loc: list[str]) -> str:
        if loc and loc[0] in POLICIES:  # a parameter of the policy's sub-object
            return "kvevict_params." + ".".join(loc[1:]) if len(loc) > 1 else "kvevict_params"
        return _FIELD_TO_KEY.get(loc[0] if loc else "budget", ".".join(loc))

    text = _one_line(err, "", key=key)
    if model is _Overrides and loc and (r := _REQUEST_RANGES.get(key(loc))) and "allowed" not in text:
        text += f" (allowed: {r})"
    return RequestConfigError(text, key(loc)[:64])


def request_config(server: KVEvictConfig, overrides: tuple[tuple[str, Any], ...] | None) -> KVEvictConfig:
    """The server configuration with one request's overrides applied (validated, cached)."""
    return _request_config(server, overrides) if overrides else server


def _check_limits(server: KVEvictConfig, over: dict[str, Any]) -> None:
    """Refuse overrides beyond the operator's limits (a :class:`RequestConfigError` naming the key)."""
    limits = server.limits

    def refuse(field: str, what: str) -> RequestConfigError:
        key = _FIELD_TO_KEY[field]
        return RequestConfigError(f"{key}: {what} (this server's kvevict.limits)", key)

    for field in over:
        if limits.keys is not None and _FIELD_TO_KEY[field] not in limits.keys:
            allowed = ", ".join(limits.keys) or "none"
            raise refuse(field, f"clients may not set this key (allowed keys: {allowed})")
    if "policy" in over and limits.policies is not None and over["policy"] not in limits.policies:
        raise refuse("policy", f"{short_repr(over['policy'])} is not allowed (allowed: {', '.join(limits.policies)})")
    if "budget" in over and not limits.min_budget <= over["budget"] <= limits.max_budget:
        raise refuse("budget", f"{over['budget']} is outside the allowed [{limits.min_budget}, {limits.max_budget}]")
    if over.get("enabled") is False and not limits.disable:
        raise refuse("enabled", "clients may not turn eviction off (allowed: true)")
    if over.get("recall") is True and not server.recall.enabled and not limits.recall:
        raise refuse("recall", "clients may not turn recall on (allowed: false)")


@lru_cache(maxsize=1024)
def _request_config(server: KVEvictConfig, overrides: tuple[tuple[str, Any], ...]) -> KVEvictConfig:
    over = dict(overrides)
    _check_limits(server, over)
    params = over.pop("params", None)
    recall = over.pop("recall", None)
    # The server's typed values (its sub-objects as they are: validated already, not again), the
    # request's on top, validated once as a whole (the policy's budget floor reads both).
    data: dict[str, Any] = {**dict(server), **over}
    if recall is not None:
        data["recall"] = server.recall.model_copy(update={"enabled": recall})
    if params is not None and data["policy"] in POLICIES:  # an unknown policy is refused below, by name
        name = data["policy"]
        if POLICIES[name].Params is PolicyParams:
            raise RequestConfigError(f"kvevict_params: policy {name!r} has no parameters", "kvevict_params")
        data[name] = {**data[name].model_dump(), **json.loads(params)}
    try:
        return KVEvictConfig.model_validate(data)
    except ValidationError as err:
        raise _request_error(err) from None
