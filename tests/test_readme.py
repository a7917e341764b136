# SPDX-License-Identifier: Apache-2.0
"""The README's configuration tables say what ``vllm_kvevict/config.py`` accepts: every key of the
``kvevict`` object (its ``recall`` and ``limits`` sub-objects and the policies' parameter objects
included) and every per-request key is in them, with its default, and nothing else is."""

from __future__ import annotations

import json
import re

import tomllib
from pydantic import BaseModel

from tests.conftest import ROOT
from vllm_kvevict.config import REQUEST_KEYS, KVEvictConfig, LimitsConfig, RecallConfig
from vllm_kvevict.policies import POLICIES

README = (ROOT / "README.md").read_text()
SUB_OBJECTS = {"recall": RecallConfig, "limits": LimitsConfig}


def _section(heading: str) -> str:
    return README.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _rows() -> dict[str, list[str]]:
    """Each key named in the first cell of a row of the Configuration section's tables -> its cells."""
    rows: dict[str, list[str]] = {}
    for line in _section("Configuration").splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        for key in re.findall(r"`([^`]+)`", cells[0]):
            assert key not in rows, f"{key} is in the README's tables twice"
            rows[key] = cells
    return rows


def _fields(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    """Every key of the configuration -> its field (the sub-objects' keys dotted)."""
    out: dict[str, object] = {}
    for name, field in model.model_fields.items():
        out[prefix + name] = field
        if not prefix and name in SUB_OBJECTS:
            out |= _fields(SUB_OBJECTS[name], prefix=f"{name}.")
    return out


def test_every_configuration_key_is_in_the_readme_and_every_readme_key_exists():
    documented = set(_rows())
    keys = set(_fields(KVEvictConfig)) | set(REQUEST_KEYS)
    assert keys - documented == set(), f"not in the README's configuration tables: {sorted(keys - documented)}"
    assert documented - keys == set(), f"in the README's tables but not in config.py: {sorted(documented - keys)}"


def test_the_readme_gives_each_plain_default():
    """A field with a plain default shows it (JSON, in backticks) in the default column; one that
    defaults to None says "unset"."""
    rows = _rows()
    wrong = []
    for key, field in _fields(KVEvictConfig).items():
        if field.default_factory is not None or key not in rows:  # sub-objects; a missing key: the test above
            continue
        cell = rows[key][2]
        want = "unset" if field.default is None else f"`{json.dumps(field.default)}`"
        if want not in cell:
            wrong.append(f"{key}: README says {cell!r}, config.py {want}")
    assert not wrong, "\n".join(wrong)


def test_the_readme_names_every_policy():
    policy_row = _rows()["policy"]
    named = set(re.findall(r"`([a-z0-9]+)`", policy_row[3]))
    assert named == set(POLICIES), f"README's policy row: {sorted(named ^ set(POLICIES))}"


def test_lint_tools_are_pinned_alike_in_setup_and_pyproject():
    """``make test`` lints with the ruff and mypy that scripts/setup.sh installs; the ``test`` extra
    pins the same versions."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    for tool in ("ruff", "mypy"):
        pinned = re.search(rf'^{tool.upper()}_VERSION="([^"]+)"$', setup, flags=re.M)
        assert pinned, f"scripts/setup.sh does not pin {tool}"
        assert f'"{tool}==${tool.upper()}_VERSION"' in setup
        assert f"{tool}=={pinned.group(1)}" in extra, (tool, extra)
