"""A user's environment without an edit to fleetrl: by import path (`module:Attr`, from the
current directory), by a name an installed package registers (the `fleetrl.environments` entry
points), and checked against the contract, each failure one line naming the spec and the key."""

import importlib
import re
import sys
import textwrap
import tomllib

import pytest

from fleetrl.cli import main
from fleetrl.envs import EnvError, Rollout, get_environment
from fleetrl.envs.arithmetic import Arithmetic
from fleetrl.versions import VersionSpan

from tests.documented import ROOT

TASKS = '''
import itertools

from fleetrl.envs.base import Task
from fleetrl.envs.tools import Tool


class Shout:
    name = "shout"

    def __init__(self, words=("sea",)):
        if not words:
            raise ValueError("words must name at least one word")
        self.words = list(words)

    def tasks(self, seed):
        for i in itertools.count():
            word = self.words[i % len(self.words)]
            yield Task(id=f"{seed}-{i}", messages=[{"role": "user", "content": word}], answer=word.upper())

    def reward(self, rollout):
        return 1.0


def make_shout(loud: bool):
    """A factory: any callable that returns an environment."""
    return Shout(["SEA"] if loud else ["sea"])


def needs_a_gpu():
    raise RuntimeError("no GPU here\\nsecond line")


NOT_A_FACTORY = 3


class Nameless(Shout):
    name = None


class NoReward:
    name = "no_reward"

    def tasks(self, seed):
        return iter(())


class RespondIsData(Shout):
    respond = "yes"


class ToolsWithoutRespond(Shout):
    tools = [Tool(name="t", fn=str, description="d")]


class ToolIsAFunction(Shout):
    tools = [str]

    def respond(self, task, messages, state):
        return None
'''


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """tmp_path as the current directory, holding the package `my_pkg` (my_pkg/tasks.py:
    TASKS); sys.path and the modules imported from here are restored afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    write(tmp_path / "my_pkg" / "__init__.py", "")
    write(tmp_path / "my_pkg" / "tasks.py", TASKS)
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    importlib.invalidate_caches()  # the import system's directory listings are cached


def test_a_class_in_the_current_directory_imports_uninstalled_with_its_options(workdir):
    assert str(workdir) not in sys.path
    env = get_environment("my_pkg.tasks:Shout", words=["moon"])
    assert type(env).__module__ == "my_pkg.tasks" and env.name == "shout"
    assert next(env.tasks(0)).answer == "MOON"
    assert sys.path[-1] == str(workdir)  # after the installed packages: it shadows none


def test_a_factory_is_called_with_the_options(workdir):
    assert next(get_environment("my_pkg.tasks:make_shout", loud=True).tasks(0)).messages[0]["content"] == "SEA"


@pytest.mark.parametrize("spec, options, error", [
    ("my_pkg.tasks:Shout", {"wordz": ["x"]}, r"unknown option 'wordz' \(accepted: words\)"),
    ("my_pkg.tasks:make_shout", {}, r"missing option 'loud'"),
    ("my_pkg.tasks:Shout", {"words": []}, r"words must name at least one word"),
    ("my_pkg.tasks:needs_a_gpu", {}, r"needs_a_gpu\(\.\.\.\) raised RuntimeError: no GPU here"),
    ("my_pkg.tasks:Shoot", {}, r"module 'my_pkg.tasks' \(.*/my_pkg/tasks.py\) has no attribute 'Shoot'"),
    ("my_pkg.tasks:NOT_A_FACTORY", {}, r"my_pkg.tasks:NOT_A_FACTORY is a int, not a class or a factory"),
    ("my_pkg.tasks:", {}, r"expected module.path:Attr"),
    ("my_pkg.tasks:Nameless", {}, r"the environment has no name \(a non-empty string attribute `name`\)"),
    ("my_pkg.tasks:NoReward", {}, r"the environment has no reward\(\) method"),
    ("my_pkg.tasks:RespondIsData", {}, r"its respond is a str, not a method"),
    ("my_pkg.tasks:ToolsWithoutRespond", {},
     r"it lends tools but has no respond\(\) method, which a multi-turn environment needs"),
    ("my_pkg.tasks:ToolIsAFunction", {}, r"tools\[0\] is a type, not a fleetrl.envs.tools.Tool"),
])
def test_what_the_import_path_names_fails_in_one_line_naming_the_spec(workdir, spec, options, error):
    with pytest.raises(EnvError, match=f"^env {spec}: {error}$"):
        get_environment(spec, **options)


def test_a_module_that_cannot_be_imported_says_why(workdir):
    with pytest.raises(EnvError, match=r"^env no_pkg.tasks:Shout: cannot import module 'no_pkg.tasks' "
                                       r"\(ModuleNotFoundError: No module named 'no_pkg'; looked in the installed "
                                       f"packages and {workdir}\\)$"):
        get_environment("no_pkg.tasks:Shout")
    write(workdir / "my_pkg" / "broken.py", "import not_installed_dependency\n")
    with pytest.raises(EnvError, match=r"^env my_pkg.broken:Env: importing module 'my_pkg.broken' raised "
                                       r"ModuleNotFoundError: No module named 'not_installed_dependency'$"):
        get_environment("my_pkg.broken:Env")
    write(workdir / "my_pkg" / "crashing.py", "1 / 0\n")
    with pytest.raises(EnvError, match=r"^env my_pkg.crashing:Env: importing module 'my_pkg.crashing' raised "
                                       r"ZeroDivisionError: division by zero$"):
        get_environment("my_pkg.crashing:Env")


def install(site, dist, entry_points):
    """A package as pip leaves it in site-packages: `<dist>-0.1.dist-info/` (METADATA,
    entry_points.txt) beside its module; importlib.metadata finds it on sys.path."""
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    write(info / "METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    write(info / "entry_points.txt", "[fleetrl.environments]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site-packages folder on sys.path, with my_pkg/tasks.py (TASKS) in it."""
    site = tmp_path / "site-packages"
    write(site / "my_pkg" / "__init__.py", "")
    write(site / "my_pkg" / "tasks.py", TASKS)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(site)):
            del sys.modules[name]


