# SPDX-License-Identifier: Apache-2.0
"""The OCI image tests (``-m docker``): hadolint, compose.yaml, and the CPU image built and served
with podman. Slow (a clean build downloads torch and vLLM), so a plain ``pytest``/``make test``
skips them; ``make test-docker`` (``pytest -m docker tests/docker``) runs them."""

from __future__ import annotations

import pytest

#: What the image tests measured (build time, image size, ...), printed at the end of the run.
MEASURED: dict[str, str] = {}


def pytest_collection_modifyitems(config, items):
    if "docker" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="builds and runs OCI images (slow): `make test-docker` (pytest -m docker)")
    for item in items:
        if item.get_closest_marker("docker"):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if MEASURED:
        terminalreporter.section("docker images")
        for key, value in MEASURED.items():
            terminalreporter.write_line(f"{key}: {value}")
