"""The run: the watcher, the step pipeline, the views, and the checks' judges.

Data flow: ``capture`` (hooks record evidence) → ``core/gather.py`` (one step's gradients
read, one host transfer) → ``core/steps.py`` builds a :class:`~gradwatch.checks.StepView`
→ ``core/findings.py`` (``Judges``) hands views and facts to :mod:`gradwatch.checks`, which
write findings → ``core/build_report.py`` → :class:`~gradwatch.Report`. :class:`Watcher`
(``core/watcher.py``) is the lifecycle facade; ``core/adapter_api.py`` its public API for
integrations. CONTRIBUTING.md draws the layers.
"""
