# SPDX-License-Identifier: Apache-2.0
"""Eviction policies, one small file each; ``POLICIES`` maps the config name to the class."""

from __future__ import annotations

from vllm_kvevict.policies.base import KVView, Needs, Policy, PolicyParams
from vllm_kvevict.policies.caote import CAOTE, FastCAOTE
from vllm_kvevict.policies.criticalkv import CriticalKV
from vllm_kvevict.policies.h2o import H2O
from vllm_kvevict.policies.keydiff import KeyDiff
from vllm_kvevict.policies.knorm import KNorm
from vllm_kvevict.policies.kvmerger import KVMerger
from vllm_kvevict.policies.lshe import LSHE
from vllm_kvevict.policies.none import NoEviction
from vllm_kvevict.policies.random import Random
from vllm_kvevict.policies.snapkv import SnapKV
from vllm_kvevict.policies.streamingllm import StreamingLLM
from vllm_kvevict.policies.tova import TOVA

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        NoEviction,
        StreamingLLM,
        KeyDiff,
        SnapKV,
        TOVA,
        H2O,
        KNorm,
        Random,
        CriticalKV,
        KVMerger,
        LSHE,
        CAOTE,
        FastCAOTE,
    )
}

__all__ = ["POLICIES", "KVView", "Needs", "Policy", "PolicyParams", "get_policy"]


def get_policy(name: str, params: PolicyParams | None = None) -> Policy:
    return POLICIES[name](params)
