# The two commands of the README: `make demo` and `make test`.
# Both create .venv and install the project with its dev extra first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test docs lint typecheck bench clean browser faketime pgbouncer ha test-pgbouncer

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kuralle-es demo

# The dashboard's browser tests drive Debian's Chromium (never a downloaded build).
# Installed here where it is missing and we are root (CI is); elsewhere those tests
# skip with the reason, except under CI=true or KURALLE_REQUIRE_POSTGRES=1, where they fail.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			chromium chromium-driver >/dev/null \
		|| echo "make browser: could not install chromium and chromium-driver with apt-get"; \
	else echo "make browser: no /usr/bin/chromium and not root: the browser tests will skip"; fi

# The lease tests run a worker under Debian's faketime (libfaketime: a clock that
# runs ahead) to prove that only the database server's clock decides a lease.
# Installed here where it is missing and we are root; under CI=true a faketime
# that cannot be had fails the build, elsewhere those tests skip with the reason.
faketime:
	@if command -v faketime >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			faketime >/dev/null; then :; \
	elif [ "$$CI" = true ]; then echo "make faketime: cannot install Debian's faketime" >&2; exit 1; \
	else echo "make faketime: no faketime and cannot install it: the clock-skew lease tests will skip"; fi

# PgBouncer (transaction pooling in front of the test server) and a high-availability
# pair (Patroni over etcd: a primary and a synchronous standby) for the connection
# tests (docs/high-availability.md). Installed like faketime: under CI=true a
# package that cannot be had fails the build, elsewhere those tests skip with the reason.
pgbouncer:
	@if [ -x /usr/sbin/pgbouncer ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends pgbouncer >/dev/null; then :; \
	elif [ "$$CI" = true ]; then echo "make pgbouncer: cannot install Debian's pgbouncer" >&2; exit 1; \
	else echo "make pgbouncer: no pgbouncer and cannot install it: the PgBouncer tests will skip"; fi

ha:
	@if [ -x /usr/bin/patroni ] && [ -x /usr/bin/etcd ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends patroni etcd-server >/dev/null; then :; \
	elif [ "$$CI" = true ]; then echo "make ha: cannot install Debian's patroni and etcd-server" >&2; exit 1; \
	else echo "make ha: no patroni/etcd and cannot install them: the failover tests will skip"; fi

test: $(STAMP) browser faketime pgbouncer ha
	$(BIN)/ruff check kuralle_es tests benchmarks
	$(BIN)/ruff format --check kuralle_es tests benchmarks
	$(BIN)/mypy kuralle_es
	$(BIN)/mkdocs build --strict --quiet
	$(BIN)/pytest -q

# The whole PostgreSQL part of the suite once more, every database reached through
# PgBouncer in transaction mode (tests/conftest.py, KURALLE_TEST_PGBOUNCER): about
# 11 minutes on 2 cores, so not part of `make test` (which runs the pgbouncer-marked tests).
test-pgbouncer: $(STAMP) pgbouncer
	KURALLE_TEST_PGBOUNCER=1 KURALLE_REQUIRE_POSTGRES=1 $(BIN)/pytest -q -m postgres

# The documentation site (docs/ -> build/site); strict: a broken reference fails.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python benchmarks/journal_overhead.py

clean:
	rm -rf $(VENV) .demo .pytest_cache .mypy_cache .ruff_cache .hypothesis
