"""The REST API as the commands see it: one call in, the decoded answer out, a CliError with
the message a person reads for anything else."""

from __future__ import annotations

from urllib.parse import urlsplit

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class CliError(Exception):
    pass


class Api:
    """The REST API of one server, with one token, over one kept-alive session."""

    def __init__(self, server: str, token: str | None) -> None:
        self.base = server.rstrip("/")
        parts = urlsplit(self.base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise CliError(f"the server must be an http:// or https:// URL, not {server!r}")
        try:
            parts.port  # noqa: B018 (urlsplit checks the port only when it is read)
        except ValueError:
            raise CliError(f"the server's port is not a number: {server!r}") from None
        headers = {"Accept": "application/json", "User-Agent": "gpumarket-cli"}
        # requests (with zipfile, shutil, bz2 and lzma) is loaded here, for a call to the
        # server; `--help` and a refused line never pay for it.
        from gpumarket_cli.http import Client

        self._client = Client(self.base, token=token, headers=headers)
        self.last: Any = None  # the last answer's body, for --json

    def call(self, method: str, path: str, *, params: dict | None = None, json: Any = None) -> Any:
        """One request; its decoded JSON answer (None for an empty one). The client retries
        what may be repeated (see gpumarket_cli.http); what is left is a CliError."""
        from gpumarket_cli.http import HttpError, TransportError

        try:
            self.last = self._client.request(method, path, params=params, json=json)
        except TransportError as exc:
            raise CliError(f"cannot reach {self.base}: {exc}") from exc
        except HttpError as exc:
            raise CliError(exc.message) from exc
        return self.last
