"""JupyterLab in a run: the notebook server the agent starts in a container whose rental asked
for one (`DesiredRun.jupyter_token`).

As with sshd (nodeagent/runtime/sshd.py), the agent starts it with `docker exec` as the
container's user once the container runs, beside the run's command (the server gives a Jupyter
rental without a command one that only keeps the container up). It works for any image with
Python and the `jupyterlab` package (the harness image has both). It listens on the loopback
address of the container's own network at JUPYTER_PORT; the agent's port publisher is the way
in, as is an SSH tunnel into the run (`gpumarket jupyter ID`).

The token comes in the exec's environment (JUPYTER_TOKEN, which Jupyter reads), never on a
command line. Its home, runtime, data and configuration directories live in the container's
/tmp (a tmpfs: the root filesystem is read-only); notebooks are opened and saved in the
run's workspace, so they are synced out with the rest of its output. Remote access is allowed
(the Host header names the node, not localhost) because the only ways in are the published
port and the tunnel, both behind the token.
"""

from __future__ import annotations

from agentprotocol import JUPYTER_PORT

JUPYTER_DIR = "/tmp/.gpumarket-jupyter"  # noqa: S108 - the container's private tmpfs

# Run with `sh -c` by `docker exec` as the container's user. `exec` leaves the server in the
# foreground of the exec'd process, logging to a file beside its directories.
LAUNCH_SCRIPT = rf"""set -eu
d={JUPYTER_DIR}
umask 077
mkdir -p "$d/home"
export HOME="$d/home" JUPYTER_RUNTIME_DIR="$d/runtime" JUPYTER_DATA_DIR="$d/data" \
    JUPYTER_CONFIG_DIR="$d/config" IPYTHONDIR="$d/ipython"
python=$(command -v python3 || command -v python)
exec "$python" -m jupyterlab --no-browser --ip=127.0.0.1 --port="$GPUMARKET_JUPYTER_PORT" \
    --ServerApp.port_retries=0 --ServerApp.allow_remote_access=True \
    --ServerApp.root_dir="${{GPUMARKET_WORKSPACE:-/workspace}}" \
    --LabApp.news_url=None --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate \
    > "$d/jupyter.log" 2>&1
"""


def launch_environment(token: str, port: int = JUPYTER_PORT) -> dict[str, str]:
    return {"JUPYTER_TOKEN": token, "GPUMARKET_JUPYTER_PORT": str(port)}
