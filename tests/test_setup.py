# SPDX-License-Identifier: Apache-2.0
"""The setup script is idempotent: once set up, it installs nothing and says so; a fresh clone has
what compose mounts."""

from __future__ import annotations

import subprocess
import time

from tests.conftest import ROOT


def test_second_setup_skips_installs():
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], check=True, capture_output=True, text=True)
    assert out.stdout.startswith("setup: up to date"), out.stdout + out.stderr
    assert time.monotonic() - t0 < 30


def test_compose_mounts_a_directory_a_fresh_clone_has():
    """docker/compose.yaml's default model mount (``${MODELS_DIR:-./models}``, beside the file) is a
    tracked directory, so ``docker compose up`` from a fresh clone finds its bind source (its README
    says the one command that fills it)."""
    import re
    import subprocess

    import yaml

    root = ROOT
    compose = yaml.safe_load((root / "docker" / "compose.yaml").read_text())
    source = compose["x-kvevict-common"]["volumes"][0]["source"]
    default = re.fullmatch(r"\$\{MODELS_DIR:-(.+)\}", source).group(1)
    models = (root / "docker" / default).resolve()
    tracked = subprocess.run(
        ["git", "ls-files", str(models.relative_to(root))], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split()
    assert tracked == ["docker/models/README.md"]
    assert "vllm_kvevict.testing.models smollm2" in (models / "README.md").read_text()


def test_make_tests_runs_fail_on_a_failure_and_on_nothing_collected(tmp_path):
    """scripts/test.sh (make test's pytest runs): a failing test fails it, a passing one does not,
    and no test collected by either run fails it (pytest's exit code 5 twice)."""
    (tmp_path / "test_one.py").write_text("def test_passes():\n    pass\n\ndef test_fails():\n    assert False\n")
    script = str(ROOT / "scripts" / "test.sh")

    def run(*args: str) -> subprocess.CompletedProcess:
        cmd = ["bash", script, "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", "/dev/null", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    one = str(tmp_path / "test_one.py")
    assert run(one, "-k", "passes").returncode == 0
    failed = run(one)
    assert failed.returncode == 1, failed.stdout[-2000:]
    assert "tests without an engine exit 1, engine tests exit 5" in failed.stderr
    none = run(one, "-k", "no_such_test")
    assert none.returncode == 1 and "collected no tests" in none.stderr, none.stderr
