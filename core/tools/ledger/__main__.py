"""``python -m openinfer.tools.ledger``."""

from openinfer.tools.ledger.cli import main

raise SystemExit(main())
