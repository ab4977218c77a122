#!/usr/bin/env bash
# Build the harness image for tests and the dev stack without any container registry.
#
#   deploy/harness/build-offline.sh                      # -> gpumarket/harness:dev
#   GPUMARKET_HARNESS_IMAGE=my/harness:x deploy/harness/build-offline.sh
#
# How it differs from the production image (deploy/harness/Dockerfile):
#   - production starts FROM a CUDA PyTorch base image pulled from a registry and runs on GPU hosts
#     with the NVIDIA runtime; this image has no registry ancestry at all: its base is a Debian
#     bookworm root filesystem made with debootstrap from Debian's mirror and `docker import`ed,
#     with the CPU build of torch (no CUDA libraries), so it runs on any x86_64 Docker Engine and is
#     a fraction of the size;
#   - Python is Debian's python3 (3.11) with the wheels installed into
#     /usr/local/lib/python3.11/dist-packages by the host's pip (cp311 manylinux wheels, the same
#     versions as the project's virtualenv), not a conda/pip environment of the CUDA base;
#   - the harness code is a second, cheap layer (`FROM <base>` + `COPY harness`), so changing
#     harness code rebuilds in seconds while the base is reused;
#   - OpenSSH's server (for rentals that ask for SSH) is a layer of its own between the two: its
#     .debs (and the libraries they need that the base lacks) are downloaded from the same
#     mirror with a private apt state resolved against the base's package list, unpacked without
#     maintainer scripts (none is needed: the agent starts sshd as the container's user with a
#     configuration and host key of its own) and cached as a tarball, so adding it never
#     re-runs debootstrap.
#   - JupyterLab (for rentals that ask for a notebook) is a layer of its own too: its wheels are
#     installed by the host's pip for the base's Python into a staging directory, its data and
#     configuration moved to /usr/local/share/jupyter and /usr/local/etc/jupyter, and cached as
#     a tarball keyed by the base key and its pinned versions. It is started as
#     `python3 -m jupyterlab` (the console scripts pip writes name the host's interpreter).
# Both images carry OpenSSH's server (the agent starts it for rentals that ask for SSH) and
# JupyterLab (the agent starts it for rentals that ask for a notebook), and
# run the harness as the non-root user `harness` (uid/gid 1000) with /workspace as
# the working directory (the rental's volume) and `python -m harness` available.
#
# Idempotent and cached:
#   - the base image gpumarket/harness-base:dev is rebuilt only when its recipe key (package
#     versions + recipe version) changes; the key is stored in the image as GPUMARKET_BASE_KEY;
#   - the root filesystem tarball is cached under .var/cache/harness-rootfs/ (git-ignored), so an
#     engine with an empty data root re-imports it without another debootstrap;
#   - the sshd tarball is cached beside it under a key of the base key and the sshd recipe;
#   - the harness layer relies on the builder's cache for COPY (unchanged code: no new layer).
#
# Settings (environment): GPUMARKET_HARNESS_IMAGE, GPUMARKET_HARNESS_BASE_IMAGE,
# GPUMARKET_HARNESS_CACHE, DEBIAN_MIRROR, GPUMARKET_TORCH_SPEC, PYTHON (interpreter whose pip
# installs the wheels; default: the repo's .venv, else python3).
# Needs root (debootstrap) and an answering engine (see deploy/docker-engine.sh).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
IMAGE="${GPUMARKET_HARNESS_IMAGE:-${1:-gpumarket/harness:dev}}"
BASE_IMAGE="${GPUMARKET_HARNESS_BASE_IMAGE:-gpumarket/harness-base:dev}"
CACHE="${GPUMARKET_HARNESS_CACHE:-$REPO_ROOT/.var/cache/harness-rootfs}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
# Bump when the recipe below changes in a way the package versions do not capture.
RECIPE_VERSION=3
# The sshd layer's recipe: bump when the packages or their unpacking below change.
SSHD_PACKAGES=(openssh-server)
SSHD_RECIPE_VERSION=1
# The JupyterLab layer's recipe: bump when its packages or their layout below change.
JUPYTER_PACKAGES=("jupyterlab==4.4.*")
JUPYTER_RECIPE_VERSION=1
HARNESS_UID=1000

