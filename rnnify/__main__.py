"""``python -m rnnify``: the same command line as the ``rnnify`` script."""

from rnnify.cli import main

raise SystemExit(main())
