"""The package's layers (docs/architecture.md): imports run downward only, stages never import each
other, and the attribution layer stays numpy-only (no jax in a fresh interpreter)."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PKG = pathlib.Path(__file__).resolve().parents[1] / "behaviortrace_jax"
# A module may import its own layer folder or a layer of lower rank; equal ranks of different
# folders do not import each other. Top-level modules (pipeline, runtime, ...) sit above all layers.
RANK = {"io": 0, "models": 1, "attribution": 1, "behavior": 2, "sketch": 3, "train": 4, "stages": 5}
TOP = 6
ATTRIBUTION_MAY_IMPORT = {"behaviortrace_jax.io.files", "behaviortrace_jax.io.layout"}


def layer(module: str) -> str | None:
    """``"io"`` for ``behaviortrace_jax.io.files``; None for a top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else None


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(base: str, names: list[str]) -> list[str]:
    """The modules an ``from base import names`` loads: a submodule where ``base.name`` is one."""
    out = []
    for n in names:
        sub = PKG.parent.joinpath(*f"{base}.{n}".split("."))
        out.append(f"{base}.{n}" if sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file() else base)
    return out


def package_imports() -> list[tuple[str, str, int]]:
    """(importer, imported module, line) for every import of the package, function-level ones too."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        src = module_name(path)
        pkg = src if path.name == "__init__.py" else src.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = resolve(base, [a.name for a in node.names]) if base.startswith("behaviortrace_jax") else [base]
            else:
                continue
            found += [(src, t, node.lineno) for t in targets if t.startswith("behaviortrace_jax.")]
    return found


def violations() -> list[str]:
    bad = []
    for src, dst, line in package_imports():
        ls, ld = layer(src), layer(dst)
        where = f"{src}:{line} imports {dst}"
        if ls == ld and ls is not None:
            if ls == "stages" and src not in ("behaviortrace_jax.stages",) and dst not in (
                    "behaviortrace_jax.stages", "behaviortrace_jax.stages.registry"):
                bad.append(f"{where} (a stage imports another stage; use registry.STAGES)")
            continue
        rs, rd = (RANK[ls] if ls else TOP), (RANK[ld] if ld else TOP)
        if rd >= rs:
            bad.append(f"{where} (layer {ls or 'top'} may not import layer {ld or 'top'})")
        if ls == "attribution" and dst not in ATTRIBUTION_MAY_IMPORT:
            bad.append(f"{where} (attribution is numpy-only: it imports only {sorted(ATTRIBUTION_MAY_IMPORT)})")
    return bad


def test_imports_run_downward_and_stages_do_not_import_each_other():
    found = package_imports()
    assert len(found) > 50 and any(layer(s) == "stages" for s, _, _ in found)  # the walk sees the package
    assert violations() == []


def test_the_checker_catches_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "behaviortrace_jax"
    for d in ("io", "models", "stages"):
        (fake / d).mkdir(parents=True)
        (fake / d / "__init__.py").write_text("")
    (fake / "io" / "files.py").write_text("def f():\n    from behaviortrace_jax.models import qwen2\n")
    (fake / "models" / "qwen2.py").write_text("")
    (fake / "stages" / "a.py").write_text("from behaviortrace_jax.stages import b, registry\n")
    (fake / "stages" / "b.py").write_text("")
    (fake / "stages" / "registry.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    bad = violations()
    assert any("io.files:2 imports behaviortrace_jax.models.qwen2" in b for b in bad), bad
    assert any("stages.a:1 imports behaviortrace_jax.stages.b" in b for b in bad), bad
    assert len(bad) == 2, bad


def test_attribution_never_imports_jax():
    mods = sorted(module_name(p) for p in (PKG / "attribution").glob("*.py"))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods)
            + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'orbax'))\n"
              "assert not bad, bad\nprint(len(sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=PKG.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "behaviortrace_jax.attribution.estimators" in mods and "behaviortrace_jax.attribution.release" in mods
