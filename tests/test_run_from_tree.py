"""benchmarks/run_from_tree.py runs the CLI of the tree it names, even from the repository root (where ``python3 -m
lightning_moe.cli`` imports the checkout's package whatever PYTHONPATH says: an A/B of two trees once ran
this commit's tree as "before" that way)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "run_from_tree.py")


def _fake_tree(root) -> str:
    """A tree whose lightning_moe.cli prints where it was imported from and its arguments."""
    pkg = root / "lightning_moe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("import sys\nimport lightning_moe\n"
                                "print('FROM', lightning_moe.__file__)\nprint('ARGS', sys.argv[1:])\n")
    return str(root)


def _env(pythonpath: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = pythonpath
    return env


def test_old_invocation_imports_the_checkout(tmp_path):
    """The A/B's old invocation from the repository root: the checkout's package, not the tree on PYTHONPATH."""
    tree = _fake_tree(tmp_path)
    out = subprocess.run([sys.executable, "-c", "import lightning_moe; print(lightning_moe.__file__)"], cwd=REPO,
                         env=_env(tree), capture_output=True, text=True, check=True).stdout
    assert os.path.dirname(out.strip()) == os.path.join(REPO, "lightning_moe")


def test_runs_the_named_tree_from_the_repo_root(tmp_path):
    tree = _fake_tree(tmp_path)
    env = _env(REPO + os.pathsep + tree)  # the checkout even ahead of the tree on PYTHONPATH
    where = subprocess.run([sys.executable, SCRIPT, tree, "--where"], cwd=REPO, env=env, capture_output=True,
                           text=True, check=True).stdout.strip()
    assert where == os.path.join(tree, "lightning_moe")
    out = subprocess.run([sys.executable, SCRIPT, tree, "run", "job.yaml", "--no-progress"], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "FROM " + os.path.join(tree, "lightning_moe", "__init__.py")
    assert out[1] == "ARGS ['run', 'job.yaml', '--no-progress']"


def test_the_checkout_itself(tmp_path):
    """The repository root as the tree (the A/B's "now"): its own package and its real CLI."""
    where = subprocess.run([sys.executable, SCRIPT, REPO, "--where"], cwd=str(tmp_path), env=_env(""),
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where == os.path.join(REPO, "lightning_moe")
    r = subprocess.run([sys.executable, SCRIPT, REPO, "--help"], cwd=REPO, env=_env(""), capture_output=True, text=True)
    assert r.returncode == 0 and "run" in r.stdout

