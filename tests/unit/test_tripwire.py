"""The tripwire of process-wide state (fleetrl/tripwire.py, issue 36 item 1): armed by
FLEETRL_TRIPWIRE=1, each guarded setter called off the main thread raises there and ends the
command with status 1 and one line naming it and the thread; on the main thread, or unarmed,
nothing changes. (tests/unit/test_global_state.py runs whole `fleetrl rl` runs with it armed;
test_lora.py's zero adapter is built on another thread under it.)"""

from __future__ import annotations

import importlib
import sys
import threading

import pytest
import torch

from fleetrl import cli, tripwire

# The arguments of a harmless call of each guarded setter: the CM factories are called, not entered.
CALLS = {
    "set_default_dtype": lambda: (torch.get_default_dtype(),),
    "set_default_device": lambda: (None,),
    "manual_seed": lambda: (0,),
    "init_on_device": lambda: (torch.device("meta"),),
}


def call_setter(module_name: str, name: str) -> None:
    """The setter as code calls it: looked up in its module at the time of the call."""
    getattr(importlib.import_module(module_name), name)(*CALLS.get(name, tuple)())


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
