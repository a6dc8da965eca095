"""The tripwire of process-wide state (fleetrl/tripwire.py): armed by FLEETRL_TRIPWIRE=1 in
`fleetrl` and in the trainer ranks it starts, each guarded setter called off the main thread
raises there and ends the command with status 1 and one line naming it and the thread; on the
main thread, or unarmed, nothing changes. The base weights that `fleetrl inference` and `fleetrl
eval` hold attached workers to load on the main thread. (tests/unit/test_global_state.py runs
whole `fleetrl rl` runs with it armed; test_lora.py's zero adapter is built on another thread
under it.)"""

from __future__ import annotations

import asyncio
import functools
import importlib
import sys
import threading

import pytest
import torch

from fleetrl import cli, tripwire
from fleetrl.app.providers import base_weights
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.types import WorkerState
from fleetrl.trainer import __main__ as trainer_rank

from .fake_fleet import FakeTransport
from .test_global_state import RunProvider
from .test_trainer_step import save_tiny_model


@functools.cache
def tiny_model():
    """A tiny Llama, built once (on the main thread: the first call of each setter's test)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


# A harmless call of each guarded setter, given as code finds it: the CM factories are called, not
# entered; a model build reaches PreTrainedModel.__init__.
CALLS = {
    "set_default_dtype": lambda set_dtype: set_dtype(torch.get_default_dtype()),
    "set_default_tensor_type": lambda set_type: set_type(torch.tensor([]).type()),
    "set_default_device": lambda set_device: set_device(None),
    "manual_seed": lambda seed: seed(0),
    "init_on_device": lambda on_device: on_device(torch.device("meta")),
    "PreTrainedModel.__init__": lambda _: tiny_model.__wrapped__(),
    "PreTrainedModel.initialize_weights": lambda initialize: initialize(tiny_model()),
}


def call_setter(module_name: str, name: str) -> None:
    """The setter as code calls it: looked up in its module (or on its class) at the time of the call."""
    setter = importlib.import_module(module_name)
    for part in name.split("."):
        setter = getattr(setter, part)
    CALLS.get(name, lambda factory: factory())(setter)


def on_thread(fn, name: str = "fleetrl-control") -> BaseException | None:
    """What `fn` raised on a thread of its own (None: nothing)."""
    raised = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - what the thread saw is the result
            raised.append(e)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    return raised[0] if raised else None


@pytest.fixture
def rng_kept():
    """torch's RNG as it was: manual_seed runs for real on the main thread."""
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)


@pytest.mark.filterwarnings("ignore:torch.set_default_tensor_type\\(\\) is deprecated")
@pytest.mark.parametrize("module_name, name", tripwire.GUARDED, ids=lambda part: part)
def test_each_guarded_setter_trips_off_the_main_thread_only(module_name, name, rng_kept):
    with tripwire.armed(True) as wire:
        call_setter(module_name, name)  # the main thread: allowed
        assert wire.verdict() is None
        raised = on_thread(lambda: call_setter(module_name, name))
        expected = f"tripwire: {module_name}.{name} called on thread fleetrl-control: it changes process-wide state"
        assert isinstance(raised, tripwire.TripwireError) and str(raised).startswith(expected)
        assert wire.offences == [str(raised)] and wire.verdict() == str(raised)
    # Disarmed: the setter is its own again, and another thread may call it unseen.
    assert on_thread(lambda: call_setter(module_name, name)) is None
    assert wire.offences == [str(raised)]


@pytest.mark.filterwarnings("ignore:torch.set_default_tensor_type\\(\\) is deprecated")
def test_a_model_built_off_the_main_thread_trips_however_it_is_built(rng_kept):
    """A transformers model's weight init swaps torch.nn.init's functions for the whole process
    (guard_torch_init_functions, which no wrapper of a function can reach): building one, or
    initializing its weights, trips on any thread but the main one, with no other setter called
    (a plain constructor call calls none). torch.set_default_tensor_type sets the default dtype."""
    with tripwire.armed(True):
        model = tiny_model()
        for call, name in [(tiny_model.__wrapped__, "transformers.modeling_utils.PreTrainedModel.__init__"),
                           (model.initialize_weights, "transformers.modeling_utils.PreTrainedModel.initialize_weights"),
                           (lambda: torch.set_default_tensor_type(torch.tensor([]).type()),
                            "torch.set_default_tensor_type")]:
            raised = on_thread(call)
            assert isinstance(raised, tripwire.TripwireError) and str(raised).startswith(f"tripwire: {name} called")


def test_unarmed_nothing_is_wrapped():
    setter = torch.set_default_dtype
    with tripwire.armed(False) as wire:
        assert torch.set_default_dtype is setter
        assert on_thread(lambda: torch.set_default_dtype(torch.get_default_dtype())) is None
    assert wire.verdict() is None


