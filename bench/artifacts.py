"""Artifact sync and dataset staging: the agent's paths against the embedded S3 (SeaweedFS).

1. Sync: a 1 GiB checkpoint (random bytes) goes to object storage through the agent's sync path
   (`nodeagent.artifacts.ArtifactSyncer`: SHA-256 of the file, presigned multipart upload of
   64 MiB parts in 8 threads, as the server's defaults answer, then the commit), beside a raw
   boto3 `upload_file` of the same file (its defaults: 8 MiB parts, 10 threads) in the same run.
   Each is done twice, alternating; the better of each is printed. The agent API answering the
   agent (presigning, completing the multipart upload at commit) is a small in-process stand-in
   with the server's part size: the figure is the agent's transfer path, not the server's.
2. Start: a run whose 256 MiB dataset (4 files) must be downloaded into the node's cache,
   beside a second run on the same node finding it cached: staging (`nodeagent.staging`) plus
   the start of its process by the local-process runtime, until it runs.

Object storage: S3_ENDPOINT_URL (with S3_ACCESS_KEY_ID, S3_SECRET_ACCESS_KEY) when set, else an
embedded SeaweedFS started here by the same code as `dev.py up` (devstack.embedded).

    python bench/artifacts.py [--size-mib 1024] [--dataset-mib 256]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from _common import ROOT, emit, parse_args

PART_BYTES = 64 << 20  # the server's STORAGE["MULTIPART_PART_BYTES"] default
MiB = 1 << 20


def object_store(tmp: Path):
    """(S3 environment, process to stop or None)."""
    from devstack.embedded import bucket_ensure, start_seaweedfs

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    if os.environ.get("S3_ENDPOINT_URL"):
        env = {
            "S3_ENDPOINT_URL": os.environ["S3_ENDPOINT_URL"],
            "S3_ACCESS_KEY_ID": os.environ.get("S3_ACCESS_KEY_ID", ""),
            "S3_SECRET_ACCESS_KEY": os.environ.get("S3_SECRET_ACCESS_KEY", ""),
            "S3_REGION": os.environ.get("S3_REGION", "us-east-1"),
            "S3_BUCKET": bucket,
        }
        bucket_ensure(env)
        return env, None
    return start_seaweedfs(tmp / "seaweedfs", bucket=bucket)


def s3_client(env: dict):
    from devstack.embedded import s3_client as client

    return client(env)


def agent_api(client, bucket: str) -> ThreadingHTTPServer:
    """The two artifact endpoints of the agent API: presign (multipart from 64 MiB), commit."""
    from agentprotocol import (
        ArtifactCommit,
        ArtifactCommitAnswer,
        ArtifactUpload,
        ArtifactUploadAnswer,
        ArtifactUploadRequest,
    )

    def key(path: str) -> str:
        return f"artifacts/{path}"

    def uploads(body: dict) -> dict:
        out = []
        for f in ArtifactUploadRequest.from_payload(body).files:
            if f.size_bytes <= PART_BYTES:
                url = client.generate_presigned_url(
                    "put_object", Params={"Bucket": bucket, "Key": key(f.path)}, ExpiresIn=3600
                )
                out.append(ArtifactUpload(path=f.path, url=url))
                continue
            upload_id = client.create_multipart_upload(Bucket=bucket, Key=key(f.path))["UploadId"]
            urls = tuple(
                client.generate_presigned_url(
                    "upload_part",
                    Params={
                        "Bucket": bucket,
                        "Key": key(f.path),
                        "UploadId": upload_id,
                        "PartNumber": n,
                    },
                    ExpiresIn=3600,
                )
                for n in range(1, math.ceil(f.size_bytes / PART_BYTES) + 1)
            )
            out.append(
                ArtifactUpload(
                    path=f.path, upload_id=upload_id, part_urls=urls, part_size_bytes=PART_BYTES
                )
            )
        return ArtifactUploadAnswer(uploads=tuple(out)).to_payload()

    def commit(body: dict) -> dict:
        stored = 0
        for f in ArtifactCommit.from_payload(body).files:
            if f.upload_id:
                parts = [{"ETag": e, "PartNumber": n} for n, e in enumerate(f.etags, 1)]
                client.complete_multipart_upload(
                    Bucket=bucket, Key=key(f.path), UploadId=f.upload_id,
                    MultipartUpload={"Parts": parts},
                )  # fmt: skip
            size = client.head_object(Bucket=bucket, Key=key(f.path))["ContentLength"]
            stored += size == f.size_bytes
        return ArtifactCommitAnswer(stored=stored).to_payload()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = uploads(body) if self.path.endswith("/uploads/") else commit(body)
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def random_file(path: Path, size: int) -> None:
    with path.open("wb") as f:
        for _ in range(size // (16 * MiB)):
            f.write(os.urandom(16 * MiB))
        f.write(os.urandom(size % (16 * MiB)))


def bench_sync(env: dict, tmp: Path, size: int) -> tuple[float, float]:
    from nodeagent.artifacts import ArtifactSyncer

    client = s3_client(env)
    server = agent_api(client, env["S3_BUCKET"])
    out = tmp / "out"
    (out / "checkpoints").mkdir(parents=True)
    checkpoint = out / "checkpoints" / "step_000001000.pt"
    random_file(checkpoint, size)
    sync_times, raw_times = [], []
    try:
        for attempt in range(2):
            started = time.perf_counter()
            client.upload_file(str(checkpoint), env["S3_BUCKET"], f"raw/{attempt}.pt")
            raw_times.append(time.perf_counter() - started)
            syncer = ArtifactSyncer(
                server_url=f"http://127.0.0.1:{server.server_address[1]}",
                state_dir=str(tmp / f"state-{attempt}"),  # a fresh agent: hashes, uploads all
                token=lambda: "bench",
            )
            try:
                started = time.perf_counter()
                result = syncer.sync(
                    run_id=f"run-{attempt}", rental_id="bench", output_dir=str(out),
                    reason="checkpoint",
                )  # fmt: skip
                sync_times.append(time.perf_counter() - started)
            finally:
                syncer.close()
            assert result.committed == 1 and result.uploaded_bytes == size, result
            print(
                f"  round {attempt + 1}: raw boto3 {raw_times[-1]:.2f} s, "
                f"agent sync {sync_times[-1]:.2f} s",
                flush=True,
            )
    finally:
        server.shutdown()
        checkpoint.unlink()
    return min(sync_times), min(raw_times)


def bench_start(env: dict, tmp: Path, dataset_size: int) -> tuple[float, float]:
    from agentprotocol import DatasetMount, DesiredRun, StagedFile
    from nodeagent.runtime.base import ContainerSpec
    from nodeagent.runtime.process import LocalProcessDriver, ProcessDriverConfig
    from nodeagent.staging import ContentCache, stage_run

    client = s3_client(env)
    files = []
    part = dataset_size // 4
    for index in range(4):
        data = os.urandom(part)
        name = f"datasets/bench/shard-{index}.bin"
        client.put_object(Bucket=env["S3_BUCKET"], Key=name, Body=data)
        url = client.generate_presigned_url(
            "get_object", Params={"Bucket": env["S3_BUCKET"], "Key": name}, ExpiresIn=3600
        )
        files.append(
            StagedFile(
                path=f"shard-{index}.bin",
                url=url,
                sha256=hashlib.sha256(data).hexdigest(),
                size_bytes=part,
            )
        )
    volumes = tmp / "volumes"
    volumes.mkdir()
    volumes.chmod(0o711)
    tmp.chmod(0o711)
    driver = LocalProcessDriver(ProcessDriverConfig(state_dir=str(tmp / "runs")))
    cache = ContentCache(str(tmp / "cache"), max_bytes=4 * dataset_size)
    script = "import os; print(sorted(os.listdir(os.environ['GPUMARKET_DATA_DIR'] + '/ds')))"
    times = []
    try:
        for attempt in range(2):  # the first downloads, the second finds the dataset cached
            run_id = f"bench-{attempt}-{uuid.uuid4().hex[:6]}"
            spec_fields = {
                "rental_id": str(uuid.uuid4()), "run_id": run_id, "image": "",
                "command": ("python", "-c", script), "env": {}, "gpu_indices": (0,),
                "gpu_uuids": (), "cpu_limit": 1.0, "memory_limit_mb": 512, "ports": (),
                "datasets": (DatasetMount(dataset_id="d", name="ds", files=tuple(files)),),
            }  # fmt: skip
            started = time.perf_counter()
            entry = DesiredRun(**spec_fields)
            staged = stage_run(entry, cache=cache, stage_root=str(volumes / ".staging"))
            spec = ContainerSpec.place(
                entry, node_id="bench", volume_dir=str(volumes / run_id), env={},
                data_dir=staged.data_dir, seed_dir=staged.seed_dir,
            )  # fmt: skip
            state = driver.start(spec)
            times.append(time.perf_counter() - started)
            # Started: still running, or (a listing takes milliseconds) already done, cleanly.
            assert state.status == "running" or state.exit_code == 0, state
            assert staged.downloaded == (4 if attempt == 0 else 0), staged
            print(
                f"  start {'uncached' if attempt == 0 else 'cached'}: {times[-1]:.2f} s "
                f"({staged.downloaded} files downloaded)",
                flush=True,
            )
    finally:
        for state in driver.list_managed():
            driver.remove(state.run_id)
        cache.close()
    return times[1], times[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--dataset-mib", type=int, default=256)
    args = parse_args(parser, size_mib=4, dataset_mib=2)
    tmp = Path(tempfile.mkdtemp(prefix="bench-artifacts-", dir=ROOT / ".var"))
    env, proc = object_store(tmp)
    try:
        size = args.size_mib * MiB
        print(f"sync of a {args.size_mib} MiB checkpoint to {env['S3_ENDPOINT_URL']}:", flush=True)
        sync_s, raw_s = bench_sync(env, tmp, size)
        print(f"start of a run with a {args.dataset_mib} MiB dataset:", flush=True)
        cached_s, uncached_s = bench_start(env, tmp, args.dataset_mib * MiB)
    finally:
        if proc is not None:
            from devstack.embedded import stop_process

            stop_process(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    sync_rate, raw_rate = args.size_mib / sync_s, args.size_mib / raw_s
    print(f"agent sync {sync_rate:.1f} MiB/s, raw boto3 {raw_rate:.1f} MiB/s "
          f"(ratio {sync_rate / raw_rate:.2f}, goal >= 0.8)")  # fmt: skip
    print(f"start with the dataset cached {cached_s:.2f} s, downloading it {uncached_s:.2f} s")
    emit(
        {
            "sync_mib_per_s": round(sync_rate, 1),
            "raw_mib_per_s": round(raw_rate, 1),
            "ratio_sync_to_raw": round(sync_rate / raw_rate, 3),
            "start_cached_s": round(cached_s, 3),
            "start_uncached_s": round(uncached_s, 3),
        }
    )


if __name__ == "__main__":
    sys.exit(main())
