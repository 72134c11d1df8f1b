"""The repository stands on its own: no file refers to paths outside it."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_file_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    offenders = []
    for name in files:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".toml", ".txt", ".json", ".cfg", ""} or not path.is_file():
            continue
        text = path.read_text(errors="ignore")
        for needle in ("../" + "shared", "SPEC" + ".md", "shared/" + "spec"):
            if needle in text:
                offenders.append(f"{name}: {needle}")
    assert offenders == []


def _package_imports() -> dict[str, set[str]]:
    """module -> the diloco_eqx modules it imports (at any level of the file)."""
    import ast

    graph = {}
    for path in (ROOT / "diloco_eqx").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("diloco_eqx"):
                deps |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("diloco_eqx")}
        graph[name] = deps
    modules = set(graph)
    return {m: {d for d in deps if d in modules and d != m} for m, deps in graph.items()}


def test_layers_point_down_and_nothing_cycles():
    """The algorithm (diloco_eqx.*) never imports training/ or analysis/; schedule.py
    imports nothing from the package; no module reaches itself through imports (the
    package's __init__ only gathers the public names)."""
    graph = _package_imports()
    core = {m for m in graph if not m.startswith(("diloco_eqx.training", "diloco_eqx.analysis"))}
    for m in core:
        assert not {d for d in graph[m] if d.startswith(("diloco_eqx.training", "diloco_eqx.analysis"))}, m
    assert graph["diloco_eqx.schedule"] == set()
    graph = {m: deps - {"diloco_eqx"} for m, deps in graph.items()}

    def reaches(start, target, seen):
        for d in graph[start]:
            if d == target or (d not in seen and (seen.add(d) or reaches(d, target, seen))):
                return True
        return False

    assert [m for m in graph if reaches(m, m, set())] == []


def test_accelerator_extras_name_extras_the_installed_jax_declares():
    """`pip install -e ".[cuda12]"` etc. resolve: each accelerator extra asks jax for an extra
    jax itself offers (in the installed jax's metadata), and the README gives the line."""
    import re
    import tomllib
    from importlib.metadata import requires

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    offered = {m for r in requires("jax") for m in re.findall(r'extra == "([\w-]+)"', r)}
    accelerators = {name: deps for name, deps in extras.items() if name in ("cuda12", "cuda13", "tpu")}
    assert set(accelerators) == {"cuda12", "cuda13", "tpu"}
    for name, deps in accelerators.items():
        assert deps == [f"jax[{name}]>=0.10,<0.13"] and name in offered
    readme = (ROOT / "README.md").read_text()
    assert 'pip install -e ".[cuda12]"' in readme and 'pip install -e ".[tpu]"' in readme
