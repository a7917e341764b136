# SPDX-License-Identifier: Apache-2.0
"""Prefix caching stays exact under any schedule (docs/architecture.md, "Prefix caching").

vLLM's real ``Scheduler`` (and ``AsyncScheduler``, whose next step is scheduled before the previous
one's output is seen) with its real ``KVCacheManager``, the plugin's manager and hooks installed,
driven through random mixes of requests by a stand-in worker. The stand-in plans every step with
the workers' own code (``backends/plan.plan_step``: the same windows, hits and attempt starts as
a real worker) and, instead of computing KV, writes a label into every slot it computes or
compacts: a *pure* label (a digest of the token prefix up to that slot) for KV computed while
its attempt had evicted nothing, a label of its own otherwise. Then, at every step:

* every slot a request reads (its window ``[E_prev, L_prev)``, a prefix-cache hit included) holds
  exactly what that request wrote there, or, for a hit, the pure KV of its own tokens;
* every block in vLLM's prefix cache holds the pure KV of the tokens its hash names, once the step
  that computes it has run, and no step after the one it was hashed in writes it;
* once a step is scheduled, every block in use is held by the requests whose block lists name it
  (a copy made aside is already back in the pool's LRU, cached) but, under asynchronous
  scheduling, the copies whose content the core has yet to see computed.

Random mixes (hypothesis): prompts that share documents or continue earlier conversations
(prompt and generated tokens), one-token requests, EOS, aborts at any point, a pool small enough
to preempt, chunked prefill with small token budgets (requests sit out rounds), per-request
policies, budgets and triggers (per-slot state, ``once``, eviction off), synchronous and
asynchronous scheduling, FCFS and priority scheduling (which preempts a request already scheduled
in the step being built), worker fallbacks (a request's policy replaced by the safe policy in any
of its steps, on the worker, through ``backends/fault.py``: what it compacts from then on is not
what its configuration computes, and the step's output tells the engine core so), and
prefix-cache hits everywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_block_hash, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from vllm_kvevict import kv_manager as mgr  # noqa: E402
from vllm_kvevict.backends import fault  # noqa: E402
from vllm_kvevict.backends import plan as worker_plan  # noqa: E402
from vllm_kvevict.backends.tier_store import TIERS  # noqa: E402
from vllm_kvevict.config import parse_config  # noqa: E402
from vllm_kvevict.request import ENGINE, WORKER, resolve  # noqa: E402
from vllm_kvevict.spec import KVEvictSpec  # noqa: E402
from vllm_kvevict.vllm_compat import MESSAGES_ATTR  # noqa: E402
from vllm_kvevict.vllm_compat.kv_cache import tail_block_key, window_block_keys  # noqa: E402
from vllm_kvevict.vllm_compat.runner import RunnerStep, attach_fallbacks  # noqa: E402
from vllm_kvevict.window import evicted_tokens, last_boundary, peak_blocks, step_window  # noqa: E402

BS = 16
EOS = 2
VOCAB = 50
MAX_LEN = 1024
SERVER = {"policy": "keydiff", "budget": 48}
#: per-request overrides the mixes draw from: the server's window, smaller and larger budgets,
#: eviction off, a policy with per-slot state (no hits), a ``once`` policy, a policy with a query
#: window, a ``once`` trigger
OVERRIDES = [
    {},
    {"kvevict_budget": 32},
    {"kvevict_budget": 96},
    {"kvevict_enabled": False},
    {"kvevict_policy": "h2o"},
    {"kvevict_policy": "criticalkv"},
    {"kvevict_policy": "snapkv"},
    {"kvevict_trigger": "once"},
    {"kvevict_recall": True},
]


@dataclass(frozen=True)
class TierLabel:
    """What a recall tier holds, as the stand-in worker keeps it: the tokens a configuration
    (``salt``) dropped by the prefix ``at`` (the tier's one entry in each snapshot)."""

    at: bytes
    salt: str

    def tensors(self) -> list:
        return []


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    from vllm_kvevict.testing.models import tiny_path

    mgr.register_spec()
    mgr.install_scheduler_hooks()
    model = ModelConfig(model=str(tiny_path()), skip_tokenizer_init=True, max_model_len=MAX_LEN, dtype="float32")

    def make(
        max_batched: int, max_seqs: int, reserve_full_isl: bool, priority: bool = False, drafts: int = 0
    ) -> VllmConfig:
        sched = SchedulerConfig(
            policy="priority" if priority else "fcfs",
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=MAX_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            scheduler_reserve_full_isl=reserve_full_isl,
        )
        spec = None
        if drafts:
            from vllm.config import SpeculativeConfig

            spec = SpeculativeConfig(method="ngram", num_speculative_tokens=drafts, prompt_lookup_max=3)
        return VllmConfig(
            scheduler_config=sched,
            model_config=model,
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
            speculative_config=spec,
        )

    init_none_hash(get_hash_fn_by_name("sha256"))
    return make


def _digest(prev: bytes, token: int) -> bytes:
    return hashlib.blake2b(
        prev + (token % 2**32).to_bytes(4, "little"), digest_size=8
    ).digest()  # -1: a draft vLLM voided


def _prefix_digests(tokens: list[int]) -> list[bytes]:
    """Per position p, a digest of ``tokens[: p + 1]``: the label of the pure KV of slot p."""
    out, d = [], b""
    for t in tokens:
        d = _digest(d, t)
        out.append(d)
    return out


def _token(rid: str, pos: int, eos_rate: float) -> int:
    """What the stand-in model samples at ``pos`` for request ``rid``: a fixed function of both,
    so a step scheduled before the previous step's output is known (async scheduling) agrees
    with what the scheduler later learns."""
    r = random.Random(f"{rid}/{pos}")
    return EOS if r.random() < eos_rate else r.randrange(3, VOCAB)


@dataclass
class Attempt:
    """The stand-in worker's state of one attempt of a request."""

    uid: int
    blocks: list[int]
    tokens: list[int]  # the tokens the worker knows (prompt, then what it sampled)
    expected: dict[int, object] = field(default_factory=dict)  # logical slot -> the label it must hold
    evicted: bool = False  # a compaction has run in this attempt
    window: tuple | None = None  # (prefix digest, salt) of the window its computed tokens attend to
    tier: TierLabel | None = None  # recall: what its tier holds (None: no tier)
    sliding: list[int] = field(default_factory=list)  # its blocks in the sliding-window group (hybrid mixes)


class StandInWorker:
    """Runs scheduled steps as a worker would, writing labels instead of KV, and checks every read."""

    def __init__(
        self,
        server_config,
        eos_rates: dict[str, float],
        prompts: dict[str, list[int]],
        fallback_rate: float = 0.0,
        sliding: int = 0,
    ):
        self.server_config = server_config
        self.sliding = sliding  # a second KV cache group of sliding-window layers, this window (0: none)
        self.fallback_rate = fallback_rate
        self.fails: set[str] = set()  # requests whose policy fails at their first compaction
        self.fallbacks = 0  # requests whose policy failed
        self.drafts = self.accepted = 0  # speculative decoding: draft tokens scheduled, accepted
        self.eos_rates = eos_rates
        self.prompts = prompts
        self.slots: dict[tuple[int, int], object] = {}  # (block id, offset) -> label
        #: block id -> the compaction that last wrote it, (attempt, step): a cached window's blocks
        #: must all come from one computation (two may keep different tokens on a GPU)
        self.origin: dict[int, tuple[int, int]] = {}
        self.attempts: dict[str, Attempt] = {}
        self.uids = 0
        self.step_seq = 0
        self.hash_stamp: dict[int, tuple[object, int]] = {}  # block id -> (its hash, step it was hashed in)
        self.compactions = 0
        self.copies = 0  # blocks copied by vLLM's kv_cache_block_copies
        self.copied_starts = 0  # attempts that started on a hit holding copies of cached blocks
        self.preemptions = 0
        self.hit_reads = 0
        self.window_reads = 0  # attempts that started on a cached compacted window
        self.recall_starts = 0  # recall requests among them (their tier checked)
        self.recalls = 0  # recall's re-selections of a window at a prompt's end
        self.windows: dict[bytes, tuple[bytes, str, int]] = {}  # window block hash -> (prefix, salt, first slot)
        self.tails: dict[bytes, tuple] = {}  # tail block hash -> its slots' labels
        self.tail_reads = 0  # attempts that started past a cached window, on its tail
        self.last_step: dict[str, int] = {}  # request id -> the last step it ran in
        self.compacted_in: dict[str, list[int]] = {}  # request id -> the steps its current attempt compacted in
        self.compacted_at: dict[str, list[int]] = {}  # request id -> the L of each of those compactions
        self.seen_by_core: set[str] = set()  # attempts whose processed tokens, at an allocation, showed a compaction
        self.paths: set[str] = set()  # the schedule-dependent paths this run went through
        self.violations: list[str] = []

    def _fail(self, msg: str) -> None:
        self.violations.append(f"step {self.step_seq}: {msg}")

    def _write(self, block: int, offset: int, label) -> None:
        stamp = self.hash_stamp.get(block)
        if stamp is not None and stamp[1] < self.step_seq:
            self._fail(f"block {block} written after it was hashed in step {stamp[1]}")
        self.slots[(block, offset)] = label

    def execute(self, out, finished_before: set[str]) -> ModelRunnerOutput:
        self.step_seq += 1
        TIERS.apply(getattr(out, MESSAGES_ATTR, None) or ())  # as the runner's hook does, first
        for rid in out.finished_req_ids:
            self.attempts.pop(rid, None)
        starts: set[str] = set()
        for new in out.scheduled_new_reqs:
            self.uids += 1
            self.attempts[new.req_id] = Attempt(self.uids, list(new.block_ids[0]), list(new.prompt_token_ids))
            if self.sliding:
                self.attempts[new.req_id].sliding = list(new.block_ids[1])
            starts.add(new.req_id)
            self.compacted_in[new.req_id], self.compacted_at[new.req_id] = [], []
            self.seen_by_core.discard(new.req_id)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self.uids += 1
                tokens = list(cached.all_token_ids.get(rid) or self.prompts[rid])
                self.attempts[rid] = Attempt(self.uids, list(ids[0]) if ids else [], tokens)
                if self.sliding and ids:
                    self.attempts[rid].sliding = list(ids[1])
                starts.add(rid)
                self.compacted_in[rid], self.compacted_at[rid] = [], []
                self.seen_by_core.discard(rid)
            elif ids is not None:
                self.attempts[rid].blocks.extend(ids[0])
                if self.sliding:
                    self.attempts[rid].sliding.extend(ids[1])
        # vLLM's block copies, before the step's forward (every source computed in an earlier step)
        copies = [(c.src_block_id, c.dst_block_id) for c in out.kv_cache_block_copies or ()]
        labels = [[self.slots.get((src, o)) for o in range(BS)] for src, _ in copies]
        for (src, dst), got in zip(copies, labels):
            for o in range(BS):
                self._write(dst, o, got[o])
            self.origin[dst] = self.origin.get(src)  # a copy holds its source's computation
        self.copies += len(copies)
        copied = {dst for _, dst in copies}
        computed = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        rids = list(out.num_scheduled_tokens)
        n_sched = [out.num_scheduled_tokens[r] for r in rids]
        L_prev = [computed[r] for r in rids]
        seq = [a + b for a, b in zip(L_prev, n_sched)]
        qsl = [0]
        for n in n_sched:
            qsl.append(qsl[-1] + n)
        # The workers' own planning code decides every window (and each attempt's shared prefix).
        cm = SimpleNamespace(
            num_reqs=len(rids),
            seq_lens=torch.tensor(seq),
            query_start_loc_cpu=torch.tensor(qsl),
            num_actual_tokens=qsl[-1],
            block_table_tensor=torch.zeros(len(rids), 1),
            slot_mapping=torch.zeros(qsl[-1]),
            positions=None,
        )
        step = RunnerStep(
            req_ids=rids,
            prompt_lens=[len(self.prompts[r]) for r in rids],
            num_tokens=[len(self.attempts[r].tokens) for r in rids],
            extra_args=[self.extra_args[r] for r in rids],
            live=frozenset(self.attempts),
            starts=frozenset(starts),
        )
        plan = worker_plan.plan_step(cm, self.server_config, BS, step)
        # As in one layer of a real step: every row's new tokens are written first, then every row
        # reads its window, then the compacting rows rewrite theirs.
        for r, rid in enumerate(rids):
            att = self.attempts[rid]
            e_prev, L0, L = plan.e_prev[r], L_prev[r], seq[r]
            window = plan.states[r].settings.window
            if L - 1 > L0 and step_window(L0, L - 1, len(self.prompts[rid]), window).compacts:
                self._fail(f"{rid}: the step [{L0}, {L}) crosses a compaction point")
            if rid in starts and L0:
                self.copied_starts += any(att.blocks[q // BS] in copied for q in range(0, L0, BS))
                if e_prev:  # a cached compacted window at b: what the same request compacted at b,
                    self.window_reads += 1  # then its tail: what it computed after b up to L0
                    settings = plan.states[r].settings
                    w, prompt = settings.window, len(self.prompts[rid])
                    b = last_boundary(L0 if w.decode else min(L0, prompt), w)
                    ds = _prefix_digests(att.tokens[:L0])
                    att.window = (ds[b - 1], settings.window_salt)
                    self._check_tier(plan, r, rid, att.window)
                    for q in range(e_prev, b):
                        att.expected[q] = ("compacted", *att.window, q)
                    origins = {self.origin.get(att.blocks[q // BS]) for q in range(e_prev, b, BS)}
                    if len(origins) > 1:
                        self._fail(f"{rid} starts on a window of several computations: {sorted(map(str, origins))}")
                    for q in range(b, L0):
                        att.expected[q] = ("after", *att.window, ds[q])
                    self.tail_reads += L0 > b
                    att.evicted = True
                else:  # pure blocks: the pure KV of its own tokens
                    pure = _prefix_digests(att.tokens[:L0])
                    for q in range(L0):
                        att.expected[q] = ("pure", pure[q])
                    self.hit_reads += 1
            drafts = list(out.scheduled_spec_decode_tokens.get(rid, ()))
            assert len(att.tokens) == L - len(drafts) or not drafts
            computed = att.tokens[:L] + drafts  # speculative decoding: drafts, as yet unverified
            digests = _prefix_digests(computed)
            for p in range(L0, L):
                # after a compaction: a function of the window it attends to and its tokens
                label = ("after", *att.window, digests[p]) if att.evicted else ("pure", digests[p])
                self._write(att.blocks[p // BS], p % BS, label)
                att.expected[p] = label
                if self.sliding:  # a sliding-window layer keeps every token's own KV
                    self._write(att.sliding[p // BS], p % BS, ("pure", digests[p]))
        for r, rid in enumerate(rids):  # with recall, the step completing the prompt re-selects the window read
            self._recall(plan, r, rid, plan.e_prev[r], L_prev[r], before=True)
        for r, rid in enumerate(rids):  # attention reads the window
            att = self.attempts[rid]
            for q in range(plan.e_prev[r], L_prev[r]):
                got = self.slots.get((att.blocks[q // BS], q % BS))
                if got != att.expected.get(q):
                    self._fail(f"{rid} reads slot {q} (block {att.blocks[q // BS]}): {got} != {att.expected.get(q)}")
                    break
            if self.sliding:  # and the sliding-window layer its last ``sliding - 1`` tokens
                pure = _prefix_digests(att.tokens[: L_prev[r]])
                for q in range(max(0, L_prev[r] - self.sliding + 1), L_prev[r]):
                    got = self.slots.get((att.sliding[q // BS], q % BS))
                    if got != ("pure", pure[q]):
                        self._fail(f"{rid} reads sliding slot {q} (block {att.sliding[q // BS]}): {got}")
                        break
        sampled: list[list[int]] = []
        for r, rid in enumerate(rids):
            att = self.attempts[rid]
            e_prev, e_new, L = plan.e_prev[r], plan.e_new[r], seq[r]
            drafts = list(out.scheduled_spec_decode_tokens.get(rid, ()))
            self.drafts += len(drafts)
            if drafts and e_new > e_prev:
                self._fail(f"{rid}: the step [{L_prev[r]}, {L}) compacts over {len(drafts)} unverified drafts")
            self.last_step[rid] = self.step_seq
            state = plan.states[r]
            fails = rid in self.fails and e_new > e_prev  # at its first compaction, if it is told to
            if (
                state.settings.evicts
                and state.fell_back_from is None
                and (fails or _falls_back(rid, self.step_seq, self.fallback_rate))
            ):
                # a fault on the worker: the real fallback path (every later step of the request
                # runs the safe policy, and this step's output says so)
                fault.fall_back(state, rid, state.settings.policy, RuntimeError("injected"))
                self.fallbacks += 1
            if e_new > e_prev:  # compaction rewrites [E_new, L) in place
                self.compactions += 1
                self.compacted_in[rid].append(self.step_seq)
                self.compacted_at[rid].append(L)
                att.evicted = True
                # what compaction keeps depends on the tokens and the configuration alone, unless
                # the request fell back: then on whatever the safe policy keeps (unique to it)
                at, salt = _prefix_digests(att.tokens[:L] + drafts)[-1], state.settings.window_salt
                if state.fell_back_from is not None:
                    salt = f"fallback of {rid} (attempt {att.uid})"
                att.window = (at, salt)
                for q in range(e_new, L):
                    label = ("compacted", at, salt, q)
                    self._write(att.blocks[q // BS], q % BS, label)
                    self.origin[att.blocks[q // BS]] = (att.uid, self.step_seq)
                    att.expected[q] = label
                att.tier = TierLabel(at, salt)
                if state.settings.recall.enabled and L < len(self.prompts[rid]):  # Recall.stash's snapshot
                    TIERS.take(rid, L, "L0", (att.tier,))
            self._recall(plan, r, rid, e_new, L, before=False)
            if drafts:  # greedy verification: the drafts that are the model's tokens, then its next one
                known = L - len(drafts)
                ok = 0
                while ok < len(drafts) and drafts[ok] == _token(rid, known + ok, self.eos_rates[rid]):
                    ok += 1
                new = drafts[:ok] + [_token(rid, known + ok, self.eos_rates[rid])]
                self.accepted += ok
                for q in range(known + ok, L):  # rejected: computed again from the next step on
                    att.expected.pop(q, None)
                att.tokens += new
                sampled.append(new)
            elif L >= len(att.tokens):  # not a partial prefill: one token sampled
                tok = _token(rid, L, self.eos_rates[rid])
                att.tokens.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        output = ModelRunnerOutput(
            req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)}, sampled_token_ids=sampled
        )
        attach_fallbacks(output, fault.step_fallbacks())  # as the runner's output hook does
        return output

    def _check_tier(self, plan, r: int, rid: str, window: tuple) -> None:
        """A recall request starting on a cached window starts with that window's tier."""
        state = plan.states[r]
        if not state.settings.recall.enabled:
            return
        self.recall_starts += 1
        ls = state.layers.get("L0")
        got = ls.tier.chunks if ls is not None and ls.tier is not None else None
        if got != [TierLabel(*window)]:
            self._fail(f"{rid} starts on the window {window} with the tier {got}")
        self.attempts[rid].tier = TierLabel(*window)

    def _recall(self, plan, r: int, rid: str, lo: int, hi: int, before: bool) -> None:
        """Recall's re-selection in the step completing row ``r``'s prompt (``before`` its
        attention: the window ``[E_prev, L_prev)``; after it, ``[E_new, L)``), for a request with
        recall whose attempt holds a tier: the window's slots then hold what this prompt and
        configuration recalled."""
        att, state = self.attempts[rid], plan.states[r]
        if not (state.settings.recall.enabled and plan.completes_prompt(r)) or att.tier is None or hi <= lo:
            return
        if before and state.settings.recall.prefill == "all":
            return
        self.recalls += 1
        prompt = _prefix_digests(att.tokens[: len(self.prompts[rid])])[-1]
        att.window = (prompt, f"recalled by {att.tier.salt}")
        for q in range(lo, hi):
            label = ("recalled", *att.window, q)
            self._write(att.blocks[q // BS], q % BS, label)
            att.expected[q] = label
        if not before:
            att.tier = None  # the tier goes with the prompt's end

    def propose(self, rids: list[str], k: int) -> DraftTokenIds:
        """``k`` draft tokens for each decoding request, as a drafter would propose them: each the
        model's own next token (then accepted) with odds 2 in 3, else another (rejected)."""
        out = []
        for rid in rids:
            tokens = self.attempts[rid].tokens
            rng = random.Random(f"draft/{rid}/{len(tokens)}")
            out.append(
                [
                    _token(rid, len(tokens) + j, self.eos_rates[rid])
                    if rng.random() < 2 / 3
                    else rng.randrange(3, VOCAB)
                    for j in range(k)
                ]
            )
        return DraftTokenIds(rids, out)

    def allocated(self, out) -> None:
        """Blocks handed out afresh in the step just scheduled (not a hit's blocks): vLLM dropped
        their old hash when it reallocated them, so any hash they carry now is from this step
        (the same hash again when the same tokens are recomputed into them)."""
        fresh: list[int] = []
        for new in out.scheduled_new_reqs:
            for group in new.block_ids:
                fresh += group[new.num_computed_tokens // BS :]
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if ids is not None:
                skip = cached.num_computed_tokens[i] // BS if rid in cached.resumed_req_ids else 0
                for group in ids:
                    fresh += group[skip:]
        fresh += [c.dst_block_id for c in out.kv_cache_block_copies or ()]
        for block in fresh:
            self.hash_stamp.pop(block, None)

    def core_allocates(self, rid: str, processed: int) -> None:
        """The engine core allocates for ``rid`` knowing ``processed`` of its tokens processed (what
        ``remove_skipped_blocks`` is told): note when that is the first time it could see a
        compaction of the attempt and two compaction points lie behind it at once."""
        if rid in self.seen_by_core:
            return
        behind = sum(1 for L in self.compacted_at.get(rid, ()) if L <= processed)
        if behind:
            self.seen_by_core.add(rid)
        if behind >= 2:
            self.paths.add("two compaction points processed at once")

    def compacted_unseen(self, rid: str) -> bool:
        """Whether ``rid``'s current attempt has compacted while the engine core, at every
        allocation since, knew of fewer processed tokens than its first compaction point: what
        the core would have had to learn from the workers' aftermath it has not seen."""
        return bool(self.compacted_in.get(rid)) and rid not in self.seen_by_core

    def check_holds(self, kv_cache_manager, async_scheduling: bool) -> None:
        """Every block's references are its holders': the requests whose block lists name it and
        the plugin's managers for the copies they hold aside, which only asynchronous scheduling
        leaves held past the step's scheduling (the core has not seen their content computed)."""
        held: dict[int, int] = {}
        for m in kv_cache_manager.coordinator.single_type_managers:
            aside = [
                blk
                for att in getattr(m, "_attempts", {}).values()
                for blk in [*(s[-1] for s in att.saves), *(b for c in att.window_copies.values() for b in c)]
            ]
            if aside and not async_scheduling:
                self._fail(f"{len(aside)} copies held aside once the next step is scheduled")
            for blk in [*aside, *(b for blocks in m.req_to_blocks.values() for b in blocks)]:
                held[blk.block_id] = held.get(blk.block_id, 0) + (not blk.is_null)
        for blk in kv_cache_manager.block_pool.blocks:
            if not blk.is_null and blk.ref_cnt != held.get(blk.block_id, 0):
                n = held.get(blk.block_id, 0)
                self._fail(f"the next step scheduled, block {blk.block_id} has {blk.ref_cnt} references, {n} holders")
                return

    def check_cache(self, pool, digests_of_hash: dict, stamp_step: int) -> None:
        """Every hashed block holds the pure KV its hash names, once its step has run. A hash seen
        for the first time is stamped with ``stamp_step``, the step it was hashed for (vLLM hashes
        a block as it schedules the step that computes it)."""
        window_origins: dict[tuple, tuple[int, int] | None] = {}  # a cached window -> its computation
        for block in pool.blocks:
            h = block.block_hash
            if h is None:
                self.hash_stamp.pop(block.block_id, None)
                continue
            stamp = self.hash_stamp.get(block.block_id)
            if stamp is None or stamp[0] != h:
                stamp = self.hash_stamp[block.block_id] = (h, stamp_step)
            if stamp[1] > self.step_seq:
                continue  # hashed as the step that computes it was scheduled: not run yet
            window = self.windows.get(bytes(get_block_hash(h)))
            if window is not None:  # a cached compacted window's block
                at, salt, first = window
                seen = window_origins.setdefault((at, salt), self.origin.get(block.block_id))
                if seen != self.origin.get(block.block_id):
                    self._fail(f"window block {block.block_id} is cached beside blocks of another computation")
                for o in range(BS):
                    if self.slots.get((block.block_id, o)) != ("compacted", at, salt, first + o):
                        self._fail(
                            f"window block {block.block_id} is cached but slot {o} holds {self.slots.get((block.block_id, o))}"
                        )
                        break
                continue
            tail = self.tails.get(bytes(get_block_hash(h)))
            if tail is not None:  # a cached tail block: what a request computed after the window
                for o in range(BS):
                    if self.slots.get((block.block_id, o)) != tail[o]:
                        self._fail(
                            f"tail block {block.block_id} is cached but slot {o} holds {self.slots.get((block.block_id, o))}"
                        )
                        break
                continue
            want = digests_of_hash.get(bytes(get_block_hash(h)))
            if want is None:
                self._fail(f"block {block.block_id} has a hash no request's tokens produce")
                continue
            for o in range(BS):
                if self.slots.get((block.block_id, o)) != ("pure", want[o]):
                    self._fail(
                        f"block {block.block_id} is cached but slot {o} holds {self.slots.get((block.block_id, o))}"
                    )
                    break


def _falls_back(rid: str, step: int, rate: float) -> bool:
    """Whether the worker's policy of ``rid`` fails in ``step`` (a fixed function of both)."""
    return rate > 0 and random.Random(f"fallback/{rid}/{step}").random() < rate


def _block_key(h) -> bytes:
    return bytes(h)


@dataclass(frozen=True)
class Req:
    """One request of a mix."""

    source: str  # "doc0"/"doc1": starts with a shared document; "turn": continues a finished request; "new"
    base: int  # tokens of the document it starts with (source doc*), at most 400
    own: int  # tokens of its own after that
    max_tokens: int
    eos: float  # chance that a sampled token is EOS
    override: int  # index into OVERRIDES
    abort: int | None = None  # aborted after this many rounds once it arrived (None: never)
    arrive: int = 0  # the round it arrives in (at the latest: earlier when the scheduler is idle)
    priority: int = 0  # with priority scheduling: lower is served first
    fails: bool = False  # its policy fails on the worker at its first compaction


@dataclass(frozen=True)
class Mix:
    async_scheduling: bool
    max_batched: int
    max_seqs: int
    pool_blocks: int
    requests: tuple[Req, ...]
    seed: int = 0
    reserve_full_isl: bool = True  # vLLM's admission gate: the whole prompt must fit (off: more preemption)
    stride: int = 0  # the server's compaction stride (0: each request's W): above W, windows have tails
    copy_rewritten: str = "shared"  # the server's: copies aside only for waiting requests, or always
    priority: bool = False  # vLLM's priority scheduling (else FCFS)
    drafts: int = 0  # speculative decoding: n-gram draft tokens per step (0: none; synchronous only)
    fallbacks: float = 0.0  # chance that an evicting request's policy fails on the worker in a step
    sliding: int = 0  # a hybrid model: a second KV cache group of sliding-window layers, this window


@st.composite
def mixes(draw):
    reqs = []
    for _i in range(draw(st.integers(3, 9))):
        reqs.append(
            Req(
                source=draw(st.sampled_from(["doc0", "doc1", "new", "turn"])),
                base=draw(st.integers(BS, 400)),
                own=draw(st.integers(1, 200)),
                max_tokens=draw(st.sampled_from([1, 1, 2, 5, 17, 40, 100])),
                eos=draw(st.sampled_from([0.0, 0.0, 0.05, 0.5, 1.0])),
                override=draw(st.integers(0, len(OVERRIDES) - 1)),
                abort=draw(st.one_of(st.none(), st.integers(0, 12))),
                arrive=draw(st.integers(0, 30)),
                priority=draw(st.integers(0, 3)),
            )
        )
    return Mix(
        async_scheduling=draw(st.booleans()),
        max_batched=draw(st.sampled_from([32, 48, 64, 128, 256])),
        max_seqs=draw(st.integers(2, 6)),
        pool_blocks=draw(st.integers(24, 80)),
        requests=tuple(reqs),
        seed=draw(st.integers(0, 2**16)),
        reserve_full_isl=draw(st.booleans()),
        stride=draw(st.sampled_from([0, 0, 96, 144])),
        copy_rewritten=draw(st.sampled_from(["shared", "always"])),
        priority=draw(st.booleans()),
        fallbacks=draw(st.sampled_from([0.0, 0.0, 0.02, 0.1, 0.3])),
        drafts=draw(st.sampled_from([0, 0, 0, 2, 4])),
        sliding=draw(st.sampled_from([0, 0, 40, 64])),
    )


def run_mix(make_config, mix: Mix) -> StandInWorker:
    """Drive the real scheduler through ``mix``; returns the stand-in worker (its violations)."""
    ENGINE.clear()
    WORKER.clear()
    TIERS.__init__()  # type: ignore[misc]  # no tier left over from another mix
    fault.step_fallbacks()  # none left over from another mix
    mix = dataclasses.replace(mix, async_scheduling=mix.async_scheduling and not mix.drafts)  # refused with drafts
    config = make_config(mix.max_batched, mix.max_seqs, mix.reserve_full_isl, mix.priority, mix.drafts)
    config.cache_config.num_gpu_blocks = mix.pool_blocks
    in_flight = mix.max_batched * (2 if mix.async_scheduling else 1)
    server = parse_config(
        {**SERVER, "copy_rewritten": mix.copy_rewritten, **({"stride": mix.stride} if mix.stride else {})}
    )
    spec = KVEvictSpec.from_spec(
        FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32),
        server,
        in_flight,
        mix.max_batched,
        spec_tokens=mix.drafts,
    )
    groups = [KVCacheGroupSpec(["layer.0"], spec)]
    if mix.sliding:
        sliding = SlidingWindowSpec(
            block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=mix.sliding
        )
        groups.append(KVCacheGroupSpec(["layer.1"], sliding))
    kv_config = KVCacheConfig(num_blocks=mix.pool_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    # as vLLM resolves it for a server (``--prefix-cache-retention-interval``, 0 by default):
    # sliding-window groups keep only the blocks a hit at a prompt's end reads
    kv_config.prefix_cache_retention_interval = config.cache_config.prefix_cache_retention_interval
    from vllm.v1.structured_output import StructuredOutputManager

    cls = AsyncScheduler if mix.async_scheduling else Scheduler
    sched = cls(config, kv_config, StructuredOutputManager(config), block_size=BS, hash_block_size=BS)
    hasher = get_request_block_hasher(BS, get_hash_fn_by_name("sha256"))
    rng = random.Random(mix.seed)
    docs = {f"doc{i}": [rng.randrange(3, VOCAB) for _ in range(400)] for i in range(2)}
    eos_rates: dict[str, float] = {}
    prompts: dict[str, list[int]] = {}
    worker = StandInWorker(server, eos_rates, prompts, mix.fallbacks, mix.sliding)
    worker.extra_args = {}
    worker.async_scheduling = mix.async_scheduling
    digests: dict = {}
    seen_windows: set[tuple[int, str]] = set()
    finished_tokens: list[list[int]] = []
    pending = list(enumerate(mix.requests))
    aborts: dict[str, int] = {}
    live: dict[str, Request] = {}

    def record_hashes(req: Request) -> None:
        ds = _prefix_digests(req.all_token_ids)
        for j, h in enumerate(req.block_hashes):
            if (j + 1) * BS <= len(ds):
                digests[_block_key(h)] = ds[j * BS : (j + 1) * BS]
        # the keys its compacted windows would be cached under, at every compaction point
        settings = resolve(server, worker.extra_args[req.request_id], BS)
        if not settings.shares_windows:
            return
        w = settings.window
        for b in range(w.step, len(req.block_hashes) * BS + 1, w.step):
            e = evicted_tokens(b, req.num_prompt_tokens, w)
            if e == 0 or (b, req.request_id) in seen_windows:
                continue
            seen_windows.add((b, req.request_id))
            keys = window_block_keys("sha256", req.block_hashes[b // BS - 1], settings.window_salt, (b - e) // BS, 0)
            for j, key in enumerate(keys):
                worker.windows[bytes(get_block_hash(key))] = (ds[b - 1], settings.window_salt, e + j * BS)
        for b in range(w.step, len(req.block_hashes) * BS + 1, w.step):  # and their tails'
            if evicted_tokens(b, b, w) == 0 or not settings.shares_tails:
                continue
            for i in range(b, min(b + w.step, len(req.block_hashes) * BS), BS):
                key = tail_block_key("sha256", req.block_hashes[(i + BS) // BS - 1], b, settings.window_salt, 0)
                labels = tuple(("after", ds[b - 1], settings.window_salt, ds[q]) for q in range(i, i + BS))
                worker.tails[bytes(get_block_hash(key))] = labels

    def fits(prompt: list[int], max_tokens: int, xargs) -> bool:
        window = resolve(server, xargs, BS).window
        peak = peak_blocks(len(prompt), len(prompt) + max_tokens, window, in_flight, mix.max_batched)
        if mix.sliding:  # and the sliding-window group's blocks (vLLM's own bound)
            peak += min(
                -(-(len(prompt) + max_tokens) // BS), sliding.max_admission_blocks_per_request(in_flight, MAX_LEN)
            )
        return peak <= mix.pool_blocks - 1

    def add(i: int, r: Req) -> None:
        if r.source == "turn" and finished_tokens:
            base = rng.choice(finished_tokens)
        elif r.source.startswith("doc"):
            base = docs[r.source][: r.base]
        else:
            base = []
        prompt = (base + [rng.randrange(3, VOCAB) for _ in range(r.own)])[: MAX_LEN - r.max_tokens - 1]
        xargs = OVERRIDES[r.override] or None
        if mix.drafts and not resolve(server, xargs, BS).drafts_safe:
            return  # the API refuses a policy that counts drafts in its state (plugin.check_request)
        if not fits(prompt, r.max_tokens, xargs):
            return  # the API refuses a request that could not fit the pool alone (plugin.check_fits_pool)
        rid = f"r{i}"
        params = SamplingParams(max_tokens=r.max_tokens, stop_token_ids=[EOS], extra_args=xargs)
        req = Request(rid, prompt, params, None, priority=r.priority, block_hasher=hasher)
        eos_rates[rid], prompts[rid], worker.extra_args[rid] = r.eos, prompt, xargs
        if r.fails:
            worker.fails.add(rid)
        record_hashes(req)
        sched.add_request(req)
        live[rid] = req
        if r.abort is not None:
            aborts[rid] = r.abort

    # which requests the scheduler allocated for in the step being built, and which of those
    # allocations set their attempt's fence over blocks that step would compute
    scheduled_now: set[str] = set()
    fenced_now: set[str] = set()
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]

    def spy(request, start: int, num_tokens: int, scheduled=manager.scheduled) -> None:
        att = manager._attempts.get(request.request_id)
        unfenced = att is not None and att.fence is None
        scheduled(request, start, num_tokens)
        scheduled_now.add(request.request_id)
        if unfenced and att.fence is not None and start < att.fence:
            fenced_now.add(request.request_id)

    manager.scheduled = spy
    queue: list = []
    rounds = 0
    while pending or sched.has_requests() or queue:
        rounds += 1
        assert rounds < 5000, "the schedule did not finish"
        # new arrivals, between any two steps
        while pending and (pending[0][1].arrive <= rounds or not (sched.has_requests() or queue)):
            add(*pending.pop(0))
        for rid in [r for r, n in aborts.items() if n <= 0]:
            del aborts[rid]
            if rid in live:
                if worker.compacted_unseen(rid):
                    worker.paths.add("aborted before the core saw it compact")
                sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        for rid in aborts:
            aborts[rid] -= 1
        if sched.has_requests():
            processed = {r.request_id: r.num_computed_tokens - r.num_in_flight_tokens for r in sched.running}
            scheduled_now.clear()
            fenced_now.clear()
            out = sched.schedule()
            for rid in set(out.preempted_req_ids or ()) & scheduled_now:  # taken back (priority)
                worker.paths.add("priority preempted a request it had scheduled in the step")
                if rid in fenced_now:
                    worker.paths.add("priority took back the step that fenced the attempt")
            for rid in out.scheduled_cached_reqs.req_ids:
                if rid in processed and rid not in out.scheduled_cached_reqs.resumed_req_ids:
                    worker.core_allocates(rid, processed[rid])
            for rid in out.preempted_req_ids or ():
                worker.preemptions += 1
                if worker.compacted_unseen(rid):
                    worker.paths.add("preempted before the core saw it compact")
            worker.allocated(out)
            worker.check_holds(sched.kv_cache_manager, mix.async_scheduling)
            worker.check_cache(sched.kv_cache_manager.block_pool, digests, worker.step_seq + 1)
            result = worker.execute(out, set())
            worker.check_cache(sched.kv_cache_manager.block_pool, digests, worker.step_seq)
            queue.append((out, result))
            if mix.async_scheduling and len(queue) < 2 and out.total_num_scheduled_tokens > 0:
                continue  # the next step is scheduled before this one's output is seen
        if not queue:
            continue
        out, result = queue.pop(0)
        sched.update_from_output(out, result)
        if mix.drafts:  # the drafter's proposals for the next step, as the engine core hands them over
            decoding = [r.request_id for r in sched.running if r.request_id in worker.attempts]
            sched.update_draft_token_ids(worker.propose(decoding, mix.drafts))
        for rid, req in list(live.items()):
            record_hashes(req)
            if req.is_finished():
                if worker.compacted_unseen(rid) and req.status != RequestStatus.FINISHED_ABORTED:
                    worker.paths.add(f"finished ({req.get_finished_reason()}) before the core saw it compact")
                del live[rid]
                finished_tokens.append(list(req.all_token_ids))
        worker.check_cache(sched.kv_cache_manager.block_pool, digests, worker.step_seq)
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == mix.pool_blocks - 1, "blocks leaked"
    assert not ENGINE, "the engine core kept a finished request"
    return worker


#: ``SCHEDULE_EXAMPLES=3000`` for a longer exploration (derandomized: the same mixes every run)
@settings(
    max_examples=int(os.environ.get("SCHEDULE_EXAMPLES", "300")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(mix=mixes())
def test_cached_blocks_are_exact_under_random_schedules(vllm_config, mix):
    worker = run_mix(vllm_config, mix)
    assert not worker.violations, "\n".join(worker.violations[:10])


def _r(source, base, own, max_tokens, eos, override, abort=None, arrive=0, priority=0) -> Req:
    return Req(source, base, own, max_tokens, eos, override, abort, arrive, priority)


#: One mix per schedule-dependent path reachable with vLLM's schedulers; each hashed blocks that a
#: compaction had written, or handed them to a later request, before the engine core decided
#: hashing from the schedule. (The remaining path, a request whose processed tokens pass two
#: compaction points between two of the core's looks, needs a running request to sit out a round
#: while its previous step is in flight, which vLLM 0.32's AsyncScheduler does not do at these
#: token budgets: ``core_allocates`` watches for it in every mix; tests/test_manager.py drives it
#: on the manager directly.)
PATHS = {
    # r0's prompt ends at its first compaction point (96: budget 48, stride 48) and it finishes
    # (or is aborted) in that step
    "finished (length) before the core saw it compact": Mix(
        False, 256, 4, 60, (_r("doc0", 80, 16, 1, 0.0, 0), _r("doc0", 200, 20, 3, 0.0, 3, arrive=3))
    ),
    "finished (stop) before the core saw it compact": Mix(
        False, 256, 4, 60, (_r("doc0", 80, 16, 1, 1.0, 0), _r("doc0", 200, 20, 3, 0.0, 3, arrive=3))
    ),
    "aborted before the core saw it compact": Mix(
        False, 256, 4, 60, (_r("doc0", 112, 16, 1, 0.0, 0, abort=2), _r("doc0", 200, 20, 3, 0.0, 3, arrive=1))
    ),
    # r1's prefill (96 tokens, stride 48) compacts at its end while r0 (eviction off, 11 blocks)
    # and r1 fill the 17-block pool;
    # in the next step r0 decodes into a new block, so FCFS preempts r1 before it is scheduled again
    "preempted before the core saw it compact": Mix(
        False,
        256,
        4,
        18,
        (
            _r("new", 0, 160, 100, 0.0, 3),
            _r("doc0", 80, 16, 20, 0.0, 0, arrive=16),
            _r("doc0", 96, 30, 2, 0.0, 3, arrive=40),
        ),
    ),
}
# The same under async scheduling (the next step is scheduled before the compacting step's output).
PATHS.update(
    {
        f"{k} (async)": dataclasses.replace(m, async_scheduling=True)
        for k, m in list(PATHS.items())
        if not k.startswith("preempted")
    }
)


#: Mixes a longer exploration found (``SCHEDULE_EXAMPLES=2000``), kept so that every run has them.
FOUND = {
    # r1 (CriticalKV, ``once``: it compacts at the end of its 240-token prompt) is preempted after
    # its prefill and resumes with one generated token to recompute: its step must stop at 240
    # (``window.step_limit``), not compact over [192, 241) at once
    "a resumed once request reaches its prompt's end at a step's end": Mix(
        True,
        64,
        2,
        24,
        (_r("doc0", 16, 193, 1, 0.0, 0), _r("doc0", 40, 200, 2, 0.0, 5), _r("doc0", 16, 1, 1, 0.0, 0)),
        reserve_full_isl=False,
    ),
    # (found by the soak test) r0 (budget 96: window bound 12 blocks) ends with the last tail
    # [384, 464); r1 continues it, and starting on that tail would need 5 copies beside its bound:
    # 17 blocks in a pool of 16, never admitted, every waiting request stuck behind it; the hit
    # stops where no copy is needed (KVEvictManager._copies_fit)
    # (found by a search of priority mixes) r0 (CriticalKV, ``once``: 294 prompt tokens, 19 of the
    # 20 blocks) is preempted for r1 (priority 0) and resumes alone with 37 generated tokens to
    # recompute: under async scheduling its step [294, 331) was scheduled while the compaction at
    # 294 was in flight, 19 + 3 blocks, more than the pool: preempted again, at every attempt,
    # forever. It takes what its last block has room for until then (``window.settle_limit``).
    "a resumed once request steps past its prompt while its compaction is in flight": Mix(
        True,
        64,
        4,
        21,
        (_r("new", 0, 294, 40, 0.0, 5, priority=3), _r("doc0", 149, 44, 100, 0.0, 3, arrive=3)),
        seed=1808,
        reserve_full_isl=False,
        priority=True,
    ),
    # (found with drafts) r1, a one-token prompt with a ``once`` window, arrives while r0 decodes:
    # vLLM pads its first step to 1 + 2 tokens (two placeholder drafts), a step it asserts runs
    # whole, and the plugin cut it at the prompt's end, where nothing is evicted
    "a padded first step of a one-token prompt": Mix(
        False,
        32,
        2,
        24,
        (
            _r("doc0", 16, 1, 2, 0.0, 0),
            _r("new", 16, 1, 1, 0.0, 5, arrive=2),
            _r("doc0", 16, 1, 1, 0.0, 0),
        ),
        reserve_full_isl=False,
        drafts=2,
    ),
    "a hit whose copies would not fit beside its window bound": Mix(
        False, 128, 4, 17, (_r("new", 0, 470, 10, 0.0, 2), _r("turn", 0, 20, 10, 0.0, 2, arrive=80))
    ),
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_found_mixes(vllm_config, name):
    worker = run_mix(vllm_config, FOUND[name])
    assert not worker.violations, "\n".join(worker.violations[:10])


@pytest.mark.parametrize("path", sorted(PATHS))
def test_each_schedule_dependent_path(vllm_config, path):
    """Each path by name: the mix goes through it, and every cached block is still exact."""
    worker = run_mix(vllm_config, PATHS[path])
    assert path.removesuffix(" (async)") in worker.paths, (
        f"the mix no longer goes through this path ({sorted(worker.paths)})"
    )
    assert not worker.violations, "\n".join(worker.violations[:10])


#: Mixes that start requests on cached compacted windows: a shared document (sync and async), a chat
#: turn continuing a finished request's prompt and output, two budgets side by side (each request
#: hits only its own configuration's windows), and a pool small enough to preempt.
WINDOW_MIXES = {
    "shared document": Mix(
        False, 256, 4, 60, (_r("doc0", 400, 20, 5, 0.0, 0), _r("doc0", 400, 30, 5, 0.0, 0, arrive=12))
    ),
    "shared document (async)": Mix(
        True, 256, 4, 60, (_r("doc0", 400, 20, 5, 0.0, 0), _r("doc0", 400, 30, 5, 0.0, 0, arrive=12))
    ),
    # r1 looks the document up in the step in which r0 compacts at a point r1 could use: a window
    # is cached only once the step that made it has run, never for a request in the same step
    "arriving while the window is made": Mix(
        False,
        256,
        4,
        60,
        (
            _r("doc0", 400, 20, 5, 0.0, 0),
            _r("doc0", 400, 30, 5, 0.0, 0, arrive=3),
            _r("doc0", 400, 30, 5, 0.0, 0, arrive=30),
        ),
    ),
    "chat turn": Mix(False, 128, 4, 60, (_r("new", 0, 200, 100, 0.0, 0), _r("turn", 0, 40, 10, 0.0, 0, arrive=130))),
    "chat turn (async)": Mix(
        True, 128, 4, 60, (_r("new", 0, 200, 100, 0.0, 0), _r("turn", 0, 40, 10, 0.0, 0, arrive=130))
    ),
    "two budgets": Mix(
        False,
        256,
        4,
        60,
        (
            _r("doc1", 400, 10, 3, 0.0, 0),
            _r("doc1", 400, 10, 3, 0.0, 2),
            _r("doc1", 400, 25, 3, 0.0, 2, arrive=14),
            _r("doc1", 400, 35, 3, 0.0, 0, arrive=14),
        ),
    ),
    "with preemption": Mix(
        False,
        64,
        4,
        24,
        (
            _r("doc0", 400, 20, 40, 0.0, 0),
            _r("doc0", 400, 30, 40, 0.0, 0, arrive=10),
            _r("doc0", 400, 40, 40, 0.0, 0, arrive=10),
            _r("turn", 0, 20, 40, 0.0, 0, arrive=40),
        ),
    ),
}


#: Stride 96 over the server's budget 48 (W = 48): the blocks a request computes in [b, b + 48) after
#: each compaction point b are cached as the window's tail, and a later request with that prefix
#: starts past the window, at the last tail block its own tokens share (a document of 400: the
#: window at 384 and the tail block [384, 400)).
TAIL_MIXES = {
    "shared document": dataclasses.replace(WINDOW_MIXES["shared document"], stride=96),
    "shared document (async)": dataclasses.replace(WINDOW_MIXES["shared document (async)"], stride=96),
    "arriving while the tail is made": dataclasses.replace(
        WINDOW_MIXES["arriving while the window is made"], stride=96
    ),
    # r0 computes 319 tokens: the window at 288 and the tail block [288, 304)
    "chat turn": Mix(
        False, 128, 4, 60, (_r("new", 0, 200, 120, 0.0, 0), _r("turn", 0, 40, 10, 0.0, 0, arrive=150)), stride=96
    ),
    "with preemption": dataclasses.replace(WINDOW_MIXES["with preemption"], stride=96),
}


#: The default stride (W = 48): a compaction at p rewrites [p - 48, p); the blocks before
#: hit_end(p) = p - 16 are copied aside first (the step reaching p starts there) and cached, and a
#: later request that starts on them gets its own copies (its next compaction rewrites them).
COPY_MIXES = {
    # r0 (440 tokens) compacts at 432: [384, 416) is copied aside as the tail of the window at 384
    # (copy_rewritten: always; r1 comes after r0 has computed its prompt, so it never waits); r1
    # starts on that window and the tail block [384, 400) that its document shares
    "shared document": Mix(
        False,
        256,
        4,
        60,
        (_r("doc0", 400, 40, 5, 0.0, 0), _r("doc0", 400, 30, 5, 0.0, 0, arrive=30)),
        copy_rewritten="always",
    ),
    "shared document (async)": Mix(
        True,
        256,
        4,
        60,
        (_r("doc0", 400, 40, 5, 0.0, 0), _r("doc0", 400, 30, 5, 0.0, 0, arrive=30)),
        copy_rewritten="always",
    ),
    # r0 and r1 arrive together: r1 waits (KVEvictManager.waits_for_window) until r0 has cached
    # the window at 384 and the copies of [384, 416), then starts on them
    "arriving together": Mix(False, 256, 4, 60, (_r("doc0", 400, 40, 5, 0.0, 0), _r("doc0", 400, 30, 5, 0.0, 0))),
    "arriving together (async)": Mix(
        True, 256, 4, 60, (_r("doc0", 400, 40, 5, 0.0, 0), _r("doc0", 400, 30, 5, 0.0, 0))
    ),
    # r0 compacts first at 96 (E1 = 48): [48, 80) is copied aside as pure blocks; r1 (a 90-token
    # document) starts on the pure hit [0, 80), past E1, with its own copies of [48, 80)
    "pure hit past the first compaction": Mix(
        False,
        256,
        4,
        60,
        (_r("doc0", 90, 30, 5, 0.0, 0), _r("doc0", 90, 20, 5, 0.0, 0, arrive=6)),
        copy_rewritten="always",
    ),
    # r1 looks up while r0 caches [0, 96) as it is computed (eviction off): no copy reads a block
    # that the step being scheduled computes
    "hit on blocks being computed": Mix(
        True,
        256,
        4,
        60,
        (_r("doc0", 200, 30, 5, 0.0, 3), _r("doc0", 90, 20, 5, 0.0, 0), _r("doc0", 90, 20, 5, 0.0, 0, arrive=1)),
    ),
    # r0 computes 319 tokens, its last compaction point 288: when it ends, its block [288, 304) is
    # cached as the last tail of that window; r1 (its prompt and answer, then its own) starts on
    # the window and that block, with its own copy of it (its compaction at 336 rewrites it)
    "chat turn": dataclasses.replace(TAIL_MIXES["chat turn"], stride=0),
    "chat turn (async)": dataclasses.replace(TAIL_MIXES["chat turn"], stride=0, async_scheduling=True),
    # a pool of 20 blocks: a request is preempted and starts again on copies
    "with preemption": Mix(
        False,
        64,
        4,
        20,
        (
            _r("doc0", 400, 40, 40, 0.0, 0),
            _r("doc0", 400, 30, 40, 0.0, 0, arrive=20),
            _r("doc0", 400, 20, 40, 0.0, 0, arrive=20),
            _r("turn", 0, 20, 40, 0.0, 0, arrive=40),
        ),
        copy_rewritten="always",
    ),
}


@pytest.mark.parametrize("name", sorted(COPY_MIXES))
def test_requests_start_on_copied_blocks(vllm_config, name):
    """Blocks a compaction rewrites are copied aside and cached; requests start on them with
    their own copies; every slot every request reads holds what it would have computed, and no
    request writes a cached block."""
    worker = run_mix(vllm_config, COPY_MIXES[name])
    assert not worker.violations, "\n".join(worker.violations[:10])
    if name != "hit on blocks being computed":
        assert worker.copied_starts > 0, "no request started on copies"
    if name == "with preemption":
        assert worker.preemptions > 0, "no request was preempted"


def test_nothing_is_copied_aside_for_a_request_nobody_waits_for(vllm_config):
    """``copy_rewritten: shared`` (the default): r1 comes after r0 has computed its prompt (it
    never waits), so r0's compactions copy nothing aside and r1 starts on the window alone (a
    conversation's turns: copies held at the window's fullest would only add to its peak)."""
    worker = run_mix(vllm_config, dataclasses.replace(COPY_MIXES["shared document"], copy_rewritten="shared"))
    assert not worker.violations, "\n".join(worker.violations[:10])
    assert worker.copied_starts == 0 and worker.window_reads > 0


@pytest.mark.parametrize("name", sorted(TAIL_MIXES))
def test_requests_start_on_cached_tails(vllm_config, name):
    """Each mix starts some request past a cached window, on blocks another request computed
    after it, and every slot every request reads holds what that request would have computed."""
    worker = run_mix(vllm_config, TAIL_MIXES[name])
    assert not worker.violations, "\n".join(worker.violations[:10])
    assert worker.tail_reads > 0, "no request started on a cached tail"


@pytest.mark.parametrize("name", sorted(WINDOW_MIXES))
def test_requests_start_on_cached_windows(vllm_config, name):
    """Each mix starts some request on a cached compacted window, and every slot every request
    reads (window hits included) holds what that request would have computed itself."""
    worker = run_mix(vllm_config, WINDOW_MIXES[name])
    assert not worker.violations, "\n".join(worker.violations[:10])
    assert worker.window_reads > 0, "no request started on a cached window"


RECALL = OVERRIDES.index({"kvevict_recall": True})


def _with_recall(mix: Mix) -> Mix:
    return dataclasses.replace(mix, requests=tuple(dataclasses.replace(r, override=RECALL) for r in mix.requests))


#: Stride 96 with recall (its query window 32): a prompt ending 48 tokens or more after its last
#: point ``b`` has its blocks after ``b`` copied before the step completing it (which starts at
#: ``prompt_tail``'s end), cached as the tail of the window at ``b``. r0 (460 tokens): the window at
#: 384 and the tail [384, 416); r1 (450) starts on the window and the block [384, 400) its document
#: shares; a chat's next turn starts on the first turn's window at 192 and tail [192, 208).
_RECALL_DOC = dataclasses.replace(
    TAIL_MIXES["shared document"], requests=(_r("doc0", 400, 60, 5, 0.0, 0), _r("doc0", 400, 50, 5, 0.0, 0, arrive=12))
)
_RECALL_CHAT = Mix(
    False, 128, 4, 60, (_r("new", 0, 250, 120, 0.0, 0), _r("turn", 0, 40, 10, 0.0, 0, arrive=150)), stride=96
)
RECALL_TAIL_MIXES = {
    "shared document": _RECALL_DOC,
    "shared document (async)": dataclasses.replace(_RECALL_DOC, async_scheduling=True),
    "arriving while the tail is made": dataclasses.replace(
        TAIL_MIXES["arriving while the tail is made"],
        requests=(
            _r("doc0", 400, 60, 5, 0.0, 0),
            _r("doc0", 400, 50, 5, 0.0, 0, arrive=3),
            _r("doc0", 400, 70, 5, 0.0, 0, arrive=30),
        ),
    ),
    # stride W = 48: r0 (420 tokens) ends too soon after its point 384 for a tail, so its
    # compaction there copies [336, 368) aside though nobody waits (r1 comes later): the tail of
    # the window at 336, empty otherwise; r1 (384 tokens: it cannot start on the window at 384)
    # starts at 352 on it, recall's queries after
    "a prompt ending at the next point": dataclasses.replace(
        WINDOW_MIXES["shared document"],
        requests=(_r("doc0", 400, 20, 5, 0.0, 0), _r("doc0", 380, 4, 5, 0.0, 0, arrive=40)),
    ),
    "chat turn": _RECALL_CHAT,
    "chat turn (async)": dataclasses.replace(_RECALL_CHAT, async_scheduling=True),
    "with preemption": dataclasses.replace(
        TAIL_MIXES["with preemption"],
        requests=(
            _r("doc0", 400, 60, 40, 0.0, 0),
            _r("doc0", 400, 50, 40, 0.0, 0, arrive=10),
            _r("doc0", 400, 70, 40, 0.0, 0, arrive=10),
            _r("turn", 0, 20, 40, 0.0, 0, arrive=40),
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(WINDOW_MIXES) + [f"tail: {n}" for n in sorted(RECALL_TAIL_MIXES)])
def test_recall_requests_start_on_cached_windows_with_their_tiers(vllm_config, name):
    """The window mixes with recall: each request's window before its prompt's end is cached (as
    copies: the step completing its prompt re-selects its own window in place) with its tier, and
    its blocks after that point as the window's tail (copied before that step), a later request
    starts on a window (and tail) with that window's tier, and no cached block ever holds what a
    prompt's end recalled."""
    tails = name.startswith("tail: ")
    mix = RECALL_TAIL_MIXES[name.removeprefix("tail: ")] if tails else WINDOW_MIXES[name]
    worker = run_mix(vllm_config, _with_recall(mix))
    assert not worker.violations, "\n".join(worker.violations[:10])
    assert worker.recall_starts > 0, "no recall request started on a cached window"
    assert worker.recalls > 0
    if tails:
        assert worker.tail_reads > 0, "no recall request started on a tail"


@pytest.mark.parametrize("sliding", [40, 64])
@pytest.mark.parametrize("name", sorted(WINDOW_MIXES) + [f"tail: {n}" for n in sorted(TAIL_MIXES)])
def test_hybrid_models_start_on_cached_windows(vllm_config, name, sliding):
    """A model with sliding-window layers beside the evicting ones (Gemma 2 and 3, gpt-oss: a
    second KV cache group, which keeps by default only the blocks a hit at a prompt's end reads):
    requests start on cached windows and tails with the sliding-window group's blocks of the same
    tokens, and every slot each layer reads holds what the request would have computed itself."""
    mix = TAIL_MIXES[name.removeprefix("tail: ")] if name.startswith("tail: ") else WINDOW_MIXES[name]
    worker = run_mix(vllm_config, dataclasses.replace(mix, sliding=sliding))
    assert not worker.violations, "\n".join(worker.violations[:10])
    assert worker.window_reads > 0, "no request started on a cached window"


def _failing(r: Req) -> Req:
    return dataclasses.replace(r, fails=True)


#: A request whose policy fails on the worker at its first compaction (the safe policy compacts its
#: windows from then on): nothing of it is cached for the others, who compute the document
#: themselves and cache their own windows, read by the requests after them.
FALLBACK_MIXES = {
    "shared document": Mix(
        False,
        256,
        4,
        60,
        (
            _failing(_r("doc0", 400, 20, 5, 0.0, 0)),
            _r("doc0", 400, 30, 5, 0.0, 0, arrive=12),
            _r("doc0", 400, 40, 5, 0.0, 0, arrive=40),
        ),
    ),
    # per-slot state (H2O): the window's state is snapshotted by the policy, never by the safe one
    "shared document, per-slot state (async)": Mix(
        True,
        256,
        4,
        60,
        (
            _failing(_r("doc0", 400, 20, 5, 0.0, 4)),
            _r("doc0", 400, 30, 5, 0.0, 4, arrive=12),
            _r("doc0", 400, 40, 5, 0.0, 4, arrive=40),
        ),
    ),
    # r1 arrives while r0 computes the document: it would wait for r0's windows (and copies), which
    # a request that fell back never caches
    "arriving together": Mix(
        False,
        256,
        4,
        60,
        (
            _failing(_r("doc0", 400, 40, 5, 0.0, 0)),
            _r("doc0", 400, 30, 5, 0.0, 0),
            _r("doc0", 400, 20, 5, 0.0, 0, arrive=40),
        ),
    ),
    "chat turn": Mix(
        False,
        128,
        4,
        60,
        (
            _failing(_r("new", 0, 200, 100, 0.0, 0)),
            _r("turn", 0, 40, 10, 0.0, 0, arrive=130),
            _r("turn", 0, 40, 10, 0.0, 0, arrive=200),
        ),
        stride=96,
    ),
}


@pytest.mark.parametrize("name", sorted(FALLBACK_MIXES))
def test_a_request_that_fell_back_caches_nothing(vllm_config, name):
    """The request that fell back reads and writes only its own blocks; every request after it reads
    windows its own configuration computed, and some request still starts on a cached window."""
    worker = run_mix(vllm_config, FALLBACK_MIXES[name])
    assert not worker.violations, "\n".join(worker.violations[:10])
    assert worker.fallbacks == 1
    assert worker.window_reads > 0, "no request started on a cached window"


#: Speculative decoding (n-gram drafts, four per step, two in three of them the model's own): a
#: step with drafts never compacts (``window.draft_cut``), and windows, tails and copies made while
#: decoding with drafts are what the same requests make without them.
SPEC_MIXES = {
    "decoding across compaction points": Mix(
        False, 128, 4, 60, (_r("new", 0, 100, 100, 0.0, 0), _r("new", 0, 60, 100, 0.0, 6, arrive=2)), drafts=4
    ),
    "chat turn": dataclasses.replace(WINDOW_MIXES["chat turn"], drafts=4),
    "chat turn with copies": dataclasses.replace(COPY_MIXES["chat turn"], drafts=4),
    "with preemption": dataclasses.replace(WINDOW_MIXES["with preemption"], drafts=2),
}


@pytest.mark.parametrize("name", sorted(SPEC_MIXES))
def test_drafts_never_reach_a_window(vllm_config, name):
    worker = run_mix(vllm_config, SPEC_MIXES[name])
    assert not worker.violations, "\n".join(worker.violations[:10])
    assert 0 < worker.accepted < worker.drafts, (worker.accepted, worker.drafts)
    assert worker.compactions > 0
    if name.startswith("chat"):
        assert worker.window_reads > 0
