"""Package discovery for the card's layout.

The design card keeps ``planner/``, ``components/``, ``graphs/``, ``kernels/`` (and the
contracts floor, ``contracts/``) at the repository root.  Installed under those bare
names they would collide with other distributions (Hugging Face ships a top-level
``kernels``), so each is a subpackage of ``splitserve``: the folder ``splitserve/``
holds a symbolic link to each (``splitserve/components -> ../components``), so the
import name ``splitserve.components.router`` is the path
``splitserve/components/router/`` for a reader, an editor and a static import tool
alike, with or without an install.  Metadata lives in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["splitserve", "splitserve.*"]))
