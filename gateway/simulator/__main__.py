"""``python -m gateway.simulator --node-json JSON``: one node in its own process."""

from gateway.simulator.cli import child_main

raise SystemExit(child_main())
