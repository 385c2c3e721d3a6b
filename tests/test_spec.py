"""The gate as tests, generated per config by speccheck's plugin (`pytest -m spec`): each
stored config is checked for determinism, agreement, divergence confidence and acceptance."""
from speccheck.pytest_plugin import *  # noqa: F401,F403
