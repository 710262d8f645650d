"""The pinned upstream source the contract tests read: SGLang's package and Dynamo's
``dynamo/sglang`` and ``dynamo/trtllm`` workers, found through their installed
distributions.

A contract test skips only when the distribution is not installed at all, and the
reason names it.  Installed at another release than the pin, or with a file or a piece
of code the test relies on gone, it fails and names what is missing: a check that
quietly passes when upstream moved is the drift it exists to catch.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

_PROJECT = tomllib.loads(
    (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]


def _pin(requirements: list[str], name: str) -> str:
    """The ``==`` version ``name`` is pinned to in pyproject's requirement lines."""
    for line in requirements:
        if line.split("==")[0].split("[")[0].strip() == name:
            return line.split("==")[1].split(";")[0].strip()
    raise AssertionError(f"pyproject.toml pins no {name}")


# ai-dynamo (the worker packages) goes in with --no-deps beside its runtime, at the
# runtime's release.
PINS = {
    "sglang": _pin(_PROJECT["optional-dependencies"]["sglang"], "sglang"),
    "ai-dynamo": _pin(_PROJECT["dependencies"], "ai-dynamo-runtime"),
}


@dataclass(frozen=True)
class Source:
    """One upstream file's text, with look-ups that fail naming the file."""

    label: str
    text: str

    def find(self, needle: str, start: int = 0) -> int:
        """Where ``needle`` first occurs (from ``start``); fails if it does not."""
        i = self.text.find(needle, start)
        if i < 0:
            pytest.fail(f"{needle!r} is no longer in {self.label}: upstream changed; "
                        "re-read it and update the adapter and this test", pytrace=False)
        return i

    def after(self, needle: str, length: int) -> str:
        """``length`` characters from ``needle`` on (a function body, say)."""
        i = self.find(needle)
        return self.text[i:i + length]

    def require(self, *needles: str) -> None:
        """Fails naming every one of ``needles`` the file lacks."""
        gone = [n for n in needles if n not in self.text]
        if gone:
            pytest.fail(f"no longer in {self.label}: {gone!r}; upstream changed", pytrace=False)

    def tree(self) -> ast.Module:
        return ast.parse(self.text, self.label)

    def node(self, kind: type, name: str, *, top_level: bool = False) -> ast.AST:
        """The class or function ``name`` (``kind``: ``ast.ClassDef`` ...) in the file."""
        tree = self.tree()
        nodes = tree.body if top_level else ast.walk(tree)
        for n in nodes:
            if isinstance(n, kind) and getattr(n, "name", None) == name:
                return n
        pytest.fail(f"{kind.__name__} {name!r} is no longer in {self.label}; "
                    "upstream changed", pytrace=False)


def package_dir(dist: str, package: str) -> Path:
    """The installed ``package`` folder of distribution ``dist`` at its pinned release.

    Skips when ``dist`` is not installed (a module's tests too, when called at import);
    fails when it is installed at another release or without ``package``."""
    try:
        installed = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} {PINS[dist]} is not installed (its contract tests read its "
                    "source)", allow_module_level=True)
    if installed.version != PINS[dist]:
        pytest.fail(f"{dist} {installed.version} is installed; the contract tests read "
                    f"{PINS[dist]}: re-check them against the new release and move the pin",
                    pytrace=False)
    root = Path(installed.locate_file(package))
    if not root.is_dir():
        pytest.fail(f"{dist} {PINS[dist]} is installed without its {package}/ package "
                    f"(looked in {root.parent})", pytrace=False)
    return root


def _read(dist: str, package: str, rel: str) -> Source:
    path = package_dir(dist, package) / rel
    label = f"{dist} {PINS[dist]} {package}/{rel}"
    if not path.is_file():
        pytest.fail(f"{label} is missing from the installed package: upstream moved or "
                    "removed it", pytrace=False)
    return Source(label, path.read_text())


def sglang_source(rel: str) -> Source:
    """A file of SGLang's installed package, ``rel`` below ``sglang/``."""
    return _read("sglang", "sglang", rel)


def sglang_module(name: str) -> ModuleType:
    """SGLang's module ``name`` (``sglang.srt.server_args``), imported: skips only when
    SGLang is not installed, fails naming the module when the pinned release lacks it."""
    package_dir("sglang", "sglang")
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(f"{name} does not import from sglang {PINS['sglang']} ({exc}); "
                    "upstream moved it", pytrace=False)


def needs_sglang_module(name: str):
    """A module-scoped autouse fixture that imports SGLang's module ``name`` as
    ``sglang_module`` does (skipping the test module without SGLang, failing it when the
    pinned release lacks ``name``).  Bound to a name in a test module instead of a call
    at its top: importing SGLang costs 8 s of CPU, and every xdist worker imports every
    test module to collect it."""

    @pytest.fixture(scope="module", autouse=True)
    def _sglang_installed() -> None:
        sglang_module(name)

    return _sglang_installed


def dynamo_source(rel: str) -> Source:
    """A file of Dynamo's installed worker packages, ``rel`` below ``dynamo/``
    (``sglang/shutdown.py``, ``trtllm/publisher.py``)."""
    return _read("ai-dynamo", "dynamo", rel)


def dynamo_dist_metadata() -> str:
    """The installed ai-dynamo distribution's METADATA (its own pins)."""
    package_dir("ai-dynamo", "dynamo")
    return importlib.metadata.distribution("ai-dynamo").read_text("METADATA") or ""
