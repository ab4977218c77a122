"""Server logs as JSON lines carrying the request id and the rental id of the URL."""

from __future__ import annotations

import io
import json
import logging
import logging.config
import uuid

import pytest
import structlog
from django.conf import settings
from django.urls import path

from config.observability.logs import logging_config

log = structlog.get_logger("tests.ops")


def rental_view(request, rental_id):
    from django.http import HttpResponse

    log.info("rental viewed")
    logging.getLogger("tests.ops.stdlib").warning("from the standard library")
    return HttpResponse("ok")


urlpatterns = [path("r/<uuid:rental_id>/", rental_view)]


@pytest.fixture
def json_logs():
    logging.config.dictConfig(logging_config(log_format="json", level="INFO"))
    buffer = io.StringIO()
    logging.getLogger().handlers[0].setStream(buffer)
    yield buffer
    logging.config.dictConfig(settings.LOGGING)


@pytest.mark.urls("tests.ops.test_logs")
def test_json_lines_carry_request_and_rental_ids(client, json_logs):
    rental_id = uuid.uuid4()
    response = client.get(f"/r/{rental_id}/", HTTP_X_REQUEST_ID="req-42")
    assert response.headers["X-Request-ID"] == "req-42"
    lines = [json.loads(x) for x in json_logs.getvalue().splitlines() if x.startswith("{")]
    ours = [x for x in lines if x["event"] in ("rental viewed", "from the standard library")]
    assert len(ours) == 2
    for line in ours:
        assert line["request_id"] == "req-42"
        assert line["rental_id"] == str(rental_id)


def test_an_unknown_log_format_is_refused():
    with pytest.raises(ValueError, match="LOG_FORMAT"):
        logging_config(log_format="xml", level="INFO")
