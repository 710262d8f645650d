"""The torch engine's default thread count: OMP_NUM_THREADS when set, else the usable
cores divided among the component's replicas."""

from __future__ import annotations

import os

import pytest

from splitserve.components.engines.torch_cpu import default_num_threads

pytestmark = pytest.mark.unit


def test_omp_num_threads_wins_when_set(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_num_threads() == 3
    assert default_num_threads(replicas=4) == 3


@pytest.mark.parametrize("value", [None, "", "0", "two", "-1"])
def test_otherwise_the_usable_cores_shared_among_replicas(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    cores = len(os.sched_getaffinity(0))
    assert default_num_threads() == cores
    assert default_num_threads(replicas=2) == max(1, cores // 2)
    assert default_num_threads(replicas=cores * 4) == 1
