"""The cluster templates (deploy/) and docs/cluster.md cannot drift from fleetrl.

They cannot be run here (no SLURM, no Kubernetes, no GPU), so this checks what can be checked
on one machine, for real: the sbatch script is valid bash and, run with stand-ins for
scontrol, srun and torchrun, hands torchrun a fleetrl command line that fleetrl's own parser
and config loader accept; every YAML document parses; every config (the example TOML, the
ConfigMap's, the docs' TOML blocks) loads with fleetrl's config loader; every `--section.key`
flag and every dotted config name the templates and docs/cluster.md use is a config field;
the servers' and workers' command lines carry the engine arguments of `fleetrl.contract`; and
no token is ever on a command line.
"""

from __future__ import annotations

import http.server
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from fleetrl.cli import main as cli_main
from fleetrl.cli import split_config_files
from fleetrl.config import Config, field_docs, load_config
from fleetrl.contract import ADMIN_MIDDLEWARE, ADMIN_TOKEN_ENV, DATA_TOKEN_ENV, DYNAMO_WORKER_MODULE, ENGINE_ARGS, \
    TOKEN_VERSIONS_FLAG

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "fleetrl.sbatch"
SLURM_TOML = ROOT / "deploy" / "slurm" / "cluster.toml"
K8S = ROOT / "deploy" / "k8s"
CLUSTER_MD = ROOT / "docs" / "cluster.md"

FIELDS = {name for name, _, _ in field_docs()}
# Sections and subsections too ([inference.weights] in TOML; "the inference.dynamo section").
NAMES = FIELDS | {name.rsplit(".", i)[0] for name in FIELDS for i in range(1, name.count(".") + 1)}
SECTIONS = tuple(Config.model_fields)  # model, inference, orchestrator, trainer, run
# A dotted config name: a top-level section, then dotted lower-case parts; not part of a longer
# dotted name (a module such as fleetrl.trainer.loop) nor of a path or a file name.
DOTTED = re.compile(rf"(?<![\w./$-])(?:{'|'.join(SECTIONS)})(?:\.[a-z_]+)+(?![\w(/-])")
FLAG = re.compile(r"--([a-z_]+(?:\.[a-z_]+)+)")


def yaml_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def k8s_files() -> list[Path]:
    return sorted(K8S.glob("*.yaml"))


def configmap_tomls() -> dict[str, str]:
    maps = [doc for path in k8s_files() for doc in yaml_documents(path) if doc["kind"] == "ConfigMap"]
    return {key: text for doc in maps for key, text in doc["data"].items() if key.endswith(".toml")}


def load_toml_text(text: str, tmp_path: Path, name: str) -> Config:
    path = tmp_path / name
    path.write_text(text)
    return load_config([path], [])


def templates_text() -> dict[str, str]:
    """Every template and docs/cluster.md, by name."""
    paths = [SBATCH, SLURM_TOML, *k8s_files(), CLUSTER_MD]
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths}


# -- the SLURM template ---------------------------------------------------------------------------

