"""The dependency rule of dora_jax.envs: it imports only dora_jax.config, dora_jax.user_code,
dora_jax.worker_process, dora_jax.model.tokenizer and itself from the package, and its worker
processes start without jax."""

import ast
import subprocess
import sys
from pathlib import Path

import dora_jax.envs

ALLOWED = (
    "dora_jax.envs",
    "dora_jax.config",
    "dora_jax.model.tokenizer",
    "dora_jax.user_code",
    "dora_jax.worker_process",
)


def test_envs_imports_only_what_the_rule_allows():
    root = Path(dora_jax.envs.__file__).parent
    seen = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] == "dora_jax":
                    seen.setdefault(name, path.name)
    assert seen, "no imports found: the walk is broken"
    bad = {n: f for n, f in seen.items() if not n.startswith(ALLOWED)}
    assert bad == {}


def test_worker_side_modules_import_without_jax():
    code = (
        "import sys, dora_jax.envs, dora_jax.envs.worker, dora_jax.envs.adapters, "
        "dora_jax.envs.builtin.calculator, dora_jax.envs.builtin.guess; "
        "print('jax' in sys.modules)"
    )
    root = Path(dora_jax.envs.__file__).parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
