"""The C extensions need a build step; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("recorder._markers", ["recorder/_markers.c"], optional=True),
        # the ingest fast path; without them rows are built and bound in Python
        Extension("recorder._ingest", ["recorder/_ingest.c"], optional=True),
        Extension("store.db._insert", ["store/db/_insert.c"], optional=True, libraries=["dl"]),
    ],
)
