"""The recall tier: evicted tokens kept outside vLLM's pool, recalled when the prompt completes.

Chunk-wise eviction decides what to keep before the end of the prompt is seen; in a long-context
request the question usually comes last. With recall on, every compaction hands the tokens it drops
(their K and V, positions, per-slot policy state and the score they were dropped with) to this tier,
per request, layer and KV head, instead of discarding them. In the step that completes the prompt,
the window is selected again from the kept tokens and the tier together, by the attention the
prompt's last ``window`` queries pay them (max-pooled over neighbouring positions, as SnapKV pools),
keeping the same count per KV head, and written back into the window (``[E, L)``, in position
order) with the backend's own writer. The contract is unchanged: ``E`` does not move, only what the
window holds does, so the engine core never knows.

The tier lives in host memory beside the KV cache (the CPU engine's memory; on a GPU server the same
tensors, on the device, until a host-memory tier with asynchronous copies is written), bounded by
``recall.cap`` tokens per request, layer and KV head: when full, the lowest-scored tokens go first.
It is dropped when the request finishes, is aborted or restarts after preemption.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_kvevict.kernels import ops, reference


@dataclass
class TierEntry:
    """One request's evicted tokens in one layer: ``[n, H, ...]`` (each KV head its own tokens)."""

    K: torch.Tensor
    V: torch.Tensor
    pos: torch.Tensor  # [n, H] int64
    score: torch.Tensor  # [n, H] float32: the policy's score when they were dropped (-inf: none)
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # per-slot policy state, [n, H]

    @property
    def tokens(self) -> int:
        return int(self.pos.shape[0])


class RecallTier:
    """The tier of one layer: request id -> :class:`TierEntry`."""

    def __init__(self) -> None:
        self.entries: dict[str, TierEntry] = {}

    def add(self, rid: str, new: TierEntry, cap: int) -> None:
        """Append ``new`` to the request's tier, keeping the ``cap`` best-scored tokens per KV head."""
        old = self.entries.get(rid)
        if old is not None:
            new = TierEntry(
                torch.cat([old.K, new.K]), torch.cat([old.V, new.V]), torch.cat([old.pos, new.pos]),
                torch.cat([old.score, new.score]),
                {k: torch.cat([old.state[k], new.state[k]]) for k in old.state if k in new.state},
            )
        if new.tokens > cap:
            new = _best(new, cap)
        if new.tokens:
            self.entries[rid] = new
        else:
            self.entries.pop(rid, None)

    def take(self, rid: str) -> TierEntry | None:
        return self.entries.pop(rid, None)

    def drop(self, rid: str) -> None:
        self.entries.pop(rid, None)

    def forget(self, live: frozenset[str]) -> None:
        for rid in [r for r in self.entries if r not in live]:
            del self.entries[rid]

    @property
    def tokens(self) -> int:
        return sum(e.tokens for e in self.entries.values())


def _best(e: TierEntry, cap: int) -> TierEntry:
    """The ``cap`` highest-scored tokens of each KV head (ties: the newer), in position order."""
    cu = torch.tensor([0, e.tokens], device=e.pos.device)
    idx, _ = ops.select_topk(e.score, e.pos, cu, torch.tensor([cap], device=e.pos.device))
    h = torch.arange(e.pos.shape[1], device=e.pos.device)[None, :]
    return TierEntry(e.K[idx, h], e.V[idx, h], e.pos[idx, h], e.score[idx, h], {k: v[idx, h] for k, v in e.state.items()})


def recall_scores(Q: torch.Tensor, q_pos: torch.Tensor, K: torch.Tensor, pos: torch.Tensor, G: int, scale: float,
                  softcap: float | None, kernel: int) -> torch.Tensor:
    """``[n, H]`` float32: what the queries ``Q [H_q, w, d]`` (at ``q_pos [w]``) pay each candidate
    ``K [n, H, d]`` (at ``pos [n, H]``), softmax over the candidates, causal by position, summed
    over the queries and averaged over each KV head's query group, then max-pooled over the
    ``kernel`` nearest candidates in position order (SnapKV's pooling). One ragged
    :func:`~vllm_kvevict.kernels.ops.column_sums` (never ``[H, w, n]`` at once)."""
    dev = K.device
    one = lambda n: torch.tensor([0, n], device=dev)  # noqa: E731 - a single row
    A = ops.column_sums(Q.transpose(0, 1), K, q_pos.to(dev), pos, one(Q.shape[1]), one(K.shape[0]), G, scale,
                        softcap)  # [n, H_q]
    s = A.view(A.shape[0], -1, G).mean(-1)  # [n, H]
    if kernel > 1 and s.shape[0] > 1:
        order = torch.argsort(pos, dim=0, stable=True)  # [n, H]: candidates by position, per head
        by_pos = torch.gather(s, 0, order).T[:, None, :]  # [H, 1, n]
        pooled = torch.nn.functional.max_pool1d(by_pos, kernel, stride=1, padding=kernel // 2)[:, 0, :].T
        s = torch.empty_like(s).scatter_(0, order, pooled)
    return s


def select_recalled(scores: torch.Tensor, pos: torch.Tensor, keep: int, protect_from: int) -> torch.Tensor:
    """``[keep, H]`` indices of the candidates to keep per KV head, in position order: the
    observation window itself (positions ``>= protect_from``) always, then the best scores (ties:
    the newer)."""
    s = scores.masked_fill(pos >= protect_from, float("inf"))
    cu = torch.tensor([0, s.shape[0]], device=s.device)
    idx, _ = ops.select_topk(s, pos, cu, torch.tensor([keep], device=s.device))  # ascending index
    return torch.gather(idx, 0, torch.argsort(torch.gather(pos, 0, idx), dim=0, stable=True))


def complement(n: int, kept: torch.Tensor) -> torch.Tensor:
    """``[n - keep, H]`` indices of ``range(n)`` not in ``kept [keep, H]`` (per head, ascending)."""
    H = kept.shape[1]
    dropped = torch.ones(n, H, dtype=torch.bool, device=kept.device)
    dropped[kept, torch.arange(H, device=kept.device)[None, :]] = False
    order = torch.argsort((~dropped).to(torch.int8), dim=0, stable=True)
    return order[: n - kept.shape[0]]


def logical_slots(block_table: torch.Tensor, row: int, start: int, count: int, block_size: int) -> torch.Tensor:
    """Physical slots of a row's logical tokens ``[start, start + count)``."""
    dev = block_table.device
    rows, starts = torch.tensor([row], device=dev), torch.tensor([start], device=dev)
    blocks, offs, _ = reference.logical_tokens(block_table, rows, starts, starts + count, block_size)
    return blocks * block_size + offs
