"""Renderers: functions over a :class:`~gradwatch.Report` (console diagnostics and table, HTML,
JUnit, SARIF).

They depend on the report, never the reverse: the report's convenience methods import them
lazily.
"""
