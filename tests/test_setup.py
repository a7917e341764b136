# SPDX-License-Identifier: Apache-2.0
"""The setup script is idempotent: once set up, it installs nothing and says so."""

from __future__ import annotations

import subprocess
import time

from tests.conftest import ROOT


def test_second_setup_skips_installs():
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], check=True, capture_output=True, text=True)
    assert out.stdout.startswith("setup: up to date"), out.stdout + out.stderr
    assert time.monotonic() - t0 < 30
