# SPDX-License-Identifier: Apache-2.0
"""``python -m vllm_kvevict.bench``: the same as ``kvevict-bench``."""

import sys

from vllm_kvevict.bench.cli import main

sys.exit(main())
