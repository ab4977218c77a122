"""The OpenAPI schema and the HTTP edge's serializers describe the agent protocol's messages.

The messages are defined once, in `agentprotocol`; these tests keep the schema (what clients are
generated from) and the serializers (the server's validation) from drifting away from them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from drf_spectacular.generators import SchemaGenerator
from hypothesis import given, settings
from hypothesis import strategies as st
from rest_framework import serializers as rf_serializers

from agentprotocol import (
    ArtifactCommit,
    ArtifactCommitAnswer,
    ArtifactFile,
    ArtifactUpload,
    ArtifactUploadAnswer,
    ArtifactUploadRequest,
    CachedImage,
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
    PullProgress,
    StagedFile,
    UsageReport,
    WakeChannel,
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
        (serializers.PullProgressSerializer, PullProgress),
        (serializers.CachedImageSerializer, CachedImage),
        (serializers.WakeChannelSerializer, WakeChannel),
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


# Values of every kind a JSON body can hold, near and past the telemetry fields' bounds.
_JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 40), max_value=1 << 40),
    st.sampled_from([0, 1, 100, 101, 255, 256, -273, -274, 1 << 24, (1 << 24) + 1, (1 << 31) - 1,
                     1 << 31, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 100.0, 100.5, -273.0, 1e10, 1e10 + 1e-3, 1.5e9]),
    st.text(max_size=8),
    st.sampled_from(["5", "5.0", "1e3", "true", "nan"]),
    st.lists(st.integers(), max_size=2),
)  # fmt: skip
_SAMPLE_KEYS = [f.name for f in dataclasses.fields(GpuSample)]


def _drf_answer(data: Any) -> tuple[str, Any]:
    """What DRF's own field-by-field path gives for one telemetry element."""
    element = serializers.TelemetrySerializer()
    try:
        return "valid", rf_serializers.Serializer.run_validation(element, data)
    except rf_serializers.ValidationError as exc:
        return "refused", exc.detail


def _answer(data: Any) -> tuple[str, Any]:
    element = serializers.TelemetrySerializer()
    try:
        return "valid", element.run_validation(data)
    except rf_serializers.ValidationError as exc:
        return "refused", exc.detail


# A valid value of each field of a GPU sample.
_VALID = {
    "gpu_index": st.integers(0, 255),
    "ts": st.floats(0, 1e10) | st.integers(0, 10**10),
    "util_pct": st.floats(0, 100),
    "mem_used_mb": st.integers(0, 1 << 24),
    "power_w": st.floats(0, 100_000),
    "temp_c": st.floats(-273, 1000),
    "ecc_errors": st.integers(0, (1 << 31) - 1),
    "xid_errors": st.integers(0, (1 << 31) - 1),
    "healthy": st.booleans(),
}
_REQUIRED = ["gpu_index", "ts", "util_pct", "mem_used_mb", "power_w", "temp_c"]


_VALID_SAMPLES = st.builds(
    lambda required, optional: {**required, **optional},
    st.fixed_dictionaries({key: _VALID[key] for key in _REQUIRED}),
    st.fixed_dictionaries(
        {}, optional={key: _VALID[key] for key in ("ecc_errors", "xid_errors", "healthy")}
    ),
)


@given(
    sample=_VALID_SAMPLES,
    # a valid sample with one or two values replaced by anything JSON can hold, or removed
    changes=st.lists(
        st.tuples(st.sampled_from([*_SAMPLE_KEYS, "extra"]), st.none() | st.just("del")),
        min_size=1,
        max_size=2,
    ),
    values=st.lists(_JSON_SCALARS, min_size=2, max_size=2),
)
@settings(max_examples=1500, deadline=None)
def test_a_gpu_sample_checked_in_one_pass_gets_drfs_answer(sample, changes, values):
    for (key, how), value in zip(changes, values, strict=False):
        if how == "del":
            sample.pop(key, None)
        else:
            sample[key] = value
    assert _answer(sample) == _drf_answer(sample)


