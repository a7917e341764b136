# SPDX-License-Identifier: Apache-2.0
"""One layer's latest queries of every request that keeps them (a query-window policy's window,
recall's latest queries), renewed for all the requests of a step with one copy.

A request's window is its last ``w`` queries ``[H_q, <=w, d]``: what it kept before this step,
then this step's own (which live in vLLM's query buffer, reused by the next step, so they must be
copied). The step's new windows are made by one ``torch.cat`` of every request's parts, each
window a view of the result (``[sum w, H_q, d]``, the rows' windows back to back, so the column
sums read them as they are: :func:`~vllm_kvevict.kernels.torch_ops.joined`): the copies do not
grow with the requests of the step. A request that keeps a window from the last renewal but is not
in this step has its window copied along, so one tensor per layer is live whichever requests the
scheduler leaves out (a window is never pinned in a buffer the others have left).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from vllm_kvevict.request import LayerState


@dataclass(frozen=True)
class Renewal:
    """A row's part of a renewal: ``ls`` its layer state, ``Q`` this step's queries ``[H_q, m, d]``,
    ``w`` its window, ``drop`` the kept queries at positions this step computes again (speculative
    decoding's rejected drafts: their positions now hold other tokens), dropped from the newest."""

    ls: LayerState
    Q: torch.Tensor
    w: int
    drop: int = 0


class QueryWindows:
    """The windows held in one attribute of a layer's per-request state (``attr``: ``queries`` or
    ``recall_queries``), renewed together (:meth:`renew`)."""

    def __init__(self, attr: str) -> None:
        self.attr = attr
        self._buf: torch.Tensor | None = None  # the last renewal's windows, back to back on dim 0
        self._holders: dict[int, weakref.ref[LayerState]] = {}  # the states holding a view of it

    def renew(self, rows: list[Renewal]) -> list[torch.Tensor]:
        """Each row's new window (set on its state and returned, in order), made with one copy for
        all rows; the other holders of the last renewal's windows have theirs copied along."""
        if not rows:
            return []
        parts: list[torch.Tensor] = []
        spans: list[int] = []
        for x in rows:
            prev = getattr(x.ls, self.attr)
            if prev is not None and x.drop:
                prev = prev[:, : max(0, prev.shape[1] - x.drop)]
            older = 0 if prev is None else min(prev.shape[1], x.w - x.Q.shape[1])
            new = [prev[:, prev.shape[1] - older :], x.Q] if older > 0 else [x.Q[:, -x.w :]]
            parts += [t.transpose(0, 1) for t in new]
            spans.append(sum(t.shape[1] for t in new))
        states = [x.ls for x in rows]
        for ls in self._others(states):
            parts.append(getattr(ls, self.attr).transpose(0, 1))
            spans.append(parts[-1].shape[0])
            states.append(ls)
        # [sum w, H_q, d]: the rows' windows back to back, as the column sums read their queries
        self._buf = buf = torch.cat(parts)
        self._holders = {}
        at = 0
        for ls, n in zip(states, spans):
            setattr(ls, self.attr, buf[at : at + n].transpose(0, 1))
            self._holders[id(ls)] = weakref.ref(ls)
            at += n
        return [getattr(x.ls, self.attr) for x in rows]

    def _others(self, renewed: list[LayerState]) -> list[LayerState]:
        """The states outside ``renewed`` that still hold a window of the last renewal's buffer (a
        state gone with its request or attempt, or whose window was replaced, holds none)."""
        buf, skip = self._buf, {id(ls) for ls in renewed}
        if buf is None:
            return []
        out = []
        for key, ref in self._holders.items():
            ls = ref()
            if ls is None or key in skip:
                continue
            t = getattr(ls, self.attr)
            if t is not None and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
                out.append(ls)
        return out
