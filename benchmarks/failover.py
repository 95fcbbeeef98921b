"""Failover: the time from killing the primary to the first step committed on the new one.

Starts a primary and a synchronous standby under Patroni over etcd (Debian's
packages, ``make ha``; the pair of ``tests/ha_kit.py``), and a worker process
(``tests/procs/three_steps.py``) that drives ``--runs`` (100) flow runs of
three tool steps, ``--concurrency`` (8) at a time, through the multi-host URL
``target_session_attrs=read-write``. Once ``--kill-after`` (30) runs are
acknowledged, the primary's postmaster is SIGKILLed. Printed:

- promotion: kill to the standby answering as a primary (Patroni's part);
- first new step: kill to the first event committed on the new primary (the
  events table's notification id passing the last one the standby had when
  the primary died), sampled every 10 ms: what a user waits;
- the worker's turns cut short, the tool keys executed twice (in-doubt
  retries), and whether all runs finished.

Usage::

    python benchmarks/failover.py [--runs 100] [--concurrency 8] [--kill-after 30]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))
import ha_kit  # noqa: E402

from kuralle_es import RunStore  # noqa: E402

WORKER = TESTS / "procs" / "three_steps.py"


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def head(dsn: str) -> int | None:
    """The events table's last notification id on the server ``dsn`` names."""
    try:
        with psycopg.connect(dsn, connect_timeout=1, autocommit=True) as conn:
            row = conn.execute("SELECT max(notification_id) FROM runstore_events").fetchone()
    except psycopg.Error:
        return None
    return int(row[0] or 0) if row else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kill-after", type=int, default=30)
    args = parser.parse_args()
    why = ha_kit.missing()
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    pair = ha_kit.HaPair()
    work = Path(tempfile.mkdtemp(prefix="kuralle-failover-"))
    try:
        pair.start()
        dbname = f"kuralle_failover_{uuid.uuid4().hex[:8]}"
        pair.create_database(dbname)
        url = pair.url(dbname)
        RunStore.from_url(url).close()
        ledger, acks = work / "ledger.jsonl", work / "acks.jsonl"
        started = time.monotonic()
        worker = subprocess.Popen(
            [sys.executable, str(WORKER), url, str(ledger), str(acks),
             str(args.runs), str(args.concurrency)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        while len(lines(acks)) < args.kill_after:
            if worker.poll() is not None:
                print(worker.communicate()[1][-2000:], file=sys.stderr)
                return 1
            time.sleep(0.01)
        old = pair.primary()
        assert old is not None
        standby = next(name for name in pair.nodes if name != old)
        pair.kill_postmaster(old)
        killed = time.monotonic()
        replicated = head(pair.dsn(standby, dbname)) or 0
        new_dsn = pair.dsn(standby, dbname)
        promoted = None
        first_step = None
        while first_step is None and time.monotonic() - killed < 120:
            if promoted is None and pair.primary() == standby:
                promoted = time.monotonic()
            found = head(new_dsn)
            if found is not None and found > replicated:
                first_step = time.monotonic()
            time.sleep(0.01)
        out, err = worker.communicate(timeout=300)
        elapsed = time.monotonic() - started
        if worker.returncode != 0:
            print(err[-2000:], file=sys.stderr)
            return 1
        summary = json.loads(out.strip().splitlines()[-1])
        keys: dict[str, int] = {}
        for entry in lines(ledger):
            keys[entry["key"]] = keys.get(entry["key"], 0) + 1
        twice = sum(1 for count in keys.values() if count > 1)
        print(
            f"{args.runs} runs of 3 tool steps, {args.concurrency} at a time, primary {old} "
            f"killed after {args.kill_after} were acknowledged ({elapsed:.1f} s in all)"
        )
        if promoted is not None:
            print(f"promotion: {promoted - killed:.2f} s after the kill (Patroni, loop_wait 1 s)")
        if first_step is not None:
            print(f"first new committed step: {first_step - killed:.2f} s after the kill")
        print(
            f"runs finished: {summary['finished']} / {args.runs}; turns cut short: "
            f"{summary['failed_turns']} {summary['errors']}; tool keys executed twice "
            f"(in-doubt retries): {twice} of {len(keys)}"
        )
        return 0
    finally:
        pair.stop()


if __name__ == "__main__":
    raise SystemExit(main())