def test_a_module_imported_while_armed_is_wrapped_before_anyone_copies_a_setter(monkeypatch, tmp_path):
    """transformers and accelerate are not imported to arm (most commands load neither): a guarded
    module is wrapped as soon as it has run, so an importer's copy (`from accelerate import
    init_empty_weights`) is the wrapper too. Here with a guarded module of the test's own."""
    (tmp_path / "fleetrl_guarded_state.py").write_text("def set_state():\n    pass\n")
    (tmp_path / "fleetrl_state_user.py").write_text("from fleetrl_guarded_state import set_state\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tripwire, "GUARDED", (("fleetrl_guarded_state", "set_state"),))
    try:
        with tripwire.armed(True) as wire:
            from fleetrl_state_user import set_state

            assert isinstance(on_thread(set_state), tripwire.TripwireError)
            assert wire.verdict().startswith("tripwire: fleetrl_guarded_state.set_state called on thread")
        import fleetrl_guarded_state
        import fleetrl_state_user

        # Disarmed: both hold the setter itself again.
        assert fleetrl_state_user.set_state is fleetrl_guarded_state.set_state
        assert fleetrl_guarded_state.set_state.__code__.co_filename == str(tmp_path / "fleetrl_guarded_state.py")
    finally:
        for module in ("fleetrl_guarded_state", "fleetrl_state_user"):
            sys.modules.pop(module, None)


def test_a_command_that_tripped_ends_with_status_1_naming_the_setter_and_the_thread(monkeypatch, capsys):
    """Whatever became of the exception in its thread (here: swallowed), the command fails."""
    def command(argv) -> int:
        on_thread(lambda: torch.set_default_dtype(torch.float32))
        return 0

    monkeypatch.setattr(cli, "run_command_line", command)
    monkeypatch.setenv(tripwire.ENV, "1")
    assert cli.main(["rl"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == ("fleetrl: error: tripwire: torch.set_default_dtype called on thread "
                                    "fleetrl-control: it changes process-wide state, which fleetrl changes on the "
                                    "main thread only")
    assert "test_tripwire.py" in err  # the offence was printed with its stack as it happened
    monkeypatch.delenv(tripwire.ENV)
    assert cli.main(["rl"]) == 0


def test_a_trainer_rank_fleetrl_starts_runs_armed_like_fleetrl(monkeypatch, capsys, tmp_path):
    """Ranks 1..N-1 (`python -m fleetrl.trainer`, which inherit FLEETRL_TRIPWIRE from the run) do
    not go through cli.main: they are armed all the same, and a rank that tripped exits 1."""
    trained = []

    def train_peer(config, run_dir, model_dir, world) -> None:
        trained.append((run_dir.root, model_dir))
        on_thread(lambda: torch.set_default_dtype(torch.float32))

    monkeypatch.setattr(trainer_rank.RunDir, "read_config", lambda self: None)
    monkeypatch.setattr(trainer_rank.distributed, "collective_timeout_s", lambda config: 1.0)
    monkeypatch.setattr(trainer_rank.distributed, "init", lambda timeout_s: None)
    monkeypatch.setattr(trainer_rank.distributed, "destroy", lambda: None)
    monkeypatch.setattr(trainer_rank, "train_peer", train_peer)
    monkeypatch.setenv(tripwire.ENV, "1")
    assert trainer_rank.main(["rl", str(tmp_path / "run"), str(tmp_path / "model")]) == 1
    assert trained == [(tmp_path / "run", tmp_path / "model")]
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        "fleetrl: error: tripwire: torch.set_default_dtype called on thread fleetrl-control")
    monkeypatch.delenv(tripwire.ENV)
    assert trainer_rank.main(["rl", str(tmp_path / "run"), str(tmp_path / "model")]) == 0


def test_the_base_weights_of_attached_workers_load_on_the_main_thread(tmp_path):
    """`fleetrl inference` and `fleetrl eval` hold attached workers to the weights of the model in
    its folder: a transformers load, which sets torch's default dtype and transformers' init
    patches for the whole process, so it runs on the main thread (the event loop's), never on a
    thread of Fleet.start's."""
    save_tiny_model(tmp_path)
    provider = RunProvider("w0", launches_workers=False)
    fleet = Fleet(provider, discovery_interval_s=3600, probe_tolerance=1e9, log=lambda line: None)

    async def start_attached() -> None:  # as app/inference.py and app/eval.py start their fleet
        await fleet.start(base_weights(provider, tmp_path, FakeTransport(provider)))
        await fleet.close()

    with tripwire.armed(True) as wire:
        asyncio.run(start_attached())
    assert wire.verdict() is None
    assert fleet.version == 0 and fleet.checksum and fleet.workers["w0"].state == WorkerState.READY
