"""The wheel's package list, derived from the folders: every folder with an __init__.py under
cache/, flows/ and stages/ is a lorapipe.* package (pyproject.toml's package-dir maps the three),
so a new subpackage ships without a list to update. Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

SOURCE_ROOTS = ("cache", "flows", "stages")

setup(packages=["lorapipe", "lorapipe.configs"] + [
    f"lorapipe.{root}" + (f".{sub}" if sub else "") for root in SOURCE_ROOTS for sub in ["", *find_packages(root)]])
