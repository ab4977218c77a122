"""Provisioning: the agent API, the node agent, runtime drivers, telemetry sources."""
