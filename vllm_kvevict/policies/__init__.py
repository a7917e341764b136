"""Eviction policies, one small file each; ``POLICIES`` maps the config name to the class."""

from __future__ import annotations

from vllm_kvevict.policies.base import KVView, Policy, PolicyParams
from vllm_kvevict.policies.keydiff import KeyDiff
from vllm_kvevict.policies.none import NoEviction
from vllm_kvevict.policies.streamingllm import StreamingLLM

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (NoEviction, StreamingLLM, KeyDiff)}

__all__ = ["POLICIES", "KVView", "Policy", "PolicyParams", "get_policy"]


def get_policy(name: str, params: PolicyParams | None = None) -> Policy:
    return POLICIES[name](params)