@given(sample=_VALID_SAMPLES)
@settings(max_examples=300, deadline=None)
def test_a_valid_gpu_sample_is_checked_in_one_pass(sample):
    plan = serializers._scalar_plan(serializers.TelemetrySerializer())
    checked = serializers._scalar_checked(plan, sample)
    assert checked is not None
    status, drf = _drf_answer(sample)
    assert status == "valid"
    assert list(checked.items()) == list(drf.items())
    assert [type(v) for v in checked.values()] == [type(v) for v in drf.values()]


def test_the_heartbeats_scalar_elements_are_checked_in_one_pass():
    """A field added to the sample of a kind the one pass cannot check (or a validate method)
    would silently turn it off: it stays on for the telemetry element."""
    assert len(serializers._scalar_plan(serializers.TelemetrySerializer())) == len(_SAMPLE_KEYS)


_RENTAL = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
# A valid element of each report kind a busy heartbeat carries many of.
_REPORTS: dict[type, dict[str, Any]] = {
    serializers.ContainerReportSerializer: {
        "rental_id": _RENTAL, "run_id": "r1", "status": "running", "exit_code": None,
        "started_at": 1.0e9, "finished_at": None, "log_tail": "", "published": [], "error": "",
    },
    serializers.UsageReportSerializer: {
        "seq": 1, "rental_id": _RENTAL, "run_id": "r1", "gpu_count": 2, "started_at": 1.0e9,
        "confirmed_at": 1.0e9 + 5, "final": False,
    },
    serializers.MetricLineSerializer: {"rental_id": _RENTAL, "run_id": "r1", "line": '{"a": 1}'},
    serializers.LogLineSerializer: {"rental_id": _RENTAL, "run_id": "r1", "line_no": 0,
                                    "line": "hello"},
    serializers.PullProgressSerializer: {"rental_id": _RENTAL, "run_id": "r1", "done_bytes": 1,
                                         "total_bytes": 2},
    serializers.CachedImageSerializer: {"ref": "img:1", "digest": "sha256:x", "size_bytes": 3},
}  # fmt: skip
# Texts near what the text, UUID and choice fields accept and refuse.
_TEXTS = st.one_of(
    st.text(max_size=12),
    st.sampled_from([
        "", " ", "  a  ", "a\x00b", "a\ud800b", "\ud800", "x" * 128, "x" * 129, "x" * 4097,
        "running", "exited", "missing", "bogus", "RUNNING", _RENTAL, _RENTAL.replace("-", ""),
        "{" + _RENTAL + "}", "urn:uuid:" + _RENTAL, _RENTAL[:-1], "\t\n",
    ]),
    st.lists(st.fixed_dictionaries({"container_port": st.just(22), "host": st.just("h"),
                                    "host_port": st.integers(0, 2)}), max_size=1),
)  # fmt: skip


def _checked(cls: type, data: Any, *, drf: bool) -> tuple[str, Any]:
    element = cls()
    try:
        if drf:
            return "valid", rf_serializers.Serializer.run_validation(element, data)
        return "valid", element.run_validation(data)
    except rf_serializers.ValidationError as exc:
        return "refused", exc.detail


@given(
    kind=st.sampled_from(list(_REPORTS)),
    changes=st.lists(
        st.tuples(st.integers(0, 20), st.none() | st.just("del")), min_size=0, max_size=2
    ),
    values=st.lists(_JSON_SCALARS | _TEXTS, min_size=2, max_size=2),
)
@settings(max_examples=3000, deadline=None)
def test_a_report_checked_in_one_pass_gets_drfs_answer(kind, changes, values):
    element = dict(_REPORTS[kind])
    keys = [*element, "extra"]
    for (index, how), value in zip(changes, values, strict=False):
        key = keys[index % len(keys)]
        if how == "del":
            element.pop(key, None)
        else:
            element[key] = value
    assert _checked(kind, element, drf=False) == _checked(kind, element, drf=True)


@pytest.mark.parametrize("kind", list(_REPORTS))
def test_a_valid_report_is_checked_in_one_pass(kind):
    plan = serializers._scalar_plan(kind())
    assert len(plan) == len(kind().fields)
    checked = serializers._scalar_checked(plan, _REPORTS[kind])
    assert checked is not None
    status, drf = _checked(kind, _REPORTS[kind], drf=True)
    assert status == "valid" and checked == drf
    assert [type(v) for v in checked.values()] == [type(drf[k]) for k in checked]
