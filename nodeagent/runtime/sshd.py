"""SSH into a run: the sshd the agent starts in a container whose rental asked for it.

The sshd runs as the container's own user (no root, no capabilities) beside the run's main
process: the agent starts it with `docker exec` once the container runs, so it works for any
image that carries OpenSSH's server (`sshd` on the PATH or at /usr/sbin/sshd, and `ssh-keygen`)
and has a passwd entry for the user the container runs as. Its configuration, host key (made at
start, so no two containers share one) and authorized keys live in the container's /tmp
(a tmpfs: the root filesystem is read-only). It listens on the loopback address of the
container's own network only; the agent's port publisher (nodeagent/publish.py) is the way in.

Running unprivileged, sshd can only log in the user it runs as, with public keys: no passwords,
no PAM, no privilege separation user. StrictModes is off because /tmp is group- and
world-writable (sticky) and sshd would otherwise refuse the key file under it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

SSH_PORT = 22
SSH_DIR = "/tmp/.gpumarket-ssh"  # noqa: S108 - the container's private tmpfs

# One public key line as the server validates it (type, base64 body, optional comment), and
# nothing else: no authorized_keys options (command=, from=, ...) and no line breaks.
_KEY_LINE = re.compile(
    r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh\.com|"
    r"sk-ecdsa-sha2-nistp256@openssh\.com) [A-Za-z0-9+/]+={0,2}( [\x20-\x7e]{0,200})?$"
)

# Variables of the run a login session gets too (sshd starts sessions with a clean
# environment); values with spaces or quotes are left out, as sshd_config cannot quote them.
_SESSION_ENV = (
    "PATH|PYTHONPATH|LANG|HARNESS_CHECKPOINT_DIR|CUDA_VISIBLE_DEVICES|OMP_NUM_THREADS|"
    "MKL_NUM_THREADS|GPUMARKET_(RENTAL_ID|RUN_ID|WORKSPACE|DATA_DIR|GPU_COUNT|SIMULATED_GPUS)"
)

# Run with `sh -c` by `docker exec` as the container's user; GPUMARKET_SSH_AUTHORIZED_KEYS and
# GPUMARKET_SSH_PORT come in the exec's environment. `exec` leaves sshd in the foreground of
# the exec'd process (-D), logging to a file beside its configuration (-E).
LAUNCH_SCRIPT = rf"""set -eu
d={SSH_DIR}
umask 077
mkdir -p "$d"
printf '%s\n' "$GPUMARKET_SSH_AUTHORIZED_KEYS" > "$d/authorized_keys"
[ -s "$d/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -f "$d/host_ed25519"
session_env=$(env | grep -E '^({_SESSION_ENV})=[^ "]*$' | sed 's/.*/"&"/' | tr '\n' ' ')
cat > "$d/sshd_config" <<EOF
Port $GPUMARKET_SSH_PORT
ListenAddress 127.0.0.1
HostKey $d/host_ed25519
PidFile $d/sshd.pid
AuthorizedKeysFile $d/authorized_keys
StrictModes no
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
X11Forwarding no
AllowAgentForwarding no
AllowTcpForwarding local
PrintMotd no
Subsystem sftp internal-sftp
EOF
[ -z "$session_env" ] || echo "SetEnv $session_env" >> "$d/sshd_config"
sshd=$(command -v sshd || echo /usr/sbin/sshd)
exec "$sshd" -D -E "$d/sshd.log" -f "$d/sshd_config"
"""


def authorized_keys(keys: Iterable[str]) -> list[str]:
    """The keys that are plain public key lines; anything else (options, line breaks) is
    dropped: the server validated them, the agent does not take its word for it."""
    return [key.strip() for key in keys if _KEY_LINE.match(key.strip())]


def launch_environment(keys: Iterable[str], port: int = SSH_PORT) -> dict[str, str]:
    return {"GPUMARKET_SSH_AUTHORIZED_KEYS": "\n".join(authorized_keys(keys)),
            "GPUMARKET_SSH_PORT": str(port)}  # fmt: skip
