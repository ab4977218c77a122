"""Provisioning writes, one module per concern: joining nodes (`join`), agent heartbeats
(`heartbeat`), the telemetry buffer (`telemetry`) and the periodic node and rental sweeps
(`sweeps`), artifact sync (`artifacts`), measured runs handed to the advisor's calibration
(`calibration`). Rental state changes go through marketplace.lifecycle."""

from provisioning.services.artifacts import artifact_uploads_for_node, artifacts_commit_for_node
from provisioning.services.calibration import advisor_runs_calibrate
from provisioning.services.gangs import gangs_start_timeout
from provisioning.services.health import (
    gpus_health_apply,
    nodes_benchmark_schedule,
    sample_verdict,
)
from provisioning.services.heartbeat import (
    HeartbeatReports,
    benchmark_record,
    desired_state,
    heartbeat_interval_s,
    idle_heartbeat_interval_s,
    metrics_store,
    node_heartbeat,
    node_heartbeat_by_token,
    run_id_for,
)
from provisioning.services.join import (
    HostFacts,
    catalog_match,
    join_token_create,
    node_authenticate,
    node_credential_revoke,
    node_join,
)
from provisioning.services.logs import run_logs_expire, run_logs_store
from provisioning.services.reliability import nodes_reliability_update
from provisioning.services.sweeps import (
    nodes_mark_silent,
    rentals_end_booked_time,
    rentals_release_stopped,
)
from provisioning.services.telemetry import (
    TELEMETRY_BUFFER_KEY,
    telemetry_buffer,
    telemetry_flush,
    telemetry_outbox_discard,
    telemetry_outbox_push,
)

__all__ = [
    "TELEMETRY_BUFFER_KEY",
    "HeartbeatReports",
    "HostFacts",
    "advisor_runs_calibrate",
    "artifact_uploads_for_node",
    "artifacts_commit_for_node",
    "benchmark_record",
    "catalog_match",
    "desired_state",
    "gangs_start_timeout",
    "gpus_health_apply",
    "heartbeat_interval_s",
    "idle_heartbeat_interval_s",
    "join_token_create",
    "metrics_store",
    "node_authenticate",
    "node_credential_revoke",
    "node_heartbeat",
    "node_heartbeat_by_token",
    "node_join",
    "nodes_benchmark_schedule",
    "nodes_mark_silent",
    "nodes_reliability_update",
    "rentals_end_booked_time",
    "rentals_release_stopped",
    "run_id_for",
    "run_logs_expire",
    "run_logs_store",
    "sample_verdict",
    "telemetry_buffer",
    "telemetry_flush",
    "telemetry_outbox_discard",
    "telemetry_outbox_push",
]
