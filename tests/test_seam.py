# SPDX-License-Identifier: Apache-2.0
"""The package's layering, checked on its source: one seam to vLLM, arrows pointing down, every
environment variable in one table, and the seam's one patch helper."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import vllm_kvevict
from vllm_kvevict import envs
from vllm_kvevict.vllm_compat import patching

PKG = Path(vllm_kvevict.__file__).parent
ROOT = PKG.parent


def _modules() -> dict[str, Path]:
    return {p.relative_to(PKG).as_posix(): p for p in sorted(PKG.rglob("*.py"))}


def _imports(path: Path) -> list[str]:
    return _imports_of(path.read_text(), ".".join(("vllm_kvevict", *path.relative_to(PKG).parent.parts)))


def _imports_of(src: str, pkg: str) -> list[str]:
    """Every module ``src`` imports (absolute names; relative imports resolved against ``pkg``)."""
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.append(base)
            out += [f"{base}.{a.name}" for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            out.append(str(node.args[0].value))
    return out


def _is_vllm(name: str) -> bool:
    return name == "vllm" or name.startswith("vllm.")


def test_only_the_seam_imports_vllm():
    offenders = {
        rel: sorted({n for n in _imports(p) if _is_vllm(n)})
        for rel, p in _modules().items()
        if not rel.startswith("vllm_compat/")
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"vLLM imported outside vllm_kvevict/vllm_compat/: {offenders}"


def test_the_rule_catches_an_import():
    """The check above sees an import of vLLM however it is written."""
    src = (
        "import vllm.config\nfrom vllm.v1 import x\nfrom vllm import _custom_ops\n"
        "def f():\n    import vllm\n    importlib.import_module('vllm.a')\n"
    )
    found = {n for n in _imports_of(src, "vllm_kvevict.backends") if _is_vllm(n)}
    assert {"vllm.config", "vllm.v1", "vllm", "vllm._custom_ops", "vllm.a"} <= found
    assert _imports_of("from . import plan\nfrom ..kernels import ops\n", "vllm_kvevict.backends") == [
        "vllm_kvevict.backends",
        "vllm_kvevict.backends.plan",
        "vllm_kvevict.kernels",
        "vllm_kvevict.kernels.ops",
    ]


LOWER = {  # package -> what it may import from vllm_kvevict (arrows point down)
    "kernels/": ("vllm_kvevict.kernels", "vllm_kvevict.envs"),
    "policies/": ("vllm_kvevict.policies", "vllm_kvevict.kernels", "vllm_kvevict.envs"),
    "window.py": (),
    "envs.py": (),
    "config.py": ("vllm_kvevict.policies", "vllm_kvevict.window", "vllm_kvevict.envs"),
    "request.py": ("vllm_kvevict.config", "vllm_kvevict.policies", "vllm_kvevict.window", "vllm_kvevict.envs"),
    "vllm_compat/": ("vllm_kvevict.vllm_compat", "vllm_kvevict.envs"),
}


@pytest.mark.parametrize("prefix", sorted(LOWER))
def test_arrows_point_down(prefix):
    allowed = LOWER[prefix]
    bad = {}
    for rel, p in _modules().items():
        if not rel.startswith(prefix):
            continue
        own = [n for n in _imports(p) if n.startswith("vllm_kvevict")]
        wrong = sorted({n for n in own if n != "vllm_kvevict" and not n.startswith(allowed)})
        if wrong:
            bad[rel] = wrong
    assert not bad, f"{prefix} imports layers above it: {bad}"


def test_kernels_do_not_import_policies():
    for rel, p in _modules().items():
        if rel.startswith("kernels/"):
            assert not [n for n in _imports(p) if n.startswith("vllm_kvevict.policies")], rel


def test_environment_variables_are_read_in_one_place():
    """No module but envs.py reads a ``KVEVICT_*`` variable from the environment."""
    pattern = re.compile(r"(os\.environ(\.get)?|os\.getenv)\s*[\[(]\s*[\"']KVEVICT_")
    readers = [rel for rel, p in _modules().items() if rel != "envs.py" and pattern.search(p.read_text())]
    assert not readers
    used = set()
    for p in [*PKG.rglob("*.py"), *(p for p in (ROOT / "tests").rglob("*.py") if p.name != "test_seam.py")]:
        used |= set(re.findall(r"\bKVEVICT_[A-Z_]+\b", p.read_text()))
    used -= {"KVEVICT_"}
    assert used <= set(envs.VARS), f"not in vllm_kvevict/envs.py: {sorted(used - set(envs.VARS))}"


def test_docs_list_every_environment_variable():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert envs.markdown_table() in doc, "docs/configuration.md: paste vllm_kvevict.envs.markdown_table()"


def test_envs_are_read_at_use_time(monkeypatch):
    monkeypatch.setenv("KVEVICT_BATCHED", "0")
    assert envs.KVEVICT_BATCHED is False
    monkeypatch.setenv("KVEVICT_BATCHED", "1")
    assert envs.KVEVICT_BATCHED is True
    monkeypatch.delenv("KVEVICT_KERNELS", raising=False)
    assert envs.KVEVICT_KERNELS == "auto"
    monkeypatch.setenv("KVEVICT_TEST_FAULT", " snapkv, tova@prepare ,")
    assert envs.KVEVICT_TEST_FAULT == {"snapkv", "tova@prepare"}
    with pytest.raises(AttributeError):
        envs.KVEVICT_NOPE  # noqa: B018


def test_seam_modules_name_the_versions_they_were_written_for():
    for rel, p in _modules().items():
        if rel.startswith("vllm_compat/") and rel != "vllm_compat/patching.py":
            doc = ast.get_docstring(ast.parse(p.read_text())) or ""
            assert "0.32" in doc and "0.33" in doc, f"{rel}: say which vLLM versions it was written against"


def test_docstrings_cite_files_that_exist():
    """``path/to/file.py`` or ``file.md`` named in the package's docstrings and docs exist here (or,
    for the vLLM files the seam names, in the installed vLLM)."""
    import importlib.util

    VLLM = Path(importlib.util.find_spec("vllm").origin).parent
    cited = re.compile(r"\b((?:[\w.-]+/)*[\w-]+\.(?:py|md))\b")
    missing = set()
    texts = [(p, p.read_text()) for p in PKG.rglob("*.py")] + [(p, p.read_text()) for p in (ROOT / "docs").glob("*.md")]
    texts.append((ROOT / "README.md", (ROOT / "README.md").read_text()))
    for p, text in texts:
        for name in cited.findall(text):
            if "/" not in name and name.endswith(".py"):
                continue  # a bare module name: too ambiguous to resolve
            # ours, or a file of vLLM's (the seam names the vLLM files it was written against)
            candidates = [ROOT / name, PKG / name, ROOT / "docs" / name, p.parent / name, VLLM / name]
            if not any(c.exists() for c in candidates):
                missing.add((p.relative_to(ROOT).as_posix(), name))
    assert not missing, sorted(missing)


# -- the one patch helper ------------------------------------------------------------------------


class _Base:
    def method(self, x):
        return ("base", x)

    @classmethod
    def cm(cls, x):
        return (cls.__name__, x)


class _Child(_Base):
    def own(self):
        return "own"


def test_wrap_method_is_idempotent_and_reversible():
    calls = []

    def make(orig):
        def wrapper(self, *a):
            calls.append(a)
            return orig(self, *a)

        return wrapper

    assert patching.wrap_method(_Child, "method", make, "test")  # inherited
    assert not patching.wrap_method(_Child, "method", make, "test")  # a second wrap is a no-op
    assert _Child().method(1) == ("base", 1) and calls == [(1,)]
    assert _Base().method(2) == ("base", 2) and calls == [(1,)]  # the base class is untouched
    assert patching.is_wrapped(_Child, "method")

    def make_cm(orig):
        def wrapper(cls, x):
            return ("wrapped", *orig(cls, x))

        return wrapper

    patching.wrap_method(_Child, "cm", make_cm, "test")
    assert _Child.cm(3) == ("wrapped", "_Child", 3) and _Base.cm(3) == ("_Base", 3)
    patching.wrap_method(_Child, "own", lambda orig: lambda self: orig(self) + "!", "test")
    assert _Child().own() == "own!"
    for name in ("method", "cm", "own"):
        patching.unwrap(_Child, name)
    assert "method" not in _Child.__dict__ and "cm" not in _Child.__dict__  # inherited again
    assert _Child().own() == "own" and _Child.cm(4) == ("_Child", 4)
    assert not patching.is_wrapped(_Child, "method")


def test_wrap_method_names_what_it_cannot_find():
    """A missing name raises AttributeError naming its owner, a class or a module (a module has
    no ``__qualname__``), and nothing is recorded."""
    import types

    module = types.ModuleType("kvevict_fake_module")
    for owner, label in ((_Child, "_Child"), (module, "kvevict_fake_module")):
        with pytest.raises(AttributeError, match=f"^{label} has no attribute 'missing' to wrap$"):
            patching.wrap_method(owner, "missing", lambda orig: orig, "test")
        assert not patching.is_wrapped(owner, "missing")


def test_register_patches_through_the_seam():
    """Every patch ``register()`` makes is recorded by the helper, with its purpose."""
    from vllm_kvevict import plugin

    plugin.register()
    recorded = {(p.cls.__name__, p.name) for p in patching.patches()}
    assert {
        ("CpuPlatform", "get_attn_backend_cls"),
        ("CpuPlatform", "check_and_update_config"),
        ("KVCacheManager", "get_computed_blocks"),
        ("KVCacheManager", "allocate_slots"),
        ("KVCacheManager", "free"),
        ("KVCacheManager", "pop_blocks_for_free"),
        ("InputProcessor", "process_inputs"),
    } <= recorded
    for p in patching.patches():
        assert (
            getattr(p.cls, p.name).__kvevict_purpose__ == p.purpose
            if not isinstance(p.cls.__dict__[p.name], classmethod)
            else p.cls.__dict__[p.name].__func__.__kvevict_purpose__
        )


def test_every_source_file_carries_the_license_identifier():
    """SPDX headers: every Python, shell and CUDA source of the repository names its license."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    sources = [f for f in files if f.endswith((".py", ".sh", ".cu", ".h", ".cpp")) or f == ".ci/run"]
    missing = [
        f
        for f in sources
        if "SPDX-License-Identifier: Apache-2.0" not in "".join((ROOT / f).read_text().splitlines(keepends=True)[:2])
    ]
    assert sources and not missing, missing
