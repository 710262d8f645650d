"""How ``dynamo policy`` prints for people: rich tables and highlighted YAML.

Scripts use ``--json``; these functions are only called on the human path.
"""

from __future__ import annotations

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from splitserve.components.policy.canonical import canonical_yaml
from splitserve.components.policy.records import ComponentStatus, PolicyVersion


def print_errors(console: Console, file: str, errors: list[str]) -> None:
    """Print a file's validation errors, one ``path: message`` per line."""
    console.print(f"[red]invalid[/] {file}: {len(errors)} problem(s)", highlight=False)
    for line in errors:
        console.print(f"  {line}", highlight=False, markup=False)


def print_version(console: Console, record: PolicyVersion, current: int | None) -> None:
    """Print one version's metadata line and its canonical YAML."""
    tag = " (current)" if record.version == current else ""
    note = f", rollback to v{record.rollback_of}" if record.rollback_of else ""
    console.print(f"[bold]v{record.version}{tag}[/] applied {record.created_at:%Y-%m-%d %H:%M:%S}"
                  f" UTC by {record.author or '-'} from {record.source}{note}  "
                  f"sha256 {record.sha256[:12]}", highlight=False)
    console.print(Syntax(canonical_yaml(record.policy), "yaml", background_color="default"))


def print_statuses(console: Console, statuses: list[ComponentStatus], current: int | None) -> None:
    """Print which component instance runs which version, and who refused one."""
    if not statuses:
        console.print("no component instance reports a policy status")
        return
    table = Table(title="components")
    for column in ("component", "instance", "running", "last attempt", "state", "reason",
                   "updated (UTC)"):
        table.add_column(column)
    for s in statuses:
        if not s.ok:
            state = "[red]refused[/]"
        elif s.running_version == current:
            state = "[green]current[/]"
        else:
            state = "[yellow]behind[/]"
        table.add_row(s.component, s.instance, _v(s.running_version), _v(s.last_version), state,
                      "" if s.ok else s.reason, f"{s.updated_at:%H:%M:%S}")
    console.print(table)


def print_history(console: Console, records: list[PolicyVersion], current: int | None) -> None:
    """Print versions newest first."""
    table = Table(title="policy versions")
    for column in ("version", "applied (UTC)", "author", "source", "sha256", ""):
        table.add_column(column)
    for r in records:
        notes = ["current"] if r.version == current else []
        if r.rollback_of:
            notes.append(f"= v{r.rollback_of}")
        table.add_row(f"v{r.version}", f"{r.created_at:%Y-%m-%d %H:%M:%S}", r.author or "-",
                      r.source, r.sha256[:12], ", ".join(notes))
    console.print(table)


def print_diff(console: Console, text: str) -> None:
    """Print a unified diff, or say there is no difference."""
    if not text:
        console.print("no differences")
        return
    console.print(Syntax(text, "diff", background_color="default"))


def _v(version: int | None) -> str:
    return "-" if version is None else f"v{version}"
