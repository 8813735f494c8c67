"""``python -m tokenbudget``: the ``tokenbudget`` command."""

from tokenbudget.cli import main

raise SystemExit(main())
