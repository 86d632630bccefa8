"""The package layering of docs/ARCHITECTURE.md, checked on every import statement of churon's source
(inside functions and TYPE_CHECKING blocks too): a lower layer never imports a higher one."""

from __future__ import annotations

import ast
from pathlib import Path

import churon

PACKAGE_DIR = Path(churon.__file__).parent

# (the modules a rule is about, the churon modules they may not import, why)
RULES = [
    ("churon.kernels", lambda m: not _within(m, "churon.kernels", "churon._cpu"),
     "the kernels are a leaf: they import nothing else of churon"),
    ("churon.formats", lambda m: not _within(m, "churon.formats", "churon.config", "churon.errors"),
     "formats read and write model files: they import neither the tokenizer nor anything above it"),
    ("churon.model", lambda m: _within(m, "churon.engine", "churon.server", "churon.llm", "churon.loader", "churon.cli"),
     "the model knows nothing of the engine or the server"),
    ("churon", lambda m: _within(m, "churon.server"),
     "nothing below the server imports it"),
]
# the modules the last rule does not cover: the server itself and the command line above it
ABOVE_SERVER = ("churon.server", "churon.cli")


def _within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the source, relative imports resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from churon import kernels` imports churon.kernels: name the submodule where it is one
            found += [(node.lineno, f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base)
                      for alias in node.names]
    return found


# compiled by setup.py, so absent from a checkout that was not built
EXTENSION_MODULES = {"churon._cpu"}


def _is_module(name: str) -> bool:
    if not name.startswith("churon."):
        return False
    if name in EXTENSION_MODULES:
        return True
    path = PACKAGE_DIR.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def violations(path: Path, source: str) -> list[str]:
    module = module_name(path)
    out = []
    for line, imported in imported_modules(source, module, path.name == "__init__.py"):
        if not imported.startswith("churon"):
            continue
        for scope, forbidden, why in RULES:
            if not _within(module, scope) or (scope == "churon" and _within(module, *ABOVE_SERVER)):
                continue
            if forbidden(imported):
                out.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{line} imports {imported}: {why}")
    return out


def test_no_module_imports_across_its_layer():
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(files) > 40  # the walk found the package
    problems = [v for f in files for v in violations(f, f.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


def test_an_offending_import_is_named_with_its_file_and_line():
    formats = PACKAGE_DIR / "formats" / "gguf.py"
    found = violations(formats, "import os\n\ndef f():\n    from churon.tokenizer import Tokenizer\n")
    assert found == ["churon/formats/gguf.py:4 imports churon.tokenizer: formats read and write model files:"
                     " they import neither the tokenizer nor anything above it"]
    kernels = PACKAGE_DIR / "kernels" / "ops.py"
    assert violations(kernels, "from ..model import backend\n") == [
        "churon/kernels/ops.py:1 imports churon.model.backend: the kernels are a leaf: they import nothing else of churon"]
    assert violations(kernels, "from churon import _cpu\nfrom churon.kernels import ground_truth\n") == []
    model = PACKAGE_DIR / "model" / "transformer.py"
    assert violations(model, "if TYPE_CHECKING:\n    from churon.engine.kv_cache import PagedKVCache\n") == [
        "churon/model/transformer.py:2 imports churon.engine.kv_cache: the model knows nothing of the engine or the server"]
    engine = PACKAGE_DIR / "engine" / "core.py"
    assert violations(engine, "from churon import server\n") == [
        "churon/engine/core.py:1 imports churon.server: nothing below the server imports it"]
    assert violations(PACKAGE_DIR / "cli.py", "from churon.server import create_app\n") == []