def test_the_sbatch_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_slurm_example_config_loads():
    config = load_config([SLURM_TOML], [])
    assert config.inference.provider == "vllm"
    # world_size comes from torchrun's WORLD_SIZE: the example must not pin another value.
    assert "world_size" not in SLURM_TOML.read_text().split("[trainer]", 1)[1].split("[", 1)[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the stdlib's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_sbatch_script_hands_torchrun_a_command_fleetrl_accepts(tmp_path, capsys):
    """The script run as SLURM would run it, with stand-ins: scontrol lists one trainer node and
    one inference node (127.0.0.1, where a /health server answers); srun runs the trainer step's
    shell and parks the servers' step; torchrun records its arguments."""
    port = _free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    bin_dir, venv_bin = tmp_path / "bin", tmp_path / "venv" / "bin"
    bin_dir.mkdir()
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(sys.executable)
    argv_file = tmp_path / "torchrun.argv"
    _stub(bin_dir / "scontrol", 'printf "trainer-a\\n127.0.0.1\\n"\n')
    # The servers' step is parked (no vLLM here); the trainer step's shell runs as srun would run it.
    _stub(bin_dir / "srun", 'for a; do last=$a; done\n'
                            'case "$last" in *start_servers*) exec sleep 60;; esac\n'
                            'exec bash -c "$last"\n')
    _stub(venv_bin / "torchrun", f'printf "%s\\0" "$@" > {shlex.quote(str(argv_file))}\n')
    env = {k: v for k, v in os.environ.items() if k not in (ADMIN_TOKEN_ENV, DATA_TOKEN_ENV)}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_NODELIST="trainer-a,127.0.0.1", SLURM_JOB_ID="77",
               FLEETRL_VENV=str(tmp_path / "venv"), CONFIG=str(SLURM_TOML), LOG_DIR=str(tmp_path / "logs"),
               TRAINER_NODES="1", GPUS_PER_NODE="2", GPU_PER_SERVER="1", SERVER_PORT=str(port),
               STARTUP_TIMEOUT_S="30")
    try:
        # Two servers per inference node are expected (ports port, port+1); answer the second too.
        second = http.server.ThreadingHTTPServer(("127.0.0.1", port + 1), _Health)
    except OSError:
        pytest.skip("the port after a free one is taken")
    threading.Thread(target=second.serve_forever, daemon=True).start()
    try:
        result = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        second.shutdown()
    assert result.returncode == 0, result.stderr
    argv = argv_file.read_text().split("\0")[:-1]

    # torchrun's part: one node of TRAINER_NODES, GPUS_PER_NODE ranks, c10d on the first trainer node.
    module = argv.index("-m")
    launcher = argv[:module]
    assert launcher[launcher.index("--nnodes") + 1] == "1"
    assert launcher[launcher.index("--nproc-per-node") + 1] == "2"
    assert launcher[launcher.index("--rdzv-backend") + 1] == "c10d"
    assert launcher[launcher.index("--rdzv-endpoint") + 1] == "trainer-a:29400"

    # fleetrl's part: `fleetrl rl @ cluster.toml --flags`, parsed by fleetrl's own CLI.
    assert argv[module + 1:module + 3] == ["fleetrl", "rl"]
    fleetrl_args = argv[module + 2:]
    rest, files = split_config_files(fleetrl_args[1:])
    overrides = [(rest[i][2:], rest[i + 1]) for i in range(0, len(rest), 2)]
    config = load_config(files, overrides)
    assert config.inference.urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    assert config.inference.weights.sender_host == socket.gethostname()
    assert config.run.dir == Path("/shared/runs/fleetrl-77")
    assert not any("token" in arg for arg in argv), "a token on the command line"
    # And the whole command passes `fleetrl rl --dry-run`'s checks.
    assert cli_main([*fleetrl_args, "--dry-run"]) == 0
    capsys.readouterr()


def test_the_servers_carry_fleetrls_engine_side():
    text = SBATCH.read_text()
    for arg in [*ENGINE_ARGS, ADMIN_MIDDLEWARE, "--enable-scale-out", "VLLM_SERVER_DEV_MODE=1"]:
        assert shlex.quote(arg) in text or arg in text, arg
    assert ADMIN_TOKEN_ENV in text and DATA_TOKEN_ENV in text


# -- the Kubernetes templates ---------------------------------------------------------------------

def test_every_kubernetes_document_parses_and_says_it_was_not_run():
    assert k8s_files(), "no manifests in deploy/k8s"
    for path in k8s_files():
        docs = yaml_documents(path)
        assert docs and all("apiVersion" in d and "kind" in d and "name" in d["metadata"] for d in docs), path
        assert "NOT RUN HERE" in path.read_text().split("---", 1)[0], path


def test_the_configmaps_configs_load(tmp_path):
    tomls = configmap_tomls()
    assert set(tomls) >= {"cluster.toml", "cluster-vllm.toml"}
    for name, text in tomls.items():
        config = load_toml_text(text, tmp_path, name)
        assert "world_size" not in text, f"{name}: trainer.world_size comes from torchrun's WORLD_SIZE"
        assert config.run.dir.is_absolute(), f"{name}: run.dir must be on the shared volume"


def _containers(doc: dict) -> list[dict]:
    """The containers of a Job, StatefulSet or Deployment, and the main containers of a
    DynamoGraphDeployment's services."""
    if doc["kind"] == "DynamoGraphDeployment":
        return [s["extraPodSpec"]["mainContainer"] for s in doc["spec"]["services"].values()
                if "mainContainer" in s.get("extraPodSpec", {})]
    if doc["kind"] in ("Job", "StatefulSet", "Deployment"):
        return doc["spec"]["template"]["spec"]["containers"]
    return []


