# SPDX-License-Identifier: Apache-2.0
"""The plugin's logger: a child of vLLM's ``vllm`` logger, so it shares vLLM's handlers and format."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.kvevict")

_logged: set[str] = set()


def info_once(msg: str, key: str | None = None) -> None:
    """Log ``msg`` at INFO the first time ``key`` (default: the message) is seen in this process."""
    k = key or msg
    if k not in _logged:
        _logged.add(k)
        logger.info(msg, stacklevel=2)
