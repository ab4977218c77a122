"""The node agent: the program on each GPU host (`python -m nodeagent`, `gpumarket-agent`).

It joins the server once with a provider's join token, then heartbeats: telemetry, the state of its
runs, usage and metrics go up; the desired state comes back, and the agent reconciles the runtime
(Docker Engine or host processes) towards it. See `agent` for the round, `reconcile` for the
decisions, `spool` for what survives restarts. No Django import: hosts run without the web stack.
"""
