"""``python -m gradwatch``: the same command line as the ``gradwatch`` script."""

from __future__ import annotations

from gradwatch.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
