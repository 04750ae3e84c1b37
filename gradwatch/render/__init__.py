"""Renderers: functions over a :class:`~gradwatch.Report` (console, HTML, JUnit).

They depend on the report, never the reverse: the report's convenience methods import them
lazily.
"""
