#!/usr/bin/env bash
# `make images`: build tierline's image (deploy/Dockerfile) as tierline:latest, from the repository root.
#   BASE_IMAGE       the Python base; default python:3.11-slim when it is present or can be pulled, else the local
#                    tierline/base:bookworm, made once from Debian packages (deploy/base-image.sh)
#   TORCH_INDEX_URL  passed to the build when set; else PyTorch's CPU index, or none when pip's local find-links
#                    hold the pinned CPU torch (copied into deploy/wheels/, the build installs it from there)
#   IMAGE            the tag (default tierline:latest)
# With the local base it also builds tierline/compose-services:bookworm (PostgreSQL, Redis and nginx from Debian
# packages) for deploy/compose.local.yaml. Layers are cached: a second run with unchanged sources takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${IMAGE:-tierline:latest}"
LOCAL_BASE=tierline/base:bookworm
SERVICES_IMAGE=tierline/compose-services:bookworm
start=$(date +%s)

docker info >/dev/null 2>&1 || { echo "images: docker does not answer (is dockerd running?)" >&2; exit 1; }

if [ -z "${BASE_IMAGE:-}" ]; then
  if docker image inspect python:3.11-slim >/dev/null 2>&1 || timeout 300 docker pull -q python:3.11-slim >/dev/null 2>&1; then
    BASE_IMAGE=python:3.11-slim
  else
    echo "images: python:3.11-slim cannot be pulled here: building on $LOCAL_BASE (Debian packages)"
    if ! command -v debootstrap >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      apt-get install -y -q debootstrap >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q debootstrap >/dev/null; }
    fi
    deploy/base-image.sh "$LOCAL_BASE"
    BASE_IMAGE=$LOCAL_BASE
  fi
fi

# The pinned torch as a local CPU wheel, when pip's find-links hold one (hosts without PyPI's torch index).
torch_version="$(sed -n 's/^torch==//p' constraints.txt)"
mkdir -p deploy/wheels
find deploy/wheels -name 'torch-*.whl' ! -name "torch-${torch_version}+cpu-*" -delete
if [ -z "${TORCH_INDEX_URL+set}" ]; then
  links="${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}"
  for dir in $links; do
    dir="${dir#file://}"
    for wheel in "$dir"/torch-"${torch_version}"+cpu-cp311-*linux*_"$(uname -m)".whl; do
      [ -f "$wheel" ] || continue
      [ -f "deploy/wheels/$(basename "$wheel")" ] || cp -l "$wheel" deploy/wheels/ 2>/dev/null || cp "$wheel" deploy/wheels/
    done
  done
  if compgen -G "deploy/wheels/torch-${torch_version}+cpu-*.whl" >/dev/null; then
    TORCH_INDEX_URL=""  # the local wheel: no index to reach
    echo "images: torch ${torch_version}+cpu from deploy/wheels/ (pip's local find-links)"
  else
    TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
  fi
fi

# The host's own CA certificates (a TLS-inspecting proxy's root, say), for pip in the build stage only.
find deploy/certs -name '*.crt' -delete
for cert in /usr/local/share/ca-certificates/*.crt; do
  [ -f "$cert" ] && cp "$cert" deploy/certs/
done

echo "images: building $IMAGE on $BASE_IMAGE"
build_args=(--build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL")
# The dependency stage tagged too: the legacy builder would leave it untagged, and `docker image prune` would then
# drop the layer cache that makes the next build take seconds.
docker build -q -f deploy/Dockerfile --target deps -t "${IMAGE%%:*}-build-deps:latest" "${build_args[@]}" . >/dev/null
docker build -f deploy/Dockerfile -t "$IMAGE" "${build_args[@]}" .
if [ "$BASE_IMAGE" = "$LOCAL_BASE" ]; then
  docker build -t "$SERVICES_IMAGE" --build-arg BASE_IMAGE="$LOCAL_BASE" deploy/compose/local
fi
echo "images: $IMAGE built in $(( $(date +%s) - start )) s, $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
