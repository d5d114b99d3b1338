"""Run ``moe-batch`` (lightning_moe.cli) from a given source tree, whatever the current directory.

    python3 benchmarks/run_from_tree.py TREE run JOB.yaml [--no-progress ...]
    python3 benchmarks/run_from_tree.py TREE --where     # prints the lightning_moe package directory it imports

``python3 -m lightning_moe.cli`` puts the current directory first on ``sys.path``, ahead of ``PYTHONPATH``: run from
the repository root it imports the checkout's package whatever ``PYTHONPATH`` names (an A/B of two trees once ran
this commit's tree as "before" that way). Here TREE goes first on ``sys.path`` and the current directory and this
script's directory are dropped, so TREE's ``lightning_moe`` is the one imported (TREE: a directory holding
``lightning_moe/``, e.g. ``.carry/before``).
"""

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2 or not os.path.isdir(os.path.join(sys.argv[1], "lightning_moe")):
        sys.exit("usage: run_from_tree.py TREE (a directory holding lightning_moe/) {--where | moe-batch arguments}")
    tree = os.path.abspath(sys.argv[1])
    here = os.path.dirname(os.path.abspath(__file__))
    drop = {"", os.getcwd(), here}
    sys.path[:] = [tree] + [p for p in sys.path if p not in drop and os.path.abspath(p or ".") not in drop]
    for name in [m for m in sys.modules if m == "lightning_moe" or m.startswith("lightning_moe.")]:
        del sys.modules[name]
    if sys.argv[2:3] == ["--where"]:
        import lightning_moe

        print(os.path.dirname(os.path.abspath(lightning_moe.__file__)))
        return
    sys.argv = [os.path.join(tree, "lightning_moe", "cli.py")] + sys.argv[2:]
    runpy.run_module("lightning_moe.cli", run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()
