"""The package version: one place, read by globaltensor.__version__, launch.py --version and
pyproject.toml (tests/core/test_everyday_use.py checks they agree)."""
__version__ = "0.1.0"
