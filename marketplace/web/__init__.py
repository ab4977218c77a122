"""The customer web UI: server-rendered pages whose actions call the REST API."""
