"""The dev stack: embedded services, the process supervisor and `dev.py up`'s wiring. Not part
of the server: a deployment runs its own PostgreSQL, Redis and object storage."""
