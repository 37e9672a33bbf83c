"""``python -m kvgateway.simulator --node-json JSON``: one node in its own process."""

from kvgateway.simulator.cli import child_main

raise SystemExit(child_main())