def test_an_installed_package_registers_names_and_a_built_in_name_wins(site):
    install(site, "my-envs", {"shout": "my_pkg.tasks:Shout", "arithmetic": "my_pkg.tasks:Shout",
                              "broken": "my_pkg.missing:Env", "nameless": "my_pkg.tasks:Nameless"})
    env = get_environment("shout", words=["sky"])
    assert type(env).__module__ == "my_pkg.tasks" and next(env.tasks(0)).answer == "SKY"
    assert isinstance(get_environment("arithmetic"), Arithmetic)
    with pytest.raises(EnvError, match=r"^env broken \(my_pkg.missing:Env, from my-envs\): cannot import module "
                                       r"'my_pkg.missing' \(ModuleNotFoundError: No module named 'my_pkg.missing';"):
        get_environment("broken")
    with pytest.raises(EnvError, match=r"^env nameless \(my_pkg.tasks:Nameless, from my-envs\): the environment "
                                       r"has no name"):
        get_environment("nameless")
    with pytest.raises(EnvError, match=r"^unknown environment 'shoutt' \(built-in: reverse_text, arithmetic, "
                                       r"arithmetic_retry, calculator.*; registered: arithmetic, broken, nameless, "
                                       r"shout.*; or module.path:Attr, verifiers:<taskset id>.*\)$"):
        get_environment("shoutt")


def test_two_packages_registering_one_name_are_named_both(site):
    install(site, "envs-a", {"shout": "my_pkg.tasks:Shout"})
    install(site, "envs-b", {"shout": "my_pkg.tasks:make_shout"})
    with pytest.raises(EnvError, match=r"^env shout: registered by two installed packages, envs-[ab] \(.*\) and "
                                       r"envs-[ab] \(.*\): uninstall one, or name the environment by its import "
                                       r"path$") as raised:
        get_environment("shout")
    assert "envs-a (my_pkg.tasks:Shout)" in str(raised.value) and "envs-b (my_pkg.tasks:make_shout)" in str(raised.value)


