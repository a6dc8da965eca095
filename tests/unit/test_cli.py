import dataclasses
import os
import subprocess
import sys

import pytest

from fleetrl.app.providers import PROVIDERS
from fleetrl.cli import main
from fleetrl.provider_capabilities import PROVIDER_CAPABILITIES
from fleetrl.contract import ADMIN_TOKEN_ENV, DATA_TOKEN_ENV
from fleetrl.rundir import RunDir, verify_run

from tests.documented import ROOT

from .fake_fleet import FakeProvider
from .test_rundir import make_run


@pytest.fixture(autouse=True)
def no_tokens_in_the_environment(monkeypatch):
    """The token variables of whoever runs the tests must not leak into them."""
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    monkeypatch.delenv(DATA_TOKEN_ENV, raising=False)


def test_every_provider_the_config_takes_has_one_registry_entry():
    """The config's choice of provider and its checks read provider_capabilities.py; the registry
    builds each, with the same record (issue 38, item 3)."""
    assert list(PROVIDERS) == list(PROVIDER_CAPABILITIES)
    assert all(entry.capabilities is PROVIDER_CAPABILITIES[name] for name, entry in PROVIDERS.items())


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "fleetrl", *args], capture_output=True, text=True, timeout=120)


def test_dry_run_prints_resolved_config(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[inference]\nworkers = 2\n")
    assert main(["rl", "@", str(cfg), "--run.max_steps", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "workers = 2" in out and "max_steps = 4" in out


def test_the_shipped_configs_merge_into_valid_runs(capsys):
    """configs/calculator.toml on top of configs/default.toml, as the README runs it."""
    assert main(["rl", "@", str(ROOT / "configs/default.toml"), "@", str(ROOT / "configs/calculator.toml"),
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert 'env = "calculator"' in out and "max_turns = 3" in out and "batch_prompts = 8" in out


def test_at_file_without_space(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[trainer]\nworld_size = 2\n")
    assert main(["inference", f"@{cfg}", "--dry-run"]) == 0
    assert "world_size = 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["rl", "--inference.wokers", "2"], "unknown config key 'inference.wokers' (from --inference.wokers)"),
        (["rl", "--inference.workers=many"], "config key 'inference.workers'"),
        (["rl", "@", "/nonexistent.toml"], "config file not found: /nonexistent.toml"),
        (["inference", "--model.path", "/nonexistent-model"], "model.path: /nonexistent-model does not exist"),
        (["status"], "fleetrl status needs a run directory (fleetrl status RUN_DIR) or inference.urls"),
        (["status", "--inference.urls", '["http://127.0.0.1:9"]'],
         "fleetrl status needs inference.admin_token or $FLEETRL_ADMIN_TOKEN"),
        (["status", "--inference.provider", "dynamo"],
         "fleetrl status needs a run directory (fleetrl status RUN_DIR) or inference.dynamo.frontend_url"),
        (["status", "--inference.provider", "dynamo", "--inference.dynamo.frontend_url", "http://h:8000",
          "--inference.dynamo.rl_url", "http://h:8001", "--inference.admin_token", "t"],
         "inference.admin_token set with inference.provider = 'dynamo', whose frontend and own worker kind take no token"),
        (["status", "/nonexistent-run"], "RUN_DIR /nonexistent-run does not exist"),
        (["rl", "--inference.provider", "dynamo", "--inference.dynamo.frontend_url", "http://h:8000"],
         "inference.dynamo.frontend_url and inference.dynamo.rl_url: set both"),
        (["rl", "--orchestrator.temperature", "0.7"], "fleetrl rl samples at orchestrator.temperature = 1"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(args, message, capsys):
    assert main(args) == 1
    # (A token given as a flag is warned about on a line of its own: not the error's.)
    err = "\n".join(line for line in capsys.readouterr().err.strip().splitlines()
                    if not line.startswith("fleetrl: warning: --inference.admin_token on the command line"))
    assert err == f"fleetrl: error: {message}" or (err.startswith("fleetrl: error: ") and message in err)
    assert "\n" not in err and "Traceback" not in err


def test_debug_shows_the_traceback():
    result = run_cli("rl", "--inference.workers", "x", "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_model_path_without_config_json(tmp_path, capsys):
    assert main(["inference", "--model.path", str(tmp_path)]) == 1
    assert "is not a Hugging Face model folder" in capsys.readouterr().err


def test_unreachable_server_is_reported_per_url(capsys):
    assert main(["status", "--inference.urls", '["http://127.0.0.1:9"]', "--inference.admin_token", "t"]) == 1
    assert capsys.readouterr().out.splitlines()[1].split()[:3] == ["http://127.0.0.1:9", "aggregated", "dead"]


def test_status_takes_the_admin_token_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "t")
    assert main(["status", "--inference.urls", '["http://127.0.0.1:9"]']) == 1
    assert capsys.readouterr().out.splitlines()[1].split()[:3] == ["http://127.0.0.1:9", "aggregated", "dead"]


def test_status_of_a_run_directory_attaches_to_the_fleet_it_recorded(tmp_path, monkeypatch, capsys):
    run_dir = RunDir(tmp_path)
    run_dir.record_fleet({"provider": "vllm", "urls": ["http://10.0.0.1:8000"]},
                         {"admin_token": "the-admin-token", "data_token": "the-data-token"})
    built = {}

    def build(config, run_dir, model_dir, tokens, runs, adapter):
        built.update(urls=config.inference.urls, tokens=tokens, runs=runs, adapter=adapter)
        return FakeProvider("a")

    monkeypatch.setitem(PROVIDERS, "vllm", dataclasses.replace(PROVIDERS["vllm"], build=build))
    assert main(["status", str(tmp_path)]) == 0
    head, _, row = capsys.readouterr().out.splitlines()
    assert head == f"run {tmp_path}: no step done yet (of ?)"
    assert row.split() == ["a", "aggregated", "stale", "-", "base", "?", "never"]  # no version: stale
    assert built["urls"] == ["http://10.0.0.1:8000"] and built["tokens"].admin == "the-admin-token"
    assert built["runs"] is False  # status only looks: it labels nothing and holds no worker
    assert built["adapter"] is None  # nor serves through an adapter


def test_status_reads_each_discovered_worker_through_the_provider(monkeypatch, capsys):
    provider = FakeProvider("a", "b", "c")
    provider.engines["a"].version = 2
    provider.engines["b"].paused = True
    provider.engines["c"].fail = {"version"}
    monkeypatch.setitem(PROVIDERS, "dynamo", dataclasses.replace(PROVIDERS["dynamo"], build=lambda *_: provider,
                                                                 missing_to_attach=lambda _: None))
    assert main(["status", "--inference.provider", "dynamo"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:4] for line in lines[1:4]] == [
        ["a", "aggregated", "ready", "v2"], ["b", "aggregated", "paused", "-"], ["c", "aggregated", "error", "-"]]
    assert lines[4:] == ["c: worker c: version failed: injected"]


def test_attach_to_unreachable_url_fails_clearly(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"vocab_size": 8}')  # read as the provider is built (answers.vocab_size)
    assert main(["inference", "--model.path", str(tmp_path), "--inference.urls", '["http://127.0.0.1:9"]']) == 1
    err = capsys.readouterr().err.strip()
    assert err == "fleetrl: error: inference.urls: cannot reach http://127.0.0.1:9 (no answer on /health)"


@pytest.mark.parametrize("command", ["rl", "inference", "status", "verify", "plot", "export", "eval", "model",
                                     "bench"])
def test_help_works_for_every_command(command):
    result = run_cli(command, "--help")
    assert result.returncode == 0
    assert "--inference.workers" in result.stdout and "--orchestrator.max_off_policy_steps" in result.stdout


def test_model_prints_the_policys_folder_alone(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["model", "--model.path", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{tmp_path}\n"  # what `$(fleetrl model)` reads
    assert main(["model", "--model.path", str(tmp_path / "nope")]) == 1
    assert "model.path" in capsys.readouterr().err


def test_bench_names_the_suites_it_knows():
    result = run_cli("bench", "--suite", "bogus")
    assert result.returncode == 1 and result.stderr.count("\n") == 1  # one line, as every refusal
    assert "invalid choice: 'bogus'" in result.stderr and "fleet" in result.stderr and "fleetrl bench --help" in result.stderr


@pytest.mark.parametrize(
    "args, field, expected",
    [
        # A value that begins with "-", as `secrets.token_urlsafe` draws about 1 time in 64.
        (["--inference.admin_token", "-abc"], "inference.admin_token", "-abc"),
        (["--inference.admin_token", "--abc"], "inference.admin_token", "--abc"),
        # Digits only: a token, not a number.
        (["--inference.admin_token", "123456"], "inference.admin_token", "123456"),
        (["--inference.data_token", "0123"], "inference.data_token", "0123"),
        (["--inference.admin_token=-abc"], "inference.admin_token", "-abc"),
        (["--orchestrator.env_options", "{x = -1}"], "orchestrator.env_options", {"x": -1}),
        (["--run.seed", "-3"], "run.seed", -3),
        (["--run.seed=-3"], "run.seed", -3),
        (["--inference.admin_token", "@abc"], "inference.admin_token", "@abc"),
    ],
)
def test_a_dotted_flag_takes_its_next_argument_whatever_it_begins_with(args, field, expected, monkeypatch):
    parsed = {}
    monkeypatch.setattr("fleetrl.cli.run_command", lambda args, config: parsed.update(config=config) or 0)
    assert main(["status", *args]) == 0
    section, key = field.split(".")
    assert getattr(getattr(parsed["config"], section), key) == expected


def test_dry_run_prints_no_token(capsys):
    assert main(["rl", "--dry-run", "--inference.admin_token", "admin-XYZ", "--inference.data_token", "data-XYZ"]) == 0
    out, err = capsys.readouterr()
    assert "[inference]" in out
    assert "XYZ" not in out + err


def test_a_negative_number_is_refused_by_the_field_not_the_parser(capsys):
    assert main(["rl", "--inference.workers", "-1", "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "config key 'inference.workers'" in err and "(from --inference.workers)" in err


@pytest.mark.parametrize("argv, said", [
    (["rl", "--inference.wokers"], "--inference.wokers needs a value (--inference.wokers VALUE or "
                                   "--inference.wokers=VALUE)"),
    # The next flag is no value: taken as one, a dry run would have started a run in a folder
    # named --dry-run.
    (["rl", "--run.dir", "--dry-run"], "--run.dir needs a value (--run.dir VALUE or --run.dir=VALUE), not the "
                                       "flag --dry-run"),
])
def test_a_dotted_flag_without_a_value_is_refused_in_one_line(capsys, argv, said):
    assert main(argv) == 1
    assert capsys.readouterr().err == f"fleetrl: error: {said}\n"


@pytest.mark.parametrize("flags, field", [
    (["--orchestrator.env", "bogus"], "orchestrator.env: unknown environment 'bogus'"),
    (["--orchestrator.env_options", "{bogus = 1}"], "orchestrator.env: env reverse_text: unknown option 'bogus'"),
    (["--orchestrator.group_size", "1"], "orchestrator.group_size"),
    (["--trainer.lr", "nan"], "trainer.lr"),
])
@pytest.mark.parametrize("dry_run", [False, True])
def test_a_refused_command_leaves_a_finished_run_as_it_was(tmp_path, capsys, monkeypatch, flags, field, dry_run):
    """Checked before the run directory is touched: the finished run still verifies, and
    nothing in it is new, not even a lock file; no checkpoint was read. (A run refused for its
    orchestrator.env took the directory's lock and read its checkpoints first, and left `.lock`
    behind: issue 36, item 8.)"""
    from fleetrl.app import rl

    run = make_run(tmp_path)
    read = []
    monkeypatch.setattr(rl.checkpoint, "latest", lambda *args, **kwargs: read.append(args))

    def files() -> dict:
        return {p: p.read_bytes() if p.is_file() else "folder" for p in run.rglob("*")}

    before = files()
    assert main(["rl", "--run.dir", str(run), *flags, *(["--dry-run"] if dry_run else [])]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fleetrl: error: ") and field in err and err.count("\n") == 1
    assert files() == before and read == []
    verify_run(run)


def test_a_refused_run_creates_no_run_directory(tmp_path, capsys):
    assert main(["rl", "--run.dir", str(tmp_path / "new" / "run"), "--orchestrator.env", "bogus"]) == 1
    assert "orchestrator.env: unknown environment 'bogus'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_max_tokens_and_the_longest_prompt_must_fit_the_engine():
    from fleetrl.app.checks import check_prompts_fit
    from fleetrl.config import ConfigError, load_config
    from fleetrl.envs import get_environment
    from fleetrl.envs.mix import RunEnv

    class CharTokenizer:  # one token per character of the messages
        def apply_chat_template(self, messages, **_):
            return [0] * sum(len(m["content"]) for m in messages)

    env = [RunEnv("reverse_text", get_environment("reverse_text"))]
    fits = load_config([], [("orchestrator.max_tokens", "16"), ("inference.vllm.max_model_len", "1024")])
    check_prompts_fit(fits, env, CharTokenizer())
    tight = load_config([], [("orchestrator.max_tokens", "16"), ("inference.vllm.max_model_len", "40")])
    with pytest.raises(ConfigError, match=r"^orchestrator.max_tokens = 16 \+ the longest prompt of the run "
                                          r"\(\d+ tokens, task \S+\) > inference.vllm.max_model_len = 40$"):
        check_prompts_fit(tight, env, CharTokenizer())


def test_a_token_given_as_a_flag_is_warned_about(capsys):
    """A flag is readable by every local user (ps, /proc/PID/cmdline); the variable is not."""
    assert main(["rl", "--dry-run", "--inference.admin_token", "t0k3n"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ("fleetrl: warning: --inference.admin_token on the command line is readable by every local "
                            "user (ps, /proc/PID/cmdline); export FLEETRL_ADMIN_TOKEN instead\n")
    assert "t0k3n" not in captured.out + captured.err


def test_inference_on_a_live_runs_directory_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch):
    """A live run's directory holds its workers' logs and its weights' storage (which the
    filesystem transport prunes): `fleetrl inference` there is refused with the run's pid, and
    starts no worker (issue 27, item 3)."""
    from fleetrl.app import inference

    started = []

    class Unstarted:
        async def start(self, base):
            started.append(base)

    monkeypatch.setattr(inference, "resolve_model", lambda model: tmp_path)
    monkeypatch.setattr(inference, "build_fleet", lambda config, run_dir, model_dir: Unstarted())
    live = RunDir(tmp_path / "run")
    live.lock()
    try:
        assert main(["inference", "--run.dir", str(tmp_path / "run")]) == 1
    finally:
        live.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fleetrl: error: run.dir {tmp_path / 'run'} is in use by fleetrl pid {os.getpid()}; "
                   "one run at a time per run.dir (stop that one, or choose another run.dir)"], err
    assert not started


def test_the_command_line_and_the_config_import_no_torch():
    """`fleetrl --help`, `--dry-run`, `fleetrl model` and the config's checks start without torch's
    seconds of imports: fleetrl.lora, whose names the config's LoRA section reads, imports torch
    only where it makes tensors."""
    probe = subprocess.run([sys.executable, "-c", "import sys, fleetrl.cli; print('torch' in sys.modules)"],
                           capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "False", probe.stdout + probe.stderr


@pytest.mark.parametrize("command", ["rl", "sft", "export"])
@pytest.mark.parametrize("user_setting, seen", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_fleetrl_commands_make_openmp_threads_wait_passively_unless_told(command, user_setting, seen, monkeypatch):
    """Every command sets OMP_WAIT_POLICY before torch loads (the command line loads none, above),
    for its own process and those it starts (an evaluation beside a warm start took twice as long
    with spinning threads); a user's own setting stands."""
    import fleetrl.app.commands

    monkeypatch.setenv("OMP_WAIT_POLICY", user_setting or "")
    if user_setting is None:
        monkeypatch.delenv("OMP_WAIT_POLICY")  # set, then removed: restored either way
    policy = {}

    def dispatch(args, config):
        policy[args.command] = os.environ.get("OMP_WAIT_POLICY")
        return 0

    monkeypatch.setattr(fleetrl.app.commands, "_dispatch", dispatch)
    assert main([command]) == 0
    assert policy == {command: seen}
