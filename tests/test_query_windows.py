# SPDX-License-Identifier: Apache-2.0
"""One layer's query windows renewed for all the requests of a step with one copy
(backends/queries.py): each request's window equals its own last ``w`` queries, a request the step
leaves out keeps its window, and no window holds a buffer the others have left."""

from __future__ import annotations

import gc

import torch

from tests.test_step_launches import Launches
from vllm_kvevict.backends.queries import QueryWindows, Renewal
from vllm_kvevict.request import LayerState


def _queries(start: int, m: int, H: int = 2, d: int = 3) -> torch.Tensor:
    """``[H, m, d]`` whose entries are their positions ``[start, start + m)``: a window's content
    says which positions it holds."""
    return torch.arange(start, start + m, dtype=torch.float32)[None, :, None].expand(H, m, d).clone()


def _held(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t[0, :, 0]]


def test_each_window_is_its_requests_last_queries_whatever_the_others_do():
    """Random steps over five requests (windows 1-8, steps of 1-12 queries, some requests left out
    of a step, one ended): each renewed window equals the request's last ``w`` positions, every
    window (renewed or not) is a view of the one live buffer, and the step's copies are one."""
    g = torch.Generator().manual_seed(0)
    windows = QueryWindows("queries")
    states = [LayerState() for _ in range(5)]
    widths, L = [1, 8, 3, 8, 5], [0] * 5
    for step in range(40):
        if step == 20:
            states[4] = None  # the request ended: its state is gone
        rows = [i for i in range(5) if states[i] is not None and torch.rand(1, generator=g) < 0.7]
        ms = {i: int(torch.randint(1, 13, (1,), generator=g)) for i in rows}
        renewals = [Renewal(states[i], _queries(L[i], ms[i]), widths[i]) for i in rows]
        with Launches() as counted:
            got = windows.renew(renewals)
        assert sum(counted.ops.values()) == (1 if rows else 0), counted.ops
        for i, w in zip(rows, got):
            L[i] += ms[i]
            assert _held(w) == list(range(max(0, L[i] - widths[i]), L[i])), (step, i)
        live = {s.queries.untyped_storage().data_ptr() for s in states if s is not None and s.queries is not None}
        assert len(live) <= 1, step
        for i, s in enumerate(states):
            if s is not None and s.queries is not None:
                assert _held(s.queries) == list(range(max(0, L[i] - widths[i]), L[i])), (step, i)


def test_rejected_drafts_go_and_replaced_windows_are_not_copied_along():
    """``drop``: the kept queries at positions computed again go (the newest first); a state whose
    window was replaced from elsewhere, or that is gone, is no longer copied along."""
    windows = QueryWindows("queries")
    a, b = LayerState(), LayerState()
    windows.renew([Renewal(a, _queries(0, 6), 8), Renewal(b, _queries(0, 4), 8)])
    (w,) = windows.renew([Renewal(a, _queries(4, 3), 8, drop=2)])  # positions 4, 5 were drafts
    assert _held(w) == [0, 1, 2, 3, 4, 5, 6] and _held(b.queries) == [0, 1, 2, 3]
    b.queries = _queries(100, 2)  # e.g. recall's queries become the policy's window
    own = b.queries
    windows.renew([Renewal(a, _queries(7, 1), 8)])
    assert b.queries is own
    del b
    gc.collect()
    (w,) = windows.renew([Renewal(a, _queries(8, 1), 8)])
    assert _held(w) == list(range(1, 9))


def test_windows_renewed_together_are_read_without_a_copy():
    """The column sums read the renewed windows of a step's rows, in order, as one view of the
    renewal's buffer (``joined``: no copy); parts that do not lie back to back are concatenated."""
    from vllm_kvevict.kernels.torch_ops import joined

    windows = QueryWindows("queries")
    states = [LayerState() for _ in range(3)]
    got = windows.renew([Renewal(s, _queries(10 * i, 4 + i), 8) for i, s in enumerate(states)])
    parts = [w.transpose(0, 1) for w in got]
    with Launches() as counted:
        Q = joined(parts)
    assert not counted.ops and torch.equal(Q, torch.cat(parts))
    assert Q.untyped_storage().data_ptr() == parts[0].untyped_storage().data_ptr()
    for order in ([parts[1], parts[0], parts[2]], [parts[0], parts[2]], [parts[0], _queries(0, 3).transpose(0, 1)]):
        with Launches() as counted:
            Q = joined(order)
        assert sum(counted.ops.values()) == 1 and torch.equal(Q, torch.cat(order))


def test_windows_that_cannot_be_renewed_fall_back_their_requests_only(monkeypatch):
    """A renewal that raises (out of memory) falls back the requests whose policy keeps a window,
    to the safe policy, and turns recall off for those that keep recall's queries (they keep what
    their policy keeps); the step goes on: every request compacts, nothing escapes."""
    from tests.step_driver import Driver, Request
    from vllm_kvevict.backends import queries

    def fail(self, rows):
        if rows:
            raise torch.OutOfMemoryError("no memory for the query windows")
        return []

    requests = [Request("snap", 300, "snapkv"), Request("kd", 280, "keydiff"), Request("rc", 290, "keydiff", True)]
    driver = Driver(requests, {"policy": "keydiff", "budget": 64})
    try:
        steps = driver.schedule(chunk=96, decodes=2)
        driver.step(next(steps))
        assert not driver.fell_back()
        monkeypatch.setattr(queries.QueryWindows, "renew", fail)
        compacted = set()
        for tokens in steps:
            plan = driver.step(tokens)
            compacted |= {plan.req_ids[r] for r in plan.compact_rows}
        assert driver.fell_back() == ["snap: snapkv", "rc: recall"] and compacted == {"snap", "kd", "rc"}
    finally:
        driver.close()
