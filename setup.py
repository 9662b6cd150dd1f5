"""Only the marker extension needs a build step; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[Extension("recorder._markers", ["recorder/_markers.c"], optional=True)],
)
