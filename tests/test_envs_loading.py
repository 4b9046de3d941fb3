"""Environments from a user's file: found and built with keyword arguments, and every broken spec
refused with one line naming the file and the class; junk returns caught by the checks."""

import math
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dora_jax.envs import (
    EnvSpecError,
    InvalidEnvReturn,
    check_reset,
    check_step,
    load_environment,
    resolve_spec,
)

USER_ENVS = textwrap.dedent("""
    class Echo:
        stop_strings = ("</call>",)

        def __init__(self, prefix="echo", turns=2):
            if turns < 1:
                raise ValueError("turns must be >= 1")
            self.prefix, self.turns = prefix, turns

        def reset(self, seed, task):
            self.left = self.turns
            return [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": f"{task['word']}"}], {"seed": seed}

        def step(self, action_text):
            self.left -= 1
            return f"{self.prefix} {action_text}", 1.0, self.left == 0, False, {"left": self.left}

    class NoStep:
        def reset(self, seed, task):
            return "", {}

    class BadStops(Echo):
        stop_strings = ("",)

    not_a_class = 3
""")


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "my_env.py"  # outside the package
    path.write_text(USER_ENVS)
    return path


def test_a_user_class_loads_from_its_file(env_file):
    env = load_environment(f"{env_file}:Echo", {"prefix": "you said", "turns": 1})
    first = check_reset(env.reset(3, {"word": "hi"}))
    assert first.observation[1] == {"role": "user", "content": "hi"}
    assert first.info == {"seed": 3} and first.reward == 0.0
    step = check_step(env.step("ok"))
    assert step.observation == "you said ok" and step.terminated and step.reward == 1.0
    assert resolve_spec("my_pkg.envs:Echo") == "my_pkg.envs:Echo"  # a module, not a file
    assert resolve_spec("tool_arithmetic") == "tool_arithmetic"
    assert resolve_spec("my_env.py:Echo").endswith("/my_env.py:Echo")
    assert resolve_spec("my_env.py:Echo").startswith("/")


@pytest.mark.parametrize(
    "spec, kwargs, pattern",
    [
        ("{dir}/missing.py:Echo", None, r"missing\.py: no such file \(looking for class 'Echo'\)"),
        ("{file}:Nope", None, r"my_env\.py has no class 'Nope'"),
        ("{file}:not_a_class", None, r"my_env\.py:not_a_class is a int, not a class"),
        ("{file}:NoStep", None, r"my_env\.py:NoStep has no step\(\) method"),
        ("{file}:Echo", {"turns": 0}, r"my_env\.py:Echo\(turns=0\) raised ValueError: turns must"),
        ("{file}:Echo", {"colour": 1}, r"my_env\.py:Echo\(colour=1\) raised TypeError"),
        ("{file}:BadStops", None, r"my_env\.py:BadStops: stop_strings must be"),
        ("nonsense", None, r"expected a built-in \(tool_arithmetic, "),
        ("no_such_package_xyz:Env", None, r"cannot import 'no_such_package_xyz'"),
    ],
)
def test_broken_specs_give_one_line_naming_file_and_class(env_file, spec, kwargs, pattern):
    spec = spec.format(dir=env_file.parent, file=env_file)
    with pytest.raises(EnvSpecError, match=pattern) as e:
        load_environment(spec, kwargs)
    assert "\n" not in str(e.value) and str(e.value).startswith("env: ")


def test_a_file_that_fails_to_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import no_such_module_xyz\n")
    with pytest.raises(EnvSpecError, match=r"broken\.py failed to import: ModuleNotFoundError"):
        load_environment(f"{path}:Env")


@pytest.mark.parametrize(
    "value, pattern",
    [
        (("obs", 1.0), r"a 2-item tuple, not \(observation, reward"),
        (None, r"a NoneType"),
        (("obs", math.nan, False, False, {}), "reward nan, not a finite number"),
        (("obs", "1", False, False, {}), "reward '1', not a finite number"),
        (("obs", np.array("1"), False, False, {}), "not a finite number"),
        (("obs", 10**400, False, False, {}), "not a finite number"),
        (("obs", 1.0, "no", False, {}), "terminated='no', not a bool"),
        ((b"obs", 1.0, False, False, {}), "observation is a bytes"),
        (([{"role": "user"}], 1.0, False, False, {}), "observation message 0"),
        (("obs", 1.0, False, False, [1]), "info is a list, not a dict"),
        (("obs", 1.0, False, False, {"x": object()}), "info is not plain JSON data"),
    ],
)
def test_junk_step_returns_are_invalid(value, pattern):
    with pytest.raises(InvalidEnvReturn, match=pattern):
        check_step(value)


def test_accepted_step_returns():
    step = check_step(("o", np.float32(0.5), np.bool_(True), False, None))
    assert (step.reward, step.terminated, step.info) == (0.5, True, {})
    assert check_step(("o", True, False, False, {})).reward == 1.0
    with pytest.raises(InvalidEnvReturn, match=r"reset returned a 5-item tuple"):
        check_reset(("o", 0.0, False, False, {}))


def test_the_worked_example_of_docs_agentic_runs(tmp_path, monkeypatch):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "agentic.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    env_code, driver = blocks[0], blocks[1]
    assert env_code.startswith("# my_env.py") and "EnvPool(" in driver
    (tmp_path / "my_env.py").write_text(env_code)
    monkeypatch.chdir(tmp_path)
    exec(compile(driver, "docs/agentic.md", "exec"), {"print": lambda *a: None})
    with pytest.raises(EnvSpecError, match=r"my_env\.py has no class 'Countdwn'"):
        load_environment("my_env.py:Countdwn")
    with pytest.raises(EnvSpecError) as e:
        load_environment("my_env.py:Countdown", {"strat": 5})
    assert str(e.value).endswith(
        "my_env.py:Countdown(strat=5) raised TypeError: Countdown.__init__() got an unexpected "
        "keyword argument 'strat'"
    )
    assert str(e.value).split("my_env.py")[1] in doc
