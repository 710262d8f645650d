"""``dynamo policy``: validate, apply, show, diff, list and roll back policy versions.

Exit codes: 0 success; 1 etcd unreachable or no graph found; 2 invalid policy file,
usage, or no usable signing key (apply, rollback); 3 lost a concurrent apply; 4 no such version (or nothing applied yet); 5 (``show``)
some component instance refused the current version.  Without ``--etcd`` and
``--namespace`` the commands use the local ``dynamo serve`` graph's.
"""

from __future__ import annotations

import asyncio
import getpass
import json
from collections.abc import Awaitable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import aetcd
import typer
from rich.console import Console

from splitserve.cli.paths import dev_infra_dir, state_root
from splitserve.cli.status_cmd import local_supervisors
from splitserve.contracts.kit.connect import split_credentials

from splitserve.cli import policy_render as render
from splitserve.components.policy.canonical import canonical_dict, policy_sha256, unified_diff
from splitserve.components.policy.schema import PolicyError, load_policy_file
from splitserve.components.policy.signing import PolicyKey
from splitserve.components.policy.store import PolicyConflict, PolicyNotFound, PolicyStore

app = typer.Typer(help="Validate, apply and roll back routing/offload/QoS policies.",
                  no_args_is_help=True)
T = TypeVar("T")
EXIT_ETCD, EXIT_INVALID, EXIT_CONFLICT, EXIT_NOT_FOUND, EXIT_REFUSED = 1, 2, 3, 4, 5

Etcd = Annotated[str | None, typer.Option("--etcd", envvar="ETCD_ENDPOINTS",
                                          help="etcd endpoints (default: the local graph's).")]
Namespace = Annotated[str | None, typer.Option("--namespace", "-n", help="Dynamo namespace "
                                               "(default: the local graph's, else 'dynamo').")]
