"""`fleetrl status`: each worker of a running fleet — health, pause state, policy version.

It attaches through the provider protocol (discovery, then each worker's admin client), so it
reads native vLLM servers and Dynamo workers alike, and it never launches anything. Given a
run directory, it attaches to the fleet that run recorded there while it runs (fleet.json,
tokens.json); otherwise to the fleet the config names.
"""

from __future__ import annotations

from pathlib import Path

from fleetrl.app.providers import PROVIDERS, attached_to_run, build_provider, resolve_tokens
from fleetrl.config import Config, ConfigError
from fleetrl.errors import FleetrlError
from fleetrl.rundir import RunDir
from fleetrl.versions import version_name

PAUSE_STATES = {True: "paused", False: "serving", None: "pause state unknown"}  # None: the worker cannot say


async def run_status(config: Config, run_dir: Path | None = None) -> int:
    """Prints one line per worker; 1 when any worker is down or did not answer."""
    if run_dir is not None:
        config = attached_to_run(config, RunDir(run_dir))
    missing = PROVIDERS[config.inference.provider].missing_to_attach(config.inference)
    if missing:
        raise ConfigError(f"fleetrl status needs {missing}")
    # Only tokens given to it: a fresh one would open nothing.
    provider = build_provider(config, model_dir=None, tokens=resolve_tokens(config.inference, draw_missing=False))
    all_up = True
    try:
        for worker in await provider.discover():
            admin = provider.admin(worker)
            try:
                if not await admin.health():
                    print(f"{worker.id}  down")
                    all_up = False
                    continue
                version, paused = await admin.version(), await admin.is_paused()
                print(f"{worker.id}  up  version={version_name(version) if version is not None else 'unset'}  "
                      f"{PAUSE_STATES[paused]}")
            except FleetrlError as e:
                print(f"{worker.id}  error: {e}")
                all_up = False
    finally:
        await provider.close()
    return 0 if all_up else 1
