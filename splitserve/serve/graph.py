"""Graphs: which components run and which talk to which.

A component is an immutable ``ComponentSpec`` (its name, the module its processes run,
its config model, and the components it is able to talk to).  A graph module links them
the way Dynamo's SDK did::

    graph = Frontend.link(Router).link(Worker)

``link`` never mutates the spec: it returns a ``Pipeline`` holding the edges, so two
graph modules can link the same components differently in one process.
``dynamo serve graphs.agg:Frontend`` loads the module, merges its pipelines into one
``Graph`` and keeps only what is reachable from ``Frontend``; each started component is
told which of its possible dependencies are linked (the others are pruned).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType

from splitserve.contracts.config import ComponentConfig


@dataclass(frozen=True)
class ComponentSpec:
    """One process type of a graph.

    ``entrypoint`` is a module run as ``python -m entrypoint --config FILE``; ``may_link``
    names the components it knows how to call; ``shutdown_rank`` orders shutdown (lower
    stops first: the frontend before the workers, so no new work arrives while draining).
    """

    name: str
    entrypoint: str
    config_model: type[ComponentConfig] = ComponentConfig
    may_link: tuple[str, ...] = ()
    shutdown_rank: int = 50
    description: str = ""

    def link(self, other: ComponentSpec) -> Pipeline:
        """Start a pipeline with the edge self → other."""
        return Pipeline(edges=()).link_from(self, other)


@dataclass(frozen=True)
class Pipeline:
    """A chain of links; ``link`` appends an edge from the last component linked."""

    edges: tuple[tuple[ComponentSpec, ComponentSpec], ...]
    tail: ComponentSpec | None = None

    def link_from(self, src: ComponentSpec, dst: ComponentSpec) -> Pipeline:
        if dst.name not in src.may_link:
            allowed = ", ".join(src.may_link) or "nothing"
            raise GraphError(f"{src.name} cannot link {dst.name}; it links to: {allowed}")
        return Pipeline(edges=self.edges + ((src, dst),), tail=dst)

    def link(self, other: ComponentSpec) -> Pipeline:
        """Add the edge (last linked component) → other."""
        assert self.tail is not None
        return self.link_from(self.tail, other)


class GraphError(ValueError):
    """A graph reference or a graph module is invalid."""


@dataclass
class Graph:
    """Components and edges of a resolved graph, rooted at the component to serve."""

    root: str
    components: dict[str, ComponentSpec] = field(default_factory=dict)
    edges: dict[str, list[str]] = field(default_factory=dict)
    defined: set[str] = field(default_factory=set)
    """Every component name the graph module defines, served or pruned."""

    def links_of(self, name: str) -> list[str]:
        """Names of the components ``name`` is linked to in this graph."""
        return list(self.edges.get(name, []))

    def pruned_of(self, name: str) -> list[str]:
        """Dependencies the component could use but this graph does not link."""
        linked = set(self.edges.get(name, []))
        return [d for d in self.components[name].may_link if d not in linked]

    def order(self) -> list[str]:
        """Components in start order: dependencies first, the root last."""
        out: list[str] = []

        def visit(n: str) -> None:
            if n in out:
                return
            for d in self.edges.get(n, []):
                visit(d)
            out.append(n)

        visit(self.root)
        return out


def merge_pipelines(pipelines: list[Pipeline], root: str) -> Graph:
    """Union the pipelines' edges and keep what is reachable from ``root``."""
    specs: dict[str, ComponentSpec] = {}
    edges: dict[str, list[str]] = {}
    for p in pipelines:
        for src, dst in p.edges:
            for spec in (src, dst):
                known = specs.setdefault(spec.name, spec)
                if known is not spec and known != spec:
                    raise GraphError(f"two different components are named {spec.name}")
            edges.setdefault(src.name, [])
            if dst.name not in edges[src.name]:
                edges[src.name].append(dst.name)
    if root not in specs:
        raise GraphError(f"component '{root}' is not in the graph; "
                         f"known: {', '.join(sorted(specs)) or 'none'}")
    reachable: list[str] = []
    stack = [root]
    while stack:
        n = stack.pop()
        if n in reachable:
            continue
        reachable.append(n)
        stack.extend(edges.get(n, []))
    _check_acyclic(root, edges)
    return Graph(root=root,
                 components={n: specs[n] for n in reachable},
                 edges={n: edges[n] for n in reachable if n in edges},
                 defined=set(specs))


def _check_acyclic(root: str, edges: dict[str, list[str]]) -> None:
    path: list[str] = []

    def visit(n: str) -> None:
        if n in path:
            raise GraphError("graph has a cycle: " + " -> ".join(path + [n]))
        path.append(n)
        for d in edges.get(n, []):
            visit(d)
        path.pop()

    visit(root)


def import_graph_module(module: str) -> ModuleType:
    """Import a graph module by dotted name.

    ``graphs.X`` names a graph shipped with this distribution (``splitserve.graphs.X``)
    unless the current directory has its own ``graphs`` package; any other name is
    imported as given (the current directory is on sys.path), so users can keep their
    graphs beside their configs.
    """
    import sys

    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    candidates = [module]
    if module == "graphs" or module.startswith("graphs."):
        candidates = [f"splitserve.{module}", module]
        import os

        if os.path.isfile(os.path.join("graphs", "__init__.py")) and not _is_ours("graphs"):
            candidates.reverse()
    errors = []
    for name in candidates:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and not name.startswith(exc.name) and exc.name not in name:
                raise
            errors.append(name)
    raise GraphError(f"graph module '{module}' not found (tried {', '.join(errors)})")


def _is_ours(folder: str) -> bool:
    """Whether ``folder`` is this distribution's own graphs package (found by name, not
    imported: the graphs stand above this loader)."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("splitserve.graphs")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return any(os.path.realpath(loc) == os.path.realpath(folder) for loc in locations)


def load_graph(ref: str) -> Graph:
    """Resolve ``module:Component`` into a pruned Graph rooted at that component."""
    module_name, sep, root = ref.partition(":")
    if not sep or not module_name or not root:
        raise GraphError(f"graph reference '{ref}' must look like module:Component, "
                         "e.g. graphs.agg:Frontend")
    mod = import_graph_module(module_name)
    pipelines = [v for v in vars(mod).values() if isinstance(v, Pipeline)]
    singles = [v for v in vars(mod).values() if isinstance(v, ComponentSpec)]
    if not pipelines:
        spec = next((s for s in singles if s.name == root), None)
        if spec is None:
            raise GraphError(f"module '{module_name}' defines no linked graph and no "
                             f"component named '{root}'")
        return Graph(root=root, components={root: spec}, edges={},
                     defined={s.name for s in singles})
    graph = merge_pipelines(pipelines, root)
    graph.defined |= {s.name for s in singles}
    return graph
