#!/bin/sh
# Every benchmark of benchmarks/RESULTS.md, in order, with its output kept under
# benchmarks/results/ (text, JSON for the chart) and the chart drawn last.
# PYTHON: an interpreter with this checkout and its bench extra installed
# (pip install -e '.[bench]'); default .venv/bin/python.
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT=benchmarks/results
mkdir -p "$OUT"
"$PY" benchmarks/journal_overhead.py --breakdown 2>&1 | tee "$OUT/journal_overhead.txt"
"$PY" benchmarks/peers.py --json "$OUT/peers.json" 2>&1 | tee "$OUT/peers.txt"
"$PY" benchmarks/save_parts.py 2>&1 | tee "$OUT/save_parts.txt"
"$PY" benchmarks/long_runs.py --json "$OUT/long_runs.json" 2>&1 | tee "$OUT/long_runs.txt"
"$PY" benchmarks/throughput.py --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.txt"
"$PY" benchmarks/long_conversations.py 2>&1 | tee "$OUT/long_conversations.txt"
"$PY" benchmarks/search_runs.py 2>&1 | tee "$OUT/search_runs.txt"
"$PY" benchmarks/streaming.py 2>&1 | tee "$OUT/streaming.txt"
"$PY" benchmarks/chart.py "$OUT/peers.json" "$OUT/long_runs.json" --out benchmarks/results.png
