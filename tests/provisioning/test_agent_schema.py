"""The OpenAPI schema and the HTTP edge's serializers describe the agent protocol's messages.

The messages are defined once, in `agentprotocol`; these tests keep the schema (what clients are
generated from) and the serializers (the server's validation) from drifting away from them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from drf_spectacular.generators import SchemaGenerator

from agentprotocol import (
    ArtifactCommit,
    ArtifactCommitAnswer,
    ArtifactFile,
    ArtifactUpload,
    ArtifactUploadAnswer,
    ArtifactUploadRequest,
    CommittedFile,
    ContainerReport,
    DatasetMount,
    DesiredRun,
    GpuInfo,
    GpuSample,
    Heartbeat,
    HeartbeatAnswer,
    JoinAnswer,
    MetricLine,
    PublishedPort,
    StagedFile,
    UsageReport,
)
from provisioning.api import serializers


def field_names(message: type) -> set[str]:
    return {f.name for f in dataclasses.fields(message)}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return SchemaGenerator().get_schema(request=None, public=True)


def answer_schema(schema: dict[str, Any], path: str, status: str) -> dict[str, Any]:
    content = schema["paths"][path]["post"]["responses"][status]["content"]
    ref = content["application/json"]["schema"]["$ref"]
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]


def resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    return schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]


def test_the_heartbeat_answer_in_the_schema_is_the_protocols(schema):
    answer = answer_schema(schema, "/api/agent/v1/heartbeat/", "200")
    assert set(answer["properties"]) == field_names(HeartbeatAnswer)
    desired = resolve(schema, answer["properties"]["desired"]["items"])
    assert set(desired["properties"]) == field_names(DesiredRun)


@pytest.mark.parametrize(
    ("path", "request_message", "answer_message"),
    [
        (
            "/api/agent/v1/rentals/{rental_id}/artifacts/uploads/",
            ArtifactUploadRequest,
            ArtifactUploadAnswer,
        ),
        (
            "/api/agent/v1/rentals/{rental_id}/artifacts/commit/",
            ArtifactCommit,
            ArtifactCommitAnswer,
        ),
    ],
)
def test_the_artifact_endpoints_in_the_schema_are_the_protocols(
    schema, path, request_message, answer_message
):
    assert set(answer_schema(schema, path, "200")["properties"]) == field_names(answer_message)
    body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(resolve(schema, body)["properties"]) == field_names(request_message)


def test_the_join_answer_in_the_schema_is_the_protocols(schema):
    answer = answer_schema(schema, "/api/agent/v1/join/", "201")
    assert set(answer["properties"]) == field_names(JoinAnswer)


@pytest.mark.parametrize(
    ("serializer", "message"),
    [
        (serializers.HeartbeatSerializer, Heartbeat),
        (serializers.ContainerReportSerializer, ContainerReport),
        (serializers.UsageReportSerializer, UsageReport),
        (serializers.TelemetrySerializer, GpuSample),
        (serializers.MetricLineSerializer, MetricLine),
        (serializers.ReportedGpuSerializer, GpuInfo),
        (serializers.HeartbeatAnswerSerializer, HeartbeatAnswer),
        (serializers.DesiredRunSerializer, DesiredRun),
        (serializers.JoinAnswerSerializer, JoinAnswer),
        (serializers.PublishedPortSerializer, PublishedPort),
        (serializers.StagedFileSerializer, StagedFile),
        (serializers.DatasetMountSerializer, DatasetMount),
        (serializers.ArtifactFileSerializer, ArtifactFile),
        (serializers.ArtifactUploadRequestSerializer, ArtifactUploadRequest),
        (serializers.ArtifactUploadSerializer, ArtifactUpload),
        (serializers.ArtifactUploadAnswerSerializer, ArtifactUploadAnswer),
        (serializers.CommittedFileSerializer, CommittedFile),
        (serializers.ArtifactCommitSerializer, ArtifactCommit),
        (serializers.ArtifactCommitAnswerSerializer, ArtifactCommitAnswer),
    ],
)
def test_each_serializer_has_exactly_its_messages_fields(serializer, message):
    assert set(serializer().fields) == field_names(message)
