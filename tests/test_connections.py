"""A store's connections do not grow with its partitions: counted on the server.

``benchmarks/connections.py`` drives 32 runs at once on a store of four
partitions, then runs ``kuralle-es runs list`` on it, while it samples
``pg_stat_activity``; the store may hold at most its ``pool_size`` (10)
connections at once, the read-only command at most two.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kuralle_es import InvalidArgumentError, RunStore

pytestmark = pytest.mark.postgres

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "connections.py"


def test_a_four_partition_store_under_32_runs_holds_at_most_10_connections(pg_dsn: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--dsn", pg_dsn, "--seconds", "2", "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["runs_finished"] >= 32, counts
    assert 1 <= counts["store"] <= 10, counts
    assert 1 <= counts["runs_list"] <= 2, counts


def test_pool_size_is_a_whole_number_of_two_or_more(pg_dsn: str) -> None:
    with RunStore.from_url(f"{pg_dsn}?pool_size=3") as store:
        connections = store.partitions[0].connections
        assert connections is not None
        assert (connections.blocking_size, connections.loop_size) == (2, 1)
    for bad in (1, 0, "ten"):
        with pytest.raises(InvalidArgumentError, match="pool_size"):
            RunStore.postgres(pg_dsn, pool_size=bad)  # type: ignore[arg-type]
