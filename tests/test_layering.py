"""Dependencies point one way: cli -> app (and api, the Python API, at app level) -> pipeline -> (policy, model, kernels).

Parsed from the source (every ``import`` / ``from ... import``, module level or inside functions), so a lazy import
that breaks a rule fails too. The rules:
  kernels   import nothing of the project;
  policy    imports model.spec (and itself) only: nothing of pipeline, data, kernels, the CLI or the rest of model;
  model     imports model and kernels only;
  data      imports data, config and model only;
  pipeline  never imports app or the command-line modules;
  app       imports app, pipeline, policy, model, data, config and kernels: never the command-line modules;
  api       (lightning_moe/api.py) is app-level: it imports what app may, and app, never the command-line modules;
  nothing below app (pipeline, policy, model, data, config, kernels) imports app or api; the command-line modules
  (cli, plan_cli, quantize_cli, batch_cli) may import any of it.
"""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lightning_moe")
CLI = {"lightning_moe.cli", "lightning_moe.plan_cli", "lightning_moe.quantize_cli", "lightning_moe.batch_cli"}
BELOW_APP = {"pipeline", "policy", "model", "data", "config", "kernels"}  # top-level parts app may import
APP_LEVEL = {"app", "api"}  # the application layer: the job engine and the Python API over it


def project_imports(type_checking: bool = True) -> list[tuple[str, str]]:
    """(importing module, imported project module) for every import statement under lightning_moe/ (without the ones
    under ``if TYPE_CHECKING:`` when ``type_checking`` is False)."""
    edges = []
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            mod = os.path.relpath(path[:-3], os.path.dirname(ROOT)).replace(os.sep, ".")
            pkg = mod.removesuffix(".__init__") if f == "__init__.py" else mod.rsplit(".", 1)[0]
            mod = mod.removesuffix(".__init__")
            with open(path) as fh:
                tree = ast.parse(fh.read(), path)
            typing_only = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                    typing_only |= {id(n) for n in ast.walk(node)}
            for node in ast.walk(tree):
                if not type_checking and id(node) in typing_only:
                    continue
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                        target = ".".join(base + ([node.module] if node.module else []))
                        names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
                    else:
                        names = [node.module or ""]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                edges += [(mod, n) for n in names if n.startswith("lightning_moe")]
    return edges


def _part(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(edges) -> list[str]:
    bad = []
    for a, b in edges:
        pa, pb = _part(a), _part(b)
        wrong = ((pa == "kernels" and pb != "kernels")
                 or (pa == "policy" and pb != "policy" and b not in ("lightning_moe.model.spec", "lightning_moe.model"))
                 or (pa == "model" and pb not in ("model", "kernels"))
                 or (pa == "data" and pb not in ("data", "config", "model"))
                 or (pa == "pipeline" and b in CLI)
                 or (pa in APP_LEVEL and pb not in BELOW_APP | APP_LEVEL)
                 or (pa in BELOW_APP and pb in APP_LEVEL))
        if wrong:
            bad.append(f"{a} imports {b}")
    return sorted(set(bad))


def test_imports_point_one_way():
    edges = project_imports()
    assert len(edges) > 50  # the parser sees the project's imports
    assert violations(edges) == []


def test_the_rule_check_catches_a_violation():
    """The checker itself: a kernel importing the model, the planner importing the pipeline, the pipeline or the
    config importing the app layer (app or api), the app layer importing the CLI, are caught; the CLI importing app
    or api, and api importing app, are not."""
    assert violations([("lightning_moe.kernels.quant", "lightning_moe.model.mixtral"),
                       ("lightning_moe.policy.hrm", "lightning_moe.pipeline.batching"),
                       ("lightning_moe.policy.hrm", "lightning_moe.model.spec"),
                       ("lightning_moe.pipeline.serial", "lightning_moe.app.engine"),
                       ("lightning_moe.config", "lightning_moe.app"),
                       ("lightning_moe.app.engine", "lightning_moe.cli"),
                       ("lightning_moe.app.engine", "lightning_moe.pipeline.serial"),
                       ("lightning_moe.cli", "lightning_moe.app.engine"),
                       ("lightning_moe.api", "lightning_moe.app.engine"),
                       ("lightning_moe.api", "lightning_moe.cli"),
                       ("lightning_moe.pipeline.serial", "lightning_moe.api"),
                       ("lightning_moe.cli", "lightning_moe.api")]) == [
        "lightning_moe.api imports lightning_moe.cli",
        "lightning_moe.app.engine imports lightning_moe.cli",
        "lightning_moe.config imports lightning_moe.app",
        "lightning_moe.kernels.quant imports lightning_moe.model.mixtral",
        "lightning_moe.pipeline.serial imports lightning_moe.api",
        "lightning_moe.pipeline.serial imports lightning_moe.app.engine",
        "lightning_moe.policy.hrm imports lightning_moe.pipeline.batching"]


def test_no_two_modules_import_each_other():
    """At run time (type annotations aside) no two modules import each other."""
    edges = {(a, b) for a, b in project_imports(type_checking=False) if a != b}
    mutual = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)
    assert mutual == []
