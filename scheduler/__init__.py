"""Placement: the pure engine (`engine/`), its binding to the database, and the Celery cycle."""
