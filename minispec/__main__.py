"""python -m minispec: see minispec.cli."""

from .cli import main

raise SystemExit(main())
