"""Flows and entry points shared by the tests and their child OS processes."""
