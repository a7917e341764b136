# SPDX-License-Identifier: Apache-2.0
"""vLLM's streaming input (``AsyncLLM.generate`` with a stream of inputs, as its realtime API
uses): each input extends a live request's prompt while it keeps its blocks, so the prompt's
length, on which a ``once`` window's compaction point and a window's caching depend, would change
under a compacted window. A request that evicts is refused with one line naming
``kvevict_enabled``; the same request with eviction off runs (vLLM's AsyncLLM in a process of its
own, on the tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_kvevict.testing.server import BASE_ENV

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

SCRIPT = """
import asyncio, json, sys
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.engine.protocol import StreamingInput
from vllm.inputs import TokensPrompt
from vllm.v1.engine.async_llm import AsyncLLM


async def main(model, xargs_list):
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, dtype="float32", block_size=32, enforce_eager=True, attention_backend="kvevict",
        kv_cache_memory_bytes=256 * 2**20, additional_config={"kvevict": {"policy": "keydiff", "budget": 64}},
    ))

    async def inputs():
        for i in range(2):
            yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=list(range(10 + i, 200 + i))))

    try:
        for n, xargs in enumerate(json.loads(xargs_list)):  # one engine, one streamed request after another
            try:
                async for out in llm.generate(inputs(), SamplingParams(max_tokens=4, extra_args=xargs), f"s{n}"):
                    pass
                print("RESULT ok", len(out.outputs[0].token_ids), flush=True)
            except Exception as e:
                print("RESULT", type(e).__name__, e, flush=True)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def _run(tmp_path, model, xargs: list[dict]) -> list[str]:
    script = tmp_path / "stream.py"
    script.write_text(SCRIPT)
    env = {**os.environ, **BASE_ENV, "KVEVICT_CONFIG": ""}
    argv = [sys.executable, str(script), str(model), json.dumps(xargs)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    results = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and len(results) == len(xargs), (proc.stdout + proc.stderr)[-3000:]
    return results


def test_streaming_input_is_refused_when_the_request_evicts(tiny_model, tmp_path):
    """The refused request first: the engine still serves the next one, with eviction off."""
    assert _run(tmp_path, tiny_model, [{}, {"kvevict_enabled": False}]) == [
        "RESULT VLLMValidationError kvevict_enabled: streaming input is not supported with eviction (the prompt "
        "would grow under a compacted window); send each input as a request of its own, or set kvevict_enabled "
        "to false for this one (parameter=kvevict_enabled)",
        "RESULT ok 8",
    ]
