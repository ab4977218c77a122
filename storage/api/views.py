"""Datasets and artifacts over the REST API: serializers and thin views around one service or
selector call each.

Uploading a dataset: POST /datasets/ with the files' paths, sizes and SHA-256 answers where to
put each (a presigned PUT, or a multipart upload with one presigned URL per part); the client
PUTs the bytes to the bucket, then POSTs /datasets/<id>/complete/ with each multipart file's
part ETags. /datasets/<id>/uploads/ gives fresh URLs for files not yet stored. A dataset from a
URL: POST /datasets/ with `source_url` instead of `files` (checked at once, fetched by a worker).
"""

from __future__ import annotations

import dataclasses

from django.http import HttpResponseRedirect
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.tenancy import request_team
from core.api.fields import NameField, refuse_unknown
from core.api.pagination import PaginatedListView
from core.errors import NotFound
from storage import objectstore, selectors
from storage import services as storage


class DatasetFileInSerializer(serializers.Serializer):
    path = serializers.CharField(max_length=1024, trim_whitespace=False)
    size_bytes = serializers.IntegerField(min_value=0, max_value=1 << 50)
    sha256 = serializers.RegexField(r"^[0-9a-f]{64}$", help_text="hex, lowercase")


class DatasetCreateSerializer(serializers.Serializer):
    name = NameField(max_length=200, trim_whitespace=False)
    files = DatasetFileInSerializer(many=True, required=False, max_length=10_000)
    source_url = serializers.CharField(
        max_length=2000, required=False, help_text="an https URL (an S3 object: a presigned URL)"
    )

    def validate(self, attrs):
        refuse_unknown(self)
        if ("files" in attrs) == ("source_url" in attrs):
            raise serializers.ValidationError({"files": ["give files or source_url"]})
        return attrs


class DatasetFileSerializer(serializers.Serializer):
    path = serializers.CharField()
    size_bytes = serializers.IntegerField()
    sha256 = serializers.CharField()
    stored = serializers.SerializerMethodField()

    def get_stored(self, f) -> bool:
        return f.stored_at is not None


class DatasetSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    status = serializers.CharField()
    status_reason = serializers.CharField()
    source_url = serializers.CharField()
    total_bytes = serializers.IntegerField()
    file_count = serializers.IntegerField()
    uploaded_by = serializers.CharField(
        source="owner.username", help_text="the member of the team who uploaded it"
    )
    created_at = serializers.DateTimeField()
    ready_at = serializers.DateTimeField(allow_null=True)


class DatasetDetailSerializer(DatasetSerializer):
    files = DatasetFileSerializer(many=True, source="files.all")


class UploadSerializer(serializers.Serializer):
    path = serializers.CharField()
    url = serializers.CharField(help_text="a presigned PUT (single upload); empty for parts")
    upload_id = serializers.CharField(help_text="a multipart upload; empty for a single PUT")
    part_urls = serializers.ListField(child=serializers.CharField())
    part_size_bytes = serializers.IntegerField()
    expires_at = serializers.FloatField(help_text="unix time the URLs stop working")


class DatasetUploadAnswerSerializer(serializers.Serializer):
    dataset = DatasetSerializer()
    uploads = UploadSerializer(many=True)


class DatasetUploadUrlsSerializer(serializers.Serializer):
    paths = serializers.ListField(
        child=serializers.CharField(max_length=1024),
        required=False,
        default=list,
        max_length=10_000,
    )


class DatasetCompleteSerializer(serializers.Serializer):
    parts = serializers.DictField(
        child=serializers.ListField(child=serializers.CharField(max_length=200), max_length=10_000),
        required=False,
        default=dict,
        help_text="path -> the ETags of its parts, in order (multipart files only)",
    )


class ArtifactSerializer(serializers.Serializer):
    path = serializers.CharField()
    size_bytes = serializers.IntegerField()
    sha256 = serializers.CharField()
    reason = serializers.CharField()
    synced_at = serializers.DateTimeField()
    download_url = serializers.SerializerMethodField(help_text="a presigned GET, short expiry")

    def get_download_url(self, artifact) -> str:
        return objectstore.presign_get(artifact.key, filename=artifact.path.rsplit("/", 1)[-1])


