"""The house's dependency rules (docs: DESIGN's layout), checked on the source: dependencies
point one way, and no module imports another module's private names."""

import ast
import re
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


def test_estimator_families_import_only_the_shared_modules():
    """A family file of ``jaxrl_agent/estimators`` imports ``primitives`` (and the package's
    lower layers), never another family file, so each family can be read on its own."""
    shared = {"primitives", "pipeline"}
    folder = PKG / "estimators"
    families = {p.stem for p in folder.glob("*.py")} - shared - {"__init__"}
    bad = []
    for path in sorted(folder.glob("*.py")):
        if path.stem not in families:
            continue
        for line, module, names in _imports(path):
            if module == "jaxrl_agent.estimators":
                hit = set(names) & families
            elif module.startswith("jaxrl_agent.estimators."):
                hit = {module.split(".")[2]} & families
            else:
                continue
            bad += [f"estimators/{path.name}:{line} imports the family {h}" for h in hit]
    assert not bad, "\n".join(bad)
    assert {"outcome", "step_group", "allocation", "shaping", "routing"} <= families


def test_the_estimators_map_names_every_family_and_method():
    """The map at the top of ``estimators/__init__.py`` lists each family file with the names it
    registers (kept true by this test)."""
    import jaxrl_agent.estimators as E
    from jaxrl_agent import registry
    doc = E.__doc__
    for kind in ("estimator", "shaping", "transform"):
        for e in registry.entries(kind):
            if not e.origin.startswith("jaxrl_agent.estimators."):
                continue
            family = e.origin.rsplit(".", 1)[1]
            block = doc.split(f"``{family}``", 1)[1].split("\n``", 1)[0]
            assert e.name in re.findall(r"[a-z0-9_]+", block), (family, e.name)