log() { echo "build-offline: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ "$(id -u)" == 0 ]] || die "needs root (debootstrap, chroot-less rootfs ownership)"
docker info >/dev/null 2>&1 || die "no Docker Engine answers; run: export DOCKER_HOST=\$(deploy/docker-engine.sh)"

if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then
    PY="$REPO_ROOT/.venv/bin/python"
else
    PY="$(command -v python3)"
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9  # parallel callers (test sessions) build once, the others then find the image

# Pin the image to the versions the project's virtualenv was tested with; fall back to the
# newest wheels (within pip's configured constraints) where a package is not installed there.
pinned() {  # $1: distribution name
    local v
    if v="$("$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null)"; then
        echo "$1==$v"
    else
        echo "$1"
    fi
}
TORCH_SPEC="${GPUMARKET_TORCH_SPEC:-torch==2.13.0+cpu}"
REQUIREMENTS=("$TORCH_SPEC" "$(pinned numpy)" "$(pinned scikit-learn)" "$(pinned scipy)"
    "$(pinned joblib)" "$(pinned threadpoolctl)" "$(pinned PyYAML)")
BASE_KEY="$(printf '%s\n' "$RECIPE_VERSION" "$SUITE" "${REQUIREMENTS[@]}" | sha256sum | cut -c1-16)"
TARBALL="$CACHE/base-$BASE_KEY.tar"

base_key_of_image() {
    docker image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$BASE_IMAGE" \
        2>/dev/null | sed -n 's/^GPUMARKET_BASE_KEY=//p'
}

cleanup_rootfs() {  # $1: rootfs dir; unmount whatever a failed debootstrap left mounted first
    local dir="$1"
    [[ -d "$dir" ]] || return 0
    { findmnt -rn -o TARGET | grep -F "$dir/" || true; } | sort -r | while read -r mnt; do
        umount -l "$mnt" || true
    done
    rm -rf --one-file-system "$dir"
}