StateDir = Annotated[str | None, typer.Option("--state-dir", envvar="SPLITSERVE_HOME",
                                              help="Root for local state.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
Author = Annotated[str | None, typer.Option("--author", help="Recorded as the version's "
                                            "author (default: the login name).")]
KeyFile = Annotated[Path | None, typer.Option(
    "--key-file", envvar="SPLITSERVE_POLICY_KEY_FILE",
    help="The graph's policy signing key (default: the local graph's policy.key).")]
EXIT_NO_KEY = 2

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def _store(etcd: str | None, namespace: str | None, state_dir: str | None,
           sign: bool = False, key_file: Path | None = None) -> PolicyStore:
    """Resolve endpoints: flags first, then a local `dynamo serve`, then `dynamo infra`.

    With ``sign`` (apply, rollback) the store also gets the policy key: ``--key-file``
    (or SPLITSERVE_POLICY_KEY_FILE), else the key of the local graph on the same etcd
    and namespace; without one the command stops (exit 2) instead of writing a version
    every component would refuse.
    """
    root = state_root(state_dir)
    sups = local_supervisors(root)
    if not etcd or not namespace:
        if sups:
            etcd = etcd or sups[0]["etcd"]
            namespace = namespace or sups[0]["namespace"]
        elif not etcd and (dev := dev_infra_dir(root) / "infra.json").exists():
            etcd = json.loads(dev.read_text())["endpoints"]["etcd"]
    if not etcd:
        err.print("[red]error:[/] no local `dynamo serve` or `dynamo infra` found; "
                  "pass --etcd and --namespace")
        raise typer.Exit(EXIT_ETCD)
    namespace = namespace or "dynamo"
    key = None
    if sign:
        if key_file is None:
            key_file = next((Path(s["policy_key_file"]) for s in sups
                             if s.get("policy_key_file") and s["etcd"] == etcd
                             and s["namespace"] == namespace), None)
        if key_file is None:
            err.print("[red]error:[/] no policy signing key: pass --key-file (or set "
                      "SPLITSERVE_POLICY_KEY_FILE) with the graph's key; components refuse "
                      "unsigned versions")
            raise typer.Exit(EXIT_NO_KEY)
        try:
            key = PolicyKey.from_file(key_file)
        except (OSError, ValueError) as exc:
            err.print("[red]error:[/] ", end="")
            err.print(f"cannot use policy key {key_file}: {exc}", highlight=False,
                      markup=False)
            raise typer.Exit(EXIT_NO_KEY) from None
    return PolicyStore(etcd, namespace, signing_key=key)


def _call(store: PolicyStore, work: Awaitable[T]) -> T:
    """Run one store coroutine, turning its errors into messages and exit codes."""
    try:
        return asyncio.run(work)
    except PolicyError as exc:
        render.print_errors(err, exc.file, exc.errors)
        raise typer.Exit(EXIT_INVALID) from None
    except PolicyConflict as exc:
        err.print(f"[red]conflict:[/] {exc}", highlight=False)
        raise typer.Exit(EXIT_CONFLICT) from None
    except PolicyNotFound as exc:
        err.print(f"[red]not found:[/] {exc}", highlight=False)
        raise typer.Exit(EXIT_NOT_FOUND) from None
    except (aetcd.ClientError, OSError) as exc:
        where = split_credentials(store.endpoints.split(",")[0])[0]  # never print a password
        err.print("[red]error:[/] ", end="")
        err.print(f"cannot reach etcd at {where}: {exc.__class__.__name__}", highlight=False,
                  markup=False)
        raise typer.Exit(EXIT_ETCD) from None


def _load(file: Path, json_out: bool) -> Any:
    try:
        return load_policy_file(file)
    except PolicyError as exc:
        if json_out:
            typer.echo(json.dumps({"file": str(file), "valid": False, "errors": exc.errors}))
        else:
            render.print_errors(err, exc.file, exc.errors)
        raise typer.Exit(EXIT_INVALID) from None


def _echo_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


@app.command()
def validate(
    file: Annotated[Path, typer.Argument(help="Policy file (.yaml, .yml or .json).")],
    json_out: JsonOut = False,
) -> None:
    """Check a policy file; print every problem with its field path (exit 2 if invalid)."""
    policy = _load(file, json_out)
    sections = sorted(canonical_dict(policy))
    sha = policy_sha256(policy)
    if json_out:
        _echo_json({"file": str(file), "valid": True, "errors": [], "sections": sections,
                    "sha256": sha})
        return
    out.print(f"[green]valid[/] {file}: {', '.join(sections)} (sha256 {sha[:12]})",
              highlight=False)


@app.command()
def apply(
    file: Annotated[Path, typer.Argument(help="Policy file (.yaml, .yml or .json).")],
    author: Author = None,
    force: Annotated[bool, typer.Option("--force", help="Write a new version even if the "
                                        "policy equals the current one.")] = False,
    expect_version: Annotated[int | None, typer.Option(
        "--expect-version", min=0, help="Apply only if the current version is this one "
        "(0: none yet); exit 3 otherwise.")] = None,
    etcd: Etcd = None, namespace: Namespace = None, state_dir: StateDir = None,
    json_out: JsonOut = False, key_file: KeyFile = None,
) -> None:
    """Validate FILE and make it the current policy (a new version, signed); prints it."""
    policy = _load(file, json_out)
    store = _store(etcd, namespace, state_dir, sign=True, key_file=key_file)

    async def work() -> tuple[int | None, int]:
        before = await store.current()
        number = await store.apply(policy, str(file), author or getpass.getuser(), force=force,
                                   expect_version=expect_version)
        return (before.version if before else None), number

    before, number = _call(store, work())
    changed = number != before
    if json_out:
        _echo_json({"version": number, "changed": changed, "namespace": store.keys.namespace})
    elif changed:
        out.print(f"applied {file} as v{number} (namespace {store.keys.namespace})",
                  highlight=False)
    else:
        out.print(f"unchanged: {file} equals current v{number}", highlight=False)


@app.command()
def show(
    version: Annotated[int | None, typer.Option("--version", min=1, help="Show this version "
                                                "instead of the current one.")] = None,
    etcd: Etcd = None, namespace: Namespace = None, state_dir: StateDir = None,
    json_out: JsonOut = False,
) -> None:
    """Show the current policy (or --version N) and which components run which version."""
    store = _store(etcd, namespace, state_dir)

    async def work():
        current = await store.current()
        record = await store.get(version) if version else current
        return current, record, await store.statuses()

    current, record, statuses = _call(store, work())
    if record is None:
        err.print(f"no policy applied in namespace {store.keys.namespace!r}")
        raise typer.Exit(EXIT_NOT_FOUND)
    now = current.version if current else None
    refused = [s for s in statuses if not s.ok and s.last_version == now]
    if json_out:
        _echo_json({"current": now, **record.model_dump(mode="json"),
                    "components": [s.model_dump(mode="json") for s in statuses]})
    else:
        render.print_version(out, record, now)
        render.print_statuses(out, statuses, now)
    if refused and version is None:
        raise typer.Exit(EXIT_REFUSED)


def _side(ref: str | None) -> int | dict[str, Any] | None:
    """A diff side: a version number (3 or v3), a policy file's content, or None."""
    if ref is None or ref.lstrip("v").isdigit():
        return None if ref is None else int(ref.lstrip("v"))
    return canonical_dict(_load(Path(ref), False))


async def _resolve(store: PolicyStore, side: int | dict[str, Any] | None,
                   ref: str | None) -> tuple[dict[str, Any], str]:
    """Return a diff side's document and label; a missing version means the current one."""
    if isinstance(side, dict):
        return side, str(ref)
    record = await (store.get(side) if side else store.current())
    if record is None:
        raise PolicyNotFound("no policy applied yet")
    return record.policy, f"v{record.version}"


@app.command()
def diff(
    a: Annotated[str | None, typer.Argument(help="Old side: version (3 or v3) or a policy "
                                            "file (default: the version before B).")] = None,
    b: Annotated[str | None, typer.Argument(help="New side: version or policy file "
                                            "(default: the current version).")] = None,
    etcd: Etcd = None, namespace: Namespace = None, state_dir: StateDir = None,
    json_out: JsonOut = False,
) -> None:
    """Show a unified diff between two versions (default: previous vs current).

    Either side may be a policy file, to preview what `apply` would change.
    """
    store = _store(etcd, namespace, state_dir)
    old, new = _side(a), _side(b)

    async def work() -> str:
        if isinstance(old, dict) or isinstance(new, dict):
            (doc_a, label_a), (doc_b, label_b) = (await _resolve(store, old, a),
                                                  await _resolve(store, new, b))
            return unified_diff(doc_a, doc_b, label_a, label_b)
        return await store.diff(old, new)

    text = _call(store, work())
    if json_out:
        _echo_json({"a": a, "b": b, "diff": text, "equal": not text})
    else:
        render.print_diff(out, text)


@app.command()
def history(
    limit: Annotated[int, typer.Option("--limit", min=1, help="Most versions to list.")] = 20,
    etcd: Etcd = None, namespace: Namespace = None, state_dir: StateDir = None,
    json_out: JsonOut = False,
) -> None:
    """List policy versions, newest first."""
    store = _store(etcd, namespace, state_dir)
    records = _call(store, store.history(limit))
    current = records[0].version if records else None  # `current` is always the newest
    if json_out:
        _echo_json([r.summary() for r in records])
    elif records:
        render.print_history(out, records, current)
    else:
        out.print(f"no policy applied in namespace {store.keys.namespace!r}")


@app.command()
def rollback(
    to: Annotated[int | None, typer.Option("--to", min=1, help="Version whose content to "
                                           "restore (default: the one before current).")] = None,
    author: Author = None,
    etcd: Etcd = None, namespace: Namespace = None, state_dir: StateDir = None,
    json_out: JsonOut = False, key_file: KeyFile = None,
) -> None:
    """Restore an older version's content as a new, signed version (history stays
    append-only)."""
    store = _store(etcd, namespace, state_dir, sign=True, key_file=key_file)

    async def work() -> tuple[int, int]:
        before = await store.current()
        number = await store.rollback(to, author or getpass.getuser())
        return (before.version if before else 0), number

    before, number = _call(store, work())
    target = to if to is not None else before - 1
    if json_out:
        _echo_json({"version": number, "restored": target, "changed": number != before})
    elif number != before:
        out.print(f"rolled back: v{number} has the content of v{target}", highlight=False)
    else:
        out.print(f"unchanged: current v{number} already has the content of v{target}",
                  highlight=False)