def _all_containers() -> list[dict]:
    return [c for path in k8s_files() for doc in yaml_documents(path) for c in _containers(doc)]


def test_the_dynamo_workers_run_fleetrls_entry_with_its_engine_args():
    workers = [c for c in _all_containers() if DYNAMO_WORKER_MODULE in c.get("command", [])]
    assert workers, f"no container runs {DYNAMO_WORKER_MODULE}"
    for worker in workers:
        args = worker["args"]
        assert "--enable-rl" in args
        assert all(args[args.index(a) + 1] == b for a, b in zip(ENGINE_ARGS[::2], ENGINE_ARGS[1::2]))
        assert TOKEN_VERSIONS_FLAG in args  # the ConfigMap's cluster.toml says inference.dynamo.worker = "fleetrl"
    graph = next(d for p in k8s_files() for d in yaml_documents(p) if d["kind"] == "DynamoGraphDeployment")
    for service in graph["spec"]["services"].values():
        if service["componentType"] == "worker":  # fleetrl's kind signs its admin routes with the secret's token
            env = {e["name"]: e for e in service["envs"]}
            assert "secretKeyRef" in env[ADMIN_TOKEN_ENV]["valueFrom"], service
    frontend_env = {e["name"]: e.get("value") for s in graph["spec"]["services"].values()
                    if s["componentType"] == "frontend" for e in s["envs"]}
    assert frontend_env["DYN_ENABLE_RL"] == "true" and frontend_env["DYN_RL_PORT"]


def test_the_native_servers_carry_the_middleware_and_take_tokens_from_the_secret():
    servers = [c for c in _all_containers() if "vllm.entrypoints.openai.api_server" in c.get("command", [])]
    assert servers
    for server in servers:
        args = server["args"]
        assert args[args.index("--middleware") + 1] == ADMIN_MIDDLEWARE
        assert all(args[args.index(a) + 1] == b for a, b in zip(ENGINE_ARGS[::2], ENGINE_ARGS[1::2]))
        env = {e["name"]: e for e in server["env"]}
        for name in (ADMIN_TOKEN_ENV, DATA_TOKEN_ENV):
            assert "secretKeyRef" in env[name]["valueFrom"], name


def test_the_trainer_runs_torchrun_with_fleetrl_rl():
    (trainer,) = [c for c in _all_containers() if "torchrun" in " ".join(c.get("args", []))]
    script = " ".join(trainer["args"])
    assert "--rdzv-backend c10d" in script and "-m fleetrl rl @ /etc/fleetrl/cluster.toml" in script


# -- flags, config names and TOML blocks: templates and docs/cluster.md ------------------------------

def test_no_token_is_ever_on_a_command_line():
    for name, text in templates_text().items():
        assert "--inference.admin_token" not in text and "--inference.data_token" not in text, name


def test_every_flag_and_dotted_config_name_is_a_config_field():
    unknown = {}
    for name, text in templates_text().items():
        flags = {m for m in FLAG.findall(text) if m.split(".", 1)[0] in SECTIONS}
        if missing := sorted((flags - FIELDS) | (set(DOTTED.findall(text)) - NAMES)):
            unknown[name] = missing
    assert unknown == {}


def test_the_docs_use_flags_and_names_the_check_can_see():
    """The checks above are not vacuous: docs/cluster.md names the fields it is about."""
    text = CLUSTER_MD.read_text()
    for field in ("inference.weights.sender_host", "trainer.world_size", "run.dir", "model.path",
                  "inference.urls", "inference.host", "inference.dynamo.frontend_url", "inference.dynamo.rl_url"):
        assert field in DOTTED.findall(text) or f"--{field}" in text, field


def test_every_toml_block_of_the_cluster_docs_loads(tmp_path):
    blocks = re.findall(r"```toml\n(.*?)```", CLUSTER_MD.read_text(), re.DOTALL)
    assert blocks
    for i, block in enumerate(blocks):
        load_toml_text(block, tmp_path, f"block{i}.toml")


def test_the_dotted_name_pattern_finds_fields_and_nothing_else():
    text = ("`inference.weights.sender_host`, --run.dir, fleetrl.trainer.loop, torch/distributed/run.py, "
            "RUN_DIR/config.toml, trainer.world_size.")
    assert DOTTED.findall(text) == ["inference.weights.sender_host", "trainer.world_size"]
    assert FLAG.findall(text) == ["run.dir"]
