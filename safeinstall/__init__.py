"""safeinstall: reinstall a Python package safely under the services that use it."""

__version__ = "0.1.0"
