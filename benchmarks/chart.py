"""Draw benchmarks/results.png from the JSON files of peers.py and long_runs.py.

Left: µs per step of a 100-step run of no-op tool steps, per system, with
the raw INSERT+COMMIT floors (``peers.py --json``). Right: resume time of a
run vs its length, kuralle_es (fresh process: load + replay + finish) next to
DBOS's recovery, log-log (``long_runs.py --json``).

Usage: ``python benchmarks/chart.py PEERS.json LONG_RUNS.json [--out benchmarks/results.png]``
(matplotlib comes with the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("peers")
    parser.add_argument("long_runs")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results.png")))
    args = parser.parse_args()
    peers = json.loads(Path(args.peers).read_text())
    long_runs = json.loads(Path(args.long_runs).read_text())

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    per_step = peers["per_step_us"]
    labels = list(per_step)
    values = [per_step[k] / 1e3 for k in labels]
    colors = [
        "#999999" if k.startswith("floor") else "#1f77b4" if k.startswith("kuralle") else "#d62728"
        for k in labels
    ]
    bars = left.barh(range(len(labels)), values, color=colors)
    left.set_yticks(range(len(labels)), [k.replace(" (", "\n(") for k in labels], fontsize=8)
    left.invert_yaxis()
    left.bar_label(bars, [f"{v:.2f}" for v in values], fontsize=8, padding=2)
    left.set_xlabel("ms per step (median)")
    left.set_title(
        f"Per step: {peers['steps']}-step runs of no-op tool steps\n"
        f"(PostgreSQL, median of {peers['rounds']} interleaved rounds)",
        fontsize=10,
    )

    rows = [r for r in long_runs["lengths"] if r.get("shape", "one node") == "one node"]
    spread = [r for r in long_runs["lengths"] if r.get("shape") == "nodes of 100"]
    steps = [r["steps"] for r in rows]
    right.plot(steps, [r["resume_ms"] for r in rows], "o-", label="kuralle_es resume, one node")
    right.plot(steps, [r["load_ms"] for r in rows], "s--", label="kuralle_es load alone, one node")
    if spread:
        right.plot(
            [r["steps"] for r in spread],
            [r["resume_ms"] for r in spread],
            "o-",
            color="#2ca02c",
            label="kuralle_es resume, nodes of 100 steps",
        )
    dbos = [(r["steps"], r["dbos_recovery_ms"]) for r in rows if r["dbos_recovery_ms"]]
    if dbos:
        right.plot(
            [s for s, _ in dbos],
            [v for _, v in dbos],
            "^-",
            color="#d62728",
            label="DBOS recovery (after launch)",
        )
        right.plot(
            [r["steps"] for r in rows if r["dbos_launch_ms"]],
            [r["dbos_launch_ms"] for r in rows if r["dbos_launch_ms"]],
            ":",
            color="#d62728",
            label="DBOS launch (a new process, before recovery)",
        )
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("steps in the run")
    right.set_ylabel("ms (median)")
    right.set_title("Resume vs run length (PostgreSQL)", fontsize=10)
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
