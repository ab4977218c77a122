"""Entry point: `python -m nodeagent [flags]` or the `gpumarket-agent` console script."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from nodeagent.agent import EXIT_ERROR, Agent
from nodeagent.config import ConfigError, load_config
from nodeagent.logs import configure_logging


def main(argv: Sequence[str] | None = None) -> int:
    """Run the agent; the return value is the process exit status."""
    try:
        config = load_config(argv)
    except ConfigError as exc:
        configure_logging()
        logging.getLogger("nodeagent").error("bad configuration", extra={"error": str(exc)})
        return EXIT_ERROR
    configure_logging(config.log_level, log_format=config.log_format)
    try:
        agent = Agent(config)
    except OSError as exc:  # the state directory cannot be created or read
        logging.getLogger("nodeagent").error("cannot start", extra={"error": str(exc)})
        return EXIT_ERROR
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
