# SPDX-License-Identifier: Apache-2.0
"""vllm-kvevict: KV-cache eviction for vLLM, as an attention-backend plugin.

``register`` is the ``vllm.general_plugins`` entry point; importing this package does not import vLLM.
"""

__version__ = "0.1.0"


def register() -> None:
    from vllm_kvevict.plugin import register as _register

    _register()


__all__ = ["register", "__version__"]