build_rootfs_tarball() {
    command -v debootstrap >/dev/null 2>&1 || {
        log "installing debootstrap"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap >&2 ||
            { apt-get update -q >&2 &&
                DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap >&2; }
    }
    local rootfs="$CACHE/rootfs.$$"
    trap 'cleanup_rootfs "'"$rootfs"'"' EXIT
    mkdir -p "$CACHE/debs"
    log "debootstrap $SUITE (minbase + python3) from $MIRROR"
    debootstrap --variant=minbase --include=python3,python-is-python3 \
        --cache-dir="$CACHE/debs" "$SUITE" "$rootfs" "$MIRROR" >&2

    local site="$rootfs/usr/local/lib/python3.11/dist-packages"
    local platforms=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64
        --platform manylinux1_x86_64)
    for minor in $(seq 5 36); do  # bookworm's glibc is 2.36
        platforms+=(--platform "manylinux_2_${minor}_x86_64")
    done
    local find_links=()
    [[ -d /opt/wheels ]] && find_links=(--find-links /opt/wheels)
    log "installing ${REQUIREMENTS[*]} into the rootfs"
    mkdir -p "$site"
    "$PY" -m pip install -q --disable-pip-version-check --no-warn-script-location \
        --target "$site" --only-binary=:all: --python-version 3.11 --implementation cp \
        --abi cp311 "${platforms[@]}" "${find_links[@]}" "${REQUIREMENTS[@]}" 2>&1 |
        { grep -v "^WARNING: Location .* is ignored" || true; } >&2

    # Size: headers, CMake files, C++ test binaries and the libraries' own test suites are never
    # used at run time (torch_shm_manager is: DataLoader workers share tensors through it).
    rm -rf "${site:?}/torch/include" "${site:?}/torch/share/cmake" "${site:?}/torch/test" "${site:?}/bin"
    find "$site/torch/bin" -mindepth 1 -maxdepth 1 ! -name torch_shm_manager -exec rm -rf {} +
    find "$site/numpy" "$site/scipy" "$site/sklearn" -depth -type d -name tests \
        -exec rm -rf {} +
    rm -rf "$rootfs"/usr/share/{doc,man,info}/* "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' \
        -exec rm -rf {} + 2>/dev/null || true

    # The non-root user the harness runs as; written directly (no chroot needed).
    echo "harness:x:$HARNESS_UID:$HARNESS_UID::/home/harness:/bin/sh" >>"$rootfs/etc/passwd"
    echo "harness:x:$HARNESS_UID:" >>"$rootfs/etc/group"
    echo "harness:!:19000:0:99999:7:::" >>"$rootfs/etc/shadow"
    mkdir -p "$rootfs/home/harness" "$rootfs/workspace" "$rootfs/opt/harness"
    chown "$HARNESS_UID:$HARNESS_UID" "$rootfs/home/harness" "$rootfs/workspace"

    log "packing $TARBALL"
    tar --numeric-owner -C "$rootfs" --exclude='./dev/*' --exclude='./proc/*' \
        --exclude='./sys/*' --exclude='./run/*' -cf "$TARBALL.tmp" .
    mv "$TARBALL.tmp" "$TARBALL"
    find "$CACHE" -maxdepth 1 -name 'base-*.tar' ! -name "base-$BASE_KEY.tar" -delete
    cleanup_rootfs "$rootfs"
    trap - EXIT
}

import_base() {
    log "importing $TARBALL as $BASE_IMAGE"
    docker import \
        --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        --change "ENV LANG=C.UTF-8" \
        --change "ENV PYTHONUNBUFFERED=1" \
        --change "ENV PYTHONPATH=/opt/harness" \
        --change "ENV HOME=/home/harness" \
        --change "ENV GPUMARKET_BASE_KEY=$BASE_KEY" \
        --change "WORKDIR /workspace" \
        --change "USER harness" \
        --change 'CMD ["python3", "-m", "harness"]' \
        "$TARBALL" "$BASE_IMAGE" >/dev/null
}

SSHD_KEY="$(printf '%s\n' "$BASE_KEY" "$SSHD_RECIPE_VERSION" "$MIRROR" "${SSHD_PACKAGES[@]}" |
    sha256sum | cut -c1-16)"
SSHD_TARBALL="$CACHE/sshd-$SSHD_KEY.tar"

build_sshd_tarball() {  # needs the base image: apt resolves against its package list
    local work="$CACHE/sshd.$$"
    trap 'rm -rf "'"$work"'"' EXIT
    mkdir -p "$work/lists/partial" "$work/archives/partial" "$work/root"
    docker run --rm --network none --entrypoint cat "$BASE_IMAGE" /var/lib/dpkg/status \
        >"$work/status"
    echo "deb $MIRROR $SUITE main" >"$work/sources.list"
    local apt_opts=(-q -o "Dir::Etc::SourceList=$work/sources.list"
        -o Dir::Etc::SourceParts=/dev/null -o "Dir::State::Lists=$work/lists"
        -o "Dir::Cache=$work" -o "Dir::Cache::Archives=$work/archives"
        -o "Dir::State::status=$work/status" -o APT::Sandbox::User=root -o Debug::NoLocking=1)
    log "downloading ${SSHD_PACKAGES[*]} and what the base lacks for it ($SUITE, $MIRROR)"
    apt-get "${apt_opts[@]}" update >&2
    apt-get "${apt_opts[@]}" -y --no-install-recommends install --download-only \
        "${SSHD_PACKAGES[@]}" >&2
    local deb
    for deb in "$work"/archives/*.deb; do
        case "$(basename "$deb")" in
            # Helpers of maintainer scripts and init systems, which are not run here.
            procps_* | libproc2-* | runit-helper_* | ucf_* | sensible-utils_*) continue ;;
        esac
        dpkg-deb -x "$deb" "$work/root"
    done
    # bookworm's root is merged-/usr (/bin, /sbin and /lib are links into /usr): a real /bin
    # directory in the layer would replace the link and hide the base's programs.
    local top
    for top in bin sbin lib lib64; do
        if [[ -d "$work/root/$top" && ! -L "$work/root/$top" ]]; then
            mkdir -p "$work/root/usr/$top"
            cp -a "$work/root/$top/." "$work/root/usr/$top/"
            rm -rf "${work:?}/root/$top"
        fi
    done
    # ssh-keysign is setuid root (host-based authentication, never used here); the rest is
    # documentation and init-system glue.
    rm -rf "$work"/root/usr/lib/openssh/ssh-keysign "$work"/root/usr/lib/systemd \
        "$work"/root/usr/share/{doc,man,lintian,openssh,runit} "$work"/root/etc/{init.d,default,ufw,pam.d,runit,sv} \
        "$work"/root/var
    tar --numeric-owner --owner=0 --group=0 -C "$work/root" -cf "$SSHD_TARBALL.tmp" .
    mv "$SSHD_TARBALL.tmp" "$SSHD_TARBALL"
    find "$CACHE" -maxdepth 1 -name 'sshd-*.tar' ! -name "sshd-$SSHD_KEY.tar" -delete
    rm -rf "$work"
    trap - EXIT
}

JUPYTER_KEY="$(printf '%s\n' "$BASE_KEY" "$JUPYTER_RECIPE_VERSION" "${JUPYTER_PACKAGES[@]}" |
    sha256sum | cut -c1-16)"
JUPYTER_TARBALL="$CACHE/jupyter-$JUPYTER_KEY.tar"

build_jupyter_tarball() {
    local work="$CACHE/jupyter.$$"
    trap 'rm -rf "'"$work"'"' EXIT
    local site="$work/root/usr/local/lib/python3.11/dist-packages"
    local stage="$work/stage"
    local platforms=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64
        --platform manylinux1_x86_64)
    for minor in $(seq 5 36); do
        platforms+=(--platform "manylinux_2_${minor}_x86_64")
    done
    mkdir -p "$site" "$work/root/usr/local/share" "$work/root/usr/local/etc"
    log "installing ${JUPYTER_PACKAGES[*]} for the base's Python"
    # The base's own packages are pinned so that a shared dependency (PyYAML) keeps its version.
    printf '%s\n' "${REQUIREMENTS[@]:1}" >"$work/constraints.txt"
    "$PY" -m pip install -q --disable-pip-version-check --no-warn-script-location \
        --target "$stage" --only-binary=:all: --python-version 3.11 --implementation cp \
        --abi cp311 "${platforms[@]}" -c "$work/constraints.txt" "${JUPYTER_PACKAGES[@]}" 2>&1 |
        # pip also checks the packages of the interpreter it runs in, which the image never
        # sees: its conflict report about them is noise here.
        { grep -vE "^WARNING: Location .* is ignored|dependency resolver does not currently|which is incompatible" || true; } >&2
    [[ ! -d "$stage/share/jupyter" ]] || mv "$stage/share/jupyter" "$work/root/usr/local/share/"
    [[ ! -d "$stage/etc/jupyter" ]] || mv "$stage/etc/jupyter" "$work/root/usr/local/etc/"
    # Scripts name the host's interpreter; the rest of share/ and etc/ is documentation.
    rm -rf "${stage:?}/bin" "${stage:?}/share" "${stage:?}/etc"
    cp -a "$stage/." "$site/"
    tar --numeric-owner --owner=0 --group=0 -C "$work/root" -cf "$JUPYTER_TARBALL.tmp" .
    mv "$JUPYTER_TARBALL.tmp" "$JUPYTER_TARBALL"
    find "$CACHE" -maxdepth 1 -name 'jupyter-*.tar' ! -name "jupyter-$JUPYTER_KEY.tar" -delete
    rm -rf "$work"
    trap - EXIT
}

if [[ "$(base_key_of_image)" == "$BASE_KEY" ]]; then
    log "base image $BASE_IMAGE is current (key $BASE_KEY)"
else
    [[ -s "$TARBALL" ]] || build_rootfs_tarball
    import_base
fi

[[ -s "$SSHD_TARBALL" ]] || build_sshd_tarball
[[ -s "$JUPYTER_TARBALL" ]] || build_jupyter_tarball

# The sshd and harness layers: a tiny local build context with the sshd tarball and the harness
# package.
CONTEXT="$(mktemp -d)"
trap 'rm -rf "$CONTEXT"' EXIT
cp "$SSHD_TARBALL" "$CONTEXT/sshd.tar"
cp "$JUPYTER_TARBALL" "$CONTEXT/jupyter.tar"
if [[ -d "$REPO_ROOT/harness" ]]; then
    cp -a "$REPO_ROOT/harness" "$CONTEXT/harness"
    find "$CONTEXT/harness" -name '__pycache__' -type d -prune -exec rm -rf {} +
else
    log "warning: $REPO_ROOT/harness does not exist; the image carries no harness code"
    mkdir "$CONTEXT/harness"
fi
cat >"$CONTEXT/Dockerfile" <<EOF
FROM $BASE_IMAGE
ADD sshd.tar /
ADD jupyter.tar /
COPY harness /opt/harness/harness
LABEL org.opencontainers.image.title="gpumarket-harness (offline, CPU)" \\
      gpumarket.harness.base-key="$BASE_KEY"
EOF
before="$(docker image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
# The classic builder: it uses the local base image as is and never contacts a registry.
# Its deprecation notice is filtered out of the output.
DOCKER_BUILDKIT=0 docker build -q -t "$IMAGE" "$CONTEXT" 2>&1 >/dev/null |
    { grep -vE 'DEPRECATED|BuildKit|environment-variable|^\s*$' || true; } >&2
after="$(docker image inspect --format '{{.Id}}' "$IMAGE")"

if [[ "$before" != "$after" ]]; then
    # The previous build of the tag is now a dangling image: drop it (kept if still in use).
    if [[ -n "$before" ]]; then docker image rm "$before" >/dev/null 2>&1 || true; fi
    log "smoke test of $IMAGE"
    docker run --rm --network none "$IMAGE" python -c \
        "import torch, numpy, sklearn, scipy, yaml; print('torch', torch.__version__)" >&2
    docker run --rm --network none "$IMAGE" /usr/sbin/sshd -V 2>&1 | head -n 1 >&2
    docker run --rm --network none "$IMAGE" python3 -m jupyterlab --version >&2
fi
log "built $IMAGE ($(docker image inspect --format '{{.Size}}' "$IMAGE" | numfmt --to=iec))"
echo "$IMAGE"
