"""`fleetrl status`: each worker of a running fleet — health, pause state, policy version.

It attaches through the provider protocol (discovery, then each worker's admin client), so it
reads native vLLM servers and Dynamo workers alike, and it never launches anything.
"""

from __future__ import annotations

from fleetrl.app.providers import PROVIDERS, build_provider
from fleetrl.config import Config, ConfigError
from fleetrl.errors import FleetrlError
from fleetrl.versions import version_name

PAUSE_STATES = {True: "paused", False: "serving", None: "pause state unknown"}  # None: the worker cannot say


async def run_status(config: Config) -> int:
    """Prints one line per worker; 1 when any worker is down or did not answer."""
    missing = PROVIDERS[config.inference.provider].missing_to_attach(config.inference)
    if missing:
        raise ConfigError(f"fleetrl status needs {missing}")
    provider = build_provider(config, model_dir=None, token=config.inference.admin_token)
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
