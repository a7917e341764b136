# SPDX-License-Identifier: Apache-2.0
"""KVMerger: merge runs of similar adjacent keys into their pivot (KVMerger
paper Alg. 1 and 2, Eqs. 5-8).

    protected  = the most recent  floor(recent_ratio * n)  tokens
               + the top          floor(heavy_ratio * n)   by accumulated attention a (H2O sums)
    links      = adjacent unprotected pairs with cos(k_{i-1}, k_i) > threshold    (chain, 6.5 #8)
    per set S  (a maximal run of links):
        p      = argmax_{j in S} a_j                               pivot
        w_j    = g_pj / sum_S g,   g_pj = exp(-||k_p - k_j||^2 / (2 sigma^2))
        k_M    = sum_S w_j k_j,    v_M = |S| * sum_S w_j v_j       stored in the pivot's slot

Defaults: threshold 0.75, sigma 5 (fixed, 6.5 #7), ratios 0.17 / 0.12 of the sequence (the 50%
budget's, 6.5 #9), value scaling by |S| (``value_scale: none`` to turn it off). Runs once, when
the prompt is complete (``trigger: once``); the accumulated attention is the H2O column sums of
every prompt query, kept per slot.

Adaptation to a uniform count per head (one block table serves all heads): the paper's lengths
vary by head. Here each head keeps exactly ``keep`` entries: if merging every link would leave
fewer, only the ``n - keep`` most similar links are merged (sets stay contiguous); if it leaves
more, the unprotected entries (merged sets and singletons) with the lowest pivot attention are
evicted, H2O-style. If the protected share exceeds ``keep``, both ratios shrink in proportion.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import torch
from pydantic import Field

from vllm_kvevict.policies.base import KVView, Policy, PolicyParams, topk_newer
from vllm_kvevict.policies.h2o import H2O, h2o_observe
from vllm_kvevict.policies.h2o import STATE as H2O_STATE


class KVMergerParams(PolicyParams):
    threshold: float = Field(0.75, ge=-1.0, le=1.0, description="cosine above which adjacent keys merge")
    sigma: float = Field(5.0, ge=1e-3, le=1e6, description="Gaussian kernel width on key distances")
    recent_ratio: float = Field(0.17, ge=0.0, le=1.0, description="share of the sequence kept as recent tokens")
    heavy_ratio: float = Field(0.12, ge=0.0, le=1.0, description="share kept as heavy hitters (not merged)")
    value_scale: Literal["set_size", "none"] = Field("set_size", description="multiply merged values by |S|")


class KVMerger(Policy[KVMergerParams]):
    name = "kvmerger"
    Params = KVMergerParams
    # H2O's accumulated attention, once at prompt end, merging what it drops
    needs = replace(H2O.needs, decode=False, trigger="once", merges=True)

    def observe(self, view: KVView) -> None:
        h2o_observe(view, self.attention(view))

    def protected(self, view: KVView, keep: int) -> torch.Tensor:
        """``[H, n]`` mask: the recent tokens and the heavy hitters."""
        p, n = self.params, view.pos.shape[1]
        n_recent, n_heavy = int(p.recent_ratio * n), int(p.heavy_ratio * n)
        if n_recent + n_heavy > keep:
            shrink = keep / (n_recent + n_heavy)
            n_recent, n_heavy = int(n_recent * shrink), int(n_heavy * shrink)
        recent = view.pos >= view.length - n_recent
        a = view.state[H2O_STATE].masked_fill(recent, float("-inf"))
        heavy = torch.zeros_like(recent)
        if n_heavy:
            heavy.scatter_(1, topk_newer(a, n_heavy, view.pos), True)
        return recent | heavy

    def merge(self, view: KVView, keep: int):
        n = view.pos.shape[1]
        if keep >= n:
            return torch.arange(n, device=view.pos.device).expand(view.num_heads, n).clone(), None
        prot = self.protected(view, keep)
        K, V = view.K.float(), view.V.float()
        a = view.state[H2O_STATE].float()
        kept_all, K_all, V_all = [], [], []
        for h in range(view.num_heads):
            kept, Km, Vm = self._merge_head(K[h], V[h], a[h], view.pos[h], prot[h], keep)
            kept_all.append(kept)
            K_all.append(Km)
            V_all.append(Vm)
        return torch.stack(kept_all), (torch.stack(K_all).to(view.K.dtype), torch.stack(V_all).to(view.V.dtype))

    def _merge_head(self, K, V, a, pos, prot, keep):
        """One head's merge, in shapes fixed by ``n`` (nothing read back from the device): up to
        ``n`` sets, those past the last empty."""
        p, n = self.params, K.shape[0]
        cos = torch.nn.functional.cosine_similarity(K[1:], K[:-1], dim=-1, eps=1e-8)  # link i: (i, i+1)
        can = (cos > p.threshold) & ~prot[1:] & ~prot[:-1]
        # At most n - keep links merge, the most similar: all that can when fewer can.
        order = torch.argsort(cos.masked_fill(~can, float("-inf")), descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(n - 1, device=K.device))
        link = can & (rank < n - keep)
        # Sets: maximal runs joined by links; set id of token i = number of non-links before it.
        sid = torch.cat([torch.zeros(1, dtype=torch.long, device=K.device), torch.cumsum(~link, 0)])
        # Pivot of each set: largest accumulated attention, ties to the newer (later) token.
        top = torch.full((n,), float("-inf"), device=K.device).scatter_reduce(0, sid, a, "amax")
        idx = torch.arange(n, device=K.device)
        best = torch.full((n,), -1, dtype=torch.long, device=K.device)
        best = best.scatter_reduce(0, sid, torch.where(a == top[sid], idx, -1), "amax")
        pivot = best[sid]  # [n] each token's pivot
        g = torch.exp(-((K[pivot] - K) ** 2).sum(-1) / (2 * p.sigma**2))
        end = torch.zeros(n, dtype=torch.long, device=K.device).scatter_reduce(0, sid, idx + 1, "amax")
        size = end - torch.zeros_like(end).scatter_reduce(0, sid, idx, "amin", include_self=False)
        size = size.masked_fill(best < 0, 0)
        w = g / _run_sums(g, end, size)[sid]
        Km = _run_sums(w[:, None] * K, end, size)
        Vm = _run_sums(w[:, None] * V, end, size)
        if p.value_scale == "set_size":
            Vm *= size[:, None].float()
        # Too many entries: evict the unprotected sets with the lowest pivot attention (the empty
        # sets lowest of all: at least keep sets are not empty).
        set_score = a[best].masked_fill(prot[best], float("inf")).masked_fill(best < 0, float("-inf"))
        chosen = topk_newer(set_score[None], keep, pos[best][None])[0]
        kept = best[chosen]
        order = torch.argsort(kept)
        return kept[order], Km[chosen][order], Vm[chosen][order]


def _run_sums(x: torch.Tensor, end: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """``[n, ...]``: the sum of ``x [n, ...]`` over each set, a run of consecutive tokens ending
    before ``end`` of ``size`` tokens (0 for an empty set). Differences of a float64 running sum:
    the same bits on every run, whichever device (no atomics), and no set count read back."""
    cs = torch.nn.functional.pad(x.double().cumsum(0), (0, 0) * (x.dim() - 1) + (1, 0))
    return (cs[end] - cs[end - size]).to(x.dtype)
