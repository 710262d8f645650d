"""The project's one reader of Prometheus text exposition (``/metrics``).

Everything that reads a scrape — the planner's metrics source, ``dynamo qos
calibration``, the graph runner of tests and benchmarks, the e2e helpers, the
benchmarks — parses it here, with ``prometheus_client``'s own parser, and asks the
questions below of the result.  No I/O: callers fetch the text with the HTTP client
they already use (sync or async) and hand it to ``parse``.

Names are the samples' own, as written in the text: a counter's ``foo_total``, a
histogram's ``foo_bucket`` (its ``le`` among the labels), ``foo_sum`` and
``foo_count``, a ``foo_created`` gauge.  ``prometheus_client``'s parser names a
counter family without ``_total`` and, for a counter typed without it (``# TYPE foo
counter`` / ``foo 1``, as some Dynamo runtimes export), renames the samples to
``foo_total``; ``parse`` undoes that, so such a counter is read as ``foo``.

Labels follow Prometheus's data model: a label that a sample lacks is the same as
that label with the empty value (matters to ``value``, ``by_label`` and
``histogram`` only when asked about a label the samples do not carry).  Values are
floats; ``NaN`` and ``±Inf`` are kept as they are, so a sum with a ``NaN`` sample is
``NaN``.  A missing metric is not an error: it sums to 0.

Stands on the lowest floor: imports nothing of the project.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Histogram", "Labels", "Samples", "bucket_quantile", "by_label", "histogram",
           "parse", "totals", "value"]

Labels = tuple[tuple[str, str], ...]
"""A sample's labels as sorted (name, value) pairs: ``(("outcome", "done"),)``."""

Samples = dict[str, dict[Labels, float]]
"""One scrape: sample name -> labels -> value."""


def _bare_counters(text: str) -> set[str]:
    """Counters whose ``# TYPE`` line names them without ``_total``."""
    out = set()
    for line in text.splitlines():
        parts = line.split()
        if parts[:2] == ["#", "TYPE"] and parts[3:] == ["counter"] \
                and not parts[2].endswith("_total"):
            out.add(parts[2])
    return out


def parse(text: str) -> Samples:
    """Every sample of one scrape, by sample name (as written) then sorted labels.

    Called once per scrape with the ``/metrics`` body; the other functions here read
    its result.  Returns ``{name: {labels: value}}``; a label set given twice keeps
    the later value.  Raises ``ValueError`` on text that is not Prometheus exposition.
    """
    bare = _bare_counters(text)
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        written = family.type == "counter" and family.name in bare
        for sample in family.samples:
            name = family.name if written else sample.name
            out.setdefault(name, {})[tuple(sorted(sample.labels.items()))] = float(sample.value)
    return out


def _matches(key: Labels, labels: Mapping[str, str]) -> bool:
    have = dict(key)
    return all(have.get(k, "") == v for k, v in labels.items())


def value(samples: Samples, name: str, /, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``.

    Called for one number of a scrape: a counter or gauge, narrowed by some labels
    (``value(s, "splitserve_router_released_total", outcome="ok")``) or summed over
    all its label sets (no ``labels``).  Returns 0.0 when no sample matches.
    """
    return sum((v for key, v in samples.get(name, {}).items() if _matches(key, labels)), 0.0)


def by_label(samples: Samples, name: str, label: str, /, **labels: str) -> dict[str, float]:
    """The samples named ``name`` whose labels include ``labels``, summed by the value
    of ``label``.

    Called for a breakdown: decisions by worker, admissions by outcome, refusals by
    reason among ``outcome="rejected"``.  Returns ``{label value: sum}`` (samples
    without ``label`` under ``""``); empty when no sample matches.
    """
    out: dict[str, float] = {}
    for key, v in samples.get(name, {}).items():
        if _matches(key, labels):
            group = dict(key).get(label, "")
            out[group] = out.get(group, 0.0) + v
    return out


def totals(samples: Samples) -> dict[str, float]:
    """Every sample name with its samples summed over their label sets.

    Called where labels do not matter (the planner: a worker's queue, the frontend's
    request and token counters, a histogram's ``_sum`` and ``_count``).  Returns
    ``{name: sum}``, one entry per name in the scrape.
    """
    return {name: sum(series.values(), 0.0) for name, series in samples.items()}


def bucket_quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """The smallest bucket bound whose cumulative count reaches ``q`` of the total.

    ``buckets``: upper bound -> cumulative count (``Histogram.buckets``, or several
    added up); the total is the count of the largest bound (``+Inf``).  An estimate
    from above, no interpolation inside a bucket; it is ``inf`` when the quantile
    lies beyond the last finite bound.  Returns None when there are no observations.
    """
    cum = sorted(buckets.items())
    total = cum[-1][1] if cum else 0.0
    if not total > 0:
        return None
    return next(le for le, n in cum if n >= q * total)


@dataclass(frozen=True)
class Histogram:
    """One histogram of a scrape, summed over the label sets asked for."""

    buckets: dict[float, float] = field(default_factory=dict)
    """Upper bound (``le``; ``+Inf`` as ``math.inf``) -> cumulative count."""
    count: float = 0.0
    sum: float = 0.0

    def quantile(self, q: float) -> float | None:
        """``bucket_quantile`` of this histogram's buckets."""
        return bucket_quantile(self.buckets, q)


def histogram(samples: Samples, name: str, /, **labels: str) -> Histogram:
    """The histogram ``name`` (its ``name_bucket``, ``name_count`` and ``name_sum``
    samples), summed over the label sets that include ``labels``.

    Called to read a latency or error distribution (``dynamo qos calibration``: the
    log2 prediction error of one ``kind``).  Returns an empty ``Histogram`` (no
    buckets, count and sum 0) when the scrape has none.
    """
    buckets: dict[float, float] = {}
    for key, v in samples.get(f"{name}_bucket", {}).items():
        if _matches(key, labels):
            le = float(dict(key)["le"])
            buckets[le] = buckets.get(le, 0.0) + v
    return Histogram(dict(sorted(buckets.items())), value(samples, f"{name}_count", **labels),
                     value(samples, f"{name}_sum", **labels))
