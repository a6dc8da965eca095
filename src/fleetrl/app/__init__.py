"""The composition root: each `fleetrl` command, built from the parts it wires together.

`commands.run_command` dispatches a parsed command line; `providers` builds an inference
provider (and the fleet on it) by name; `rl` is `fleetrl rl`; `inference` and `status` are the
two fleet commands. Nothing outside this package imports it but the CLI.
"""
