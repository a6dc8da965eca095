"""The environments of docs/environments.md as a package of their own: named by import path
from the repository root (`examples.my_envs.shout:Shout`), or, once installed
(`pip install -e examples/my_envs`), by the names its pyproject.toml registers (`shout`)."""
