from __future__ import annotations

from deltaq.cli import main

raise SystemExit(main())
