"""Package discovery for the card's layout.

The design card keeps ``planner/``, ``components/``, ``graphs/`` and ``kernels/`` at the
repository root.  Installed under those bare names they would collide with other
distributions (Hugging Face ships a top-level ``kernels``), so each folder is mapped
under the ``splitserve`` namespace: ``components/router`` imports as
``splitserve.components.router``.  Metadata lives in pyproject.toml.
"""

from setuptools import find_packages, setup

ROOTS = {"splitserve": "splitserve", "planner": "planner", "components": "components",
         "graphs": "graphs", "kernels": "kernels"}

package_dir: dict[str, str] = {}
packages: list[str] = []
for name, folder in ROOTS.items():
    full = "splitserve" if name == "splitserve" else f"splitserve.{name}"
    package_dir[full] = folder
    packages.append(full)
    packages += [f"{full}.{sub}" for sub in find_packages(folder)]

setup(package_dir=package_dir, packages=packages)