def _u(upload: storage.Upload) -> dict:
    return dataclasses.asdict(upload)


class DatasetListCreateView(PaginatedListView):
    """Your team's datasets, whichever member uploaded them; POST starts an upload (files) or
    registers a URL (source_url)."""

    @extend_schema(responses=DatasetSerializer(many=True))
    def get(self, request: Request) -> Response:
        return self.paginated(
            selectors.datasets_owned(request_team(request))
            .select_related("owner")
            .order_by("-created_at"),
            DatasetSerializer,
        )

    @extend_schema(
        request=DatasetCreateSerializer,
        responses={201: DatasetUploadAnswerSerializer, 202: DatasetSerializer},
    )
    def post(self, request: Request) -> Response:
        body = DatasetCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        if "source_url" in data:
            dataset = storage.dataset_register_url(
                team=request_team(request),
                owner=request.user,
                name=data["name"],
                source_url=data["source_url"],
            )
            return Response(DatasetSerializer(dataset).data, status=status.HTTP_202_ACCEPTED)
        dataset, uploads = storage.dataset_upload_create(
            team=request_team(request),
            owner=request.user,
            name=data["name"],
            files=[storage.FileSpec(**f) for f in data["files"]],
        )
        return Response(
            DatasetUploadAnswerSerializer(
                {"dataset": dataset, "uploads": [_u(u) for u in uploads]}
            ).data,
            status=status.HTTP_201_CREATED,
        )


class DatasetDetailView(APIView):
    """One of your team's datasets with its files (another team's id: 404); DELETE removes it
    (409 while a rental reads it)."""

    @extend_schema(responses=DatasetDetailSerializer)
    def get(self, request: Request, dataset_id) -> Response:
        dataset = selectors.dataset_owned(team=request_team(request), dataset_id=dataset_id)
        return Response(DatasetDetailSerializer(dataset).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, dataset_id) -> Response:
        storage.dataset_delete(team=request_team(request), dataset_id=dataset_id)
        return Response(status=status.HTTP_204_NO_CONTENT)


class DatasetUploadUrlsView(APIView):
    """Fresh presigned URLs for the files of an upload not yet stored (all, or `paths`)."""

    @extend_schema(request=DatasetUploadUrlsSerializer, responses=DatasetUploadAnswerSerializer)
    def post(self, request: Request, dataset_id) -> Response:
        body = DatasetUploadUrlsSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        dataset, uploads = storage.dataset_upload_urls(
            team=request_team(request), dataset_id=dataset_id, paths=body.validated_data["paths"]
        )
        return Response(
            DatasetUploadAnswerSerializer(
                {"dataset": dataset, "uploads": [_u(u) for u in uploads]}
            ).data
        )


class DatasetCompleteView(APIView):
    """The client has uploaded the files: check them; READY when all check out (else 400
    naming the files that did not)."""

    @extend_schema(request=DatasetCompleteSerializer, responses=DatasetSerializer)
    def post(self, request: Request, dataset_id) -> Response:
        body = DatasetCompleteSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        dataset = storage.dataset_upload_complete(
            team=request_team(request), dataset_id=dataset_id, parts=body.validated_data["parts"]
        )
        return Response(DatasetSerializer(dataset).data)


class RentalArtifactListView(PaginatedListView):
    """The synced output files of one of the team's rentals, each with a presigned download URL."""

    @extend_schema(responses=ArtifactSerializer(many=True))
    def get(self, request: Request, rental_id) -> Response:
        return self.paginated(
            selectors.rental_artifacts(team=request_team(request), rental_id=rental_id),
            ArtifactSerializer,
        )


class RentalArtifactDownloadView(APIView):
    """Redirect (302) to a presigned GET of one output file, named by `path`."""

    @extend_schema(parameters=[OpenApiParameter("path", str, required=True)], responses={302: None})
    def get(self, request: Request, rental_id) -> HttpResponseRedirect:
        path = request.query_params.get("path", "")
        artifact = (
            selectors.rental_artifacts(team=request_team(request), rental_id=rental_id)
            .filter(path=path)
            .first()
        )
        if artifact is None:
            raise NotFound("no such artifact")
        return HttpResponseRedirect(
            objectstore.presign_get(artifact.key, filename=artifact.path.rsplit("/", 1)[-1])
        )
