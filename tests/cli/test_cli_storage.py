"""`gpumarket data` and `gpumarket artifacts` against the live server and a real SeaweedFS."""

from __future__ import annotations

import hashlib

import pytest
import requests

from accounts.services import api_token_create
from gpumarket_cli.main import main
from marketplace.models import Rental
from storage import objectstore
from storage import services as storage
from storage.models import Dataset, DatasetStatus
from tests.factories import personal_team

pytestmark = pytest.mark.django_db(transaction=True)

MIB = 1 << 20


@pytest.fixture
def cli(live_server, user, capsys, object_store):
    _, token = api_token_create(user=user, team=personal_team(user), name="cli")

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["--server", live_server.url, "--token", token, *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_push_a_directory_list_rent_with_it_and_remove_it(cli, tmp_path, settings, make_node):
    settings.STORAGE = {
        **settings.STORAGE,
        "MULTIPART_THRESHOLD_BYTES": 5 * MIB,
        "MULTIPART_PART_BYTES": 5 * MIB,
    }
    make_node(gpus=2)
    root = tmp_path / "corpus"
    (root / "shards").mkdir(parents=True)
    (root / "shards" / "big.bin").write_bytes(b"\x01" * (11 * MIB))
    (root / "README").write_text("three parts and one small file\n")
    # push: multipart for the big file, a progress bar on stderr, ready at the end
    code, out, err = cli("data", "push", str(root))
    assert code == 0, err
    assert out.split()[1:3] == ["corpus", "ready"]
    assert "push corpus [" in err and "100%" in err
    dataset = Dataset.objects.get(name="corpus")
    assert dataset.status == DatasetStatus.READY
    assert sorted(dataset.files.values_list("path", "size_bytes")) == [
        ("README", 31),
        ("shards/big.bin", 11 * MIB),
    ]
    code, out, _ = cli("data", "ls")
    assert code == 0 and "corpus" in out and "ready" in out
    # a rental reads it
    code, out, err = cli("rent", "--gpus", "1", "--image", "img", "--data", "corpus", "--", "x")
    assert code == 0, err
    rental = Rental.objects.get(pk=out.split()[0])
    assert [link.dataset.name for link in rental.dataset_links.all()] == ["corpus"]
    # an unknown dataset is refused by the server, naming the field
    code, _, err = cli("rent", "--gpus", "1", "--image", "img", "--data", "nope", "--", "x")
    assert code == 1 and "datasets" in err and "nope" in err
    # rm is refused while the rental is active, then works once it is cancelled
    code, _, err = cli("data", "rm", "corpus")
    assert code == 1 and "409" in err
    assert cli("cancel", str(rental.pk))[0] == 0
    code, out, _ = cli("data", "rm", "corpus")
    assert code == 0 and not Dataset.objects.exists()


def test_pull_downloads_every_artifact_and_checks_it(cli, user, tmp_path, make_node, rent):
    make_node(gpus=2)
    rental = rent(1)
    contents = {"checkpoints/step_000000100.pt": b"w" * 4096, "logs/train.log": b"loss 0.1\n"}
    for path, data in contents.items():
        requests.put(
            objectstore.presign_put(f"rentals/{rental.pk}/output/{path}"), data=data, timeout=10
        )
    result = storage.artifacts_commit(
        rental=rental,
        run_id="r1",
        reason="complete",
        files=[
            storage.UploadedFile(path=p, size_bytes=len(d), sha256=hashlib.sha256(d).hexdigest())
            for p, d in contents.items()
        ],
    )
    assert result.stored == 2
    code, out, err = cli("artifacts", "pull", str(rental.pk), str(tmp_path / "out"))
    assert code == 0, err
    assert out.strip() == f"2 files in {tmp_path / 'out'}"
    assert "100%" in err
    for path, data in contents.items():
        assert (tmp_path / "out" / path).read_bytes() == data
    code, out, _ = cli("artifacts", "ls", str(rental.pk))
    assert code == 0 and "checkpoints/step_000000100.pt" in out
