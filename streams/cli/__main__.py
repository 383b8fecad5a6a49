"""`python -m streams.cli`: the same as the `loopwatch` script."""

from streams.cli.main import main

raise SystemExit(main())
