"""The watching core: hooks record evidence, the pipeline turns it into step views.

Data flow: ``hooks`` (install/trim/remove) → ``evidence`` (what arrived, when, in which grad
mode) → ``pipeline`` (one step's gradients gathered, one host transfer) → a
:class:`~gradwatch.checks.StepView` judged by :mod:`gradwatch.checks` → ``findings`` →
``build_report`` → :class:`~gradwatch.Report`. :class:`Watcher` is the lifecycle facade.
"""

# Nothing is imported here: checks import the core's maths (``core.stats``) and the core
# imports the checks, so this package's __init__ must not pull in the watcher.
