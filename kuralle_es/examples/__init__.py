"""Runnable examples of kuralle_es."""
