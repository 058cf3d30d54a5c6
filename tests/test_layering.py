"""The house's dependency rules (docs: DESIGN's layout), checked on the source: dependencies
point one way, and no module imports another module's private names."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "jaxrl_agent"

# part -> the parts of the package it must not import (directly or inside functions)
FORBIDDEN = {
    "batch": {"segments", "checks", "estimators", "losses", "models", "sampling", "envs",
              "rollout", "train", "config", "cli", "lab", "sharding"},
    "registry": {"batch", "segments", "checks", "estimators", "losses", "models", "sampling",
                 "envs", "rollout", "train", "config", "cli", "lab", "sharding"},
    "segments": {"checks", "estimators", "losses", "models", "sampling", "envs", "rollout",
                 "train", "config", "cli", "lab"},
    "checks": {"estimators", "losses", "models", "sampling", "envs", "rollout", "train",
               "config", "cli", "lab"},
    "estimators": {"losses", "models", "sampling", "envs", "rollout", "train", "config", "cli",
                   "lab"},
    "losses": {"estimators", "models", "sampling", "envs", "rollout", "train", "config", "cli",
               "lab"},
    "models": {"estimators", "losses", "sampling", "envs", "rollout", "train", "config", "cli"},
    "envs": {"estimators", "losses", "models", "sampling", "rollout", "train", "config", "cli"},
    "rollout": {"estimators", "losses", "train", "config", "cli", "lab"},
    "config": {"train", "cli", "sampling"},
    "train": {"cli"},
}


def _part(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path):
    """(line, imported module, [names]) of every import in the file, nested ones included."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []


def test_dependencies_point_one_way():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        part = _part(path)
        for line, module, names in _imports(path):
            if not module.startswith("jaxrl_agent"):
                continue
            targets = {module.split(".")[1]} if "." in module else set(names)
            for t in targets & FORBIDDEN.get(part, set()):
                bad.append(f"{path.relative_to(PKG.parent)}:{line} ({part}) imports {t}")
    assert not bad, "\n".join(bad)


def test_no_module_imports_private_names_of_another():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        for line, module, names in _imports(path):
            if module.startswith("jaxrl_agent"):
                bad += [f"{path.relative_to(PKG.parent)}:{line} imports {module}.{n}"
                        for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, "\n".join(bad)