@pytest.mark.parametrize("config, key", [
    ('[orchestrator]\nenv = "my_pkg.tasks:NoReward"\n', "orchestrator.env"),
    ('[[orchestrator.envs]]\nname = "arithmetic"\n[[orchestrator.envs]]\nname = "quiet"\n'
     'env = "my_pkg.tasks:NoReward"\n', "orchestrator.envs[1]"),
    ('[eval]\nevery_steps = 2\n[[eval.envs]]\nname = "quiet"\nenv = "my_pkg.tasks:NoReward"\n', "eval.envs[0]"),
    # Named with evaluation off (every_steps = 0, the default): still checked.
    ('[[eval.envs]]\nname = "quiet"\nenv = "my_pkg.tasks:NoReward"\n', "eval.envs[0]"),
])
def test_the_dry_run_refuses_a_broken_environment_naming_the_key_before_the_run_dir(workdir, capsys, config, key):
    (workdir / "rl.toml").write_text(config + '[run]\ndir = "run"\n')
    assert main(["rl", "@", "rl.toml", "--dry-run"]) == 1
    assert capsys.readouterr().err == (f"fleetrl: error: {key}: env my_pkg.tasks:NoReward: the environment has no "
                                       "reward() method\n")
    assert not (workdir / "run").exists()


def test_the_dry_run_takes_a_working_environment_by_import_path(workdir, capsys):
    assert main(["rl", "--orchestrator.env", "my_pkg.tasks:Shout", "--orchestrator.env_options", '{words = ["a"]}',
                 "--run.dir", "run", "--dry-run"]) == 0
    assert 'env = "my_pkg.tasks:Shout"' in capsys.readouterr().out
    assert not (workdir / "run").exists()


EXAMPLES = ROOT / "examples" / "my_envs"


@pytest.fixture
def at_the_root(monkeypatch):
    """The repository root as the current directory, where the page's commands run."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))


def test_the_pages_code_is_the_examples_files():
    blocks = re.findall(r"```python\n# (examples/\S+)\n(.*?)```", (ROOT / "docs" / "environments.md").read_text(),
                        re.DOTALL)
    assert sorted(path for path, _ in blocks) == ["examples/my_envs/guess.py", "examples/my_envs/shout.py",
                                                 "examples/my_envs/weather.py"]
    for path, code in blocks:
        assert code in (ROOT / path).read_text(), path


def test_the_examples_registered_names_are_their_import_paths(at_the_root):
    registered = tomllib.loads((EXAMPLES / "pyproject.toml").read_text())["project"]["entry-points"]
    for name, target in registered["fleetrl.environments"].items():
        assert get_environment(f"examples.{target}").name == name


def test_the_examples_score_what_they_ask(at_the_root):
    shout = get_environment("examples.my_envs.shout:Shout", words=["moon"])
    task = next(shout.tasks(3))
    assert task.messages[0]["content"] == "Say moon in capitals." and shout.reward(rollout(task, "MOON!")) == 1.0
    guess = get_environment("examples.my_envs.guess:Guess", high=20)
    task = next(guess.tasks(0))
    wrong = 1 if task.answer > 1 else 2
    messages = [*task.messages, {"role": "assistant", "content": str(wrong)}]
    assert guess.respond(task, messages, {}) == [{"role": "user", "content": "No: higher." if wrong < task.answer
                                                   else "No: lower."}]
    messages += [{"role": "user", "content": "No."}, {"role": "assistant", "content": f"It is {task.answer}"}]
    assert guess.respond(task, messages, {}) is None
    assert guess.reward(rollout(task, messages[-1]["content"], messages)) == 0.5
    with pytest.raises(EnvError, match=r"^env examples.my_envs.guess:Guess: high must be at least 1, got 0$"):
        get_environment("examples.my_envs.guess:Guess", high=0)
    weather = get_environment("examples.my_envs.weather:Weather")
    task = next(weather.tasks(0))
    (tool,) = weather.tools
    assert tool.fn(city=task.messages[-1]["content"].split(" in ")[1].removesuffix(" today?")) == task.answer
    assert tool.fn(city="Atlantis") == "error: no weather for 'Atlantis'"
    assert weather.reward(rollout(task, f"{task.answer.title()}.")) == 1.0 and weather.reward(rollout(task, "?")) == 0


def rollout(task, completion, messages=()):
    return Rollout(task=task, completion=completion, spans=[VersionSpan(0, 0)], step=1, messages=list(messages))
