#!/usr/bin/env bash
# A local Python 3.11 base image, made from Debian packages, for hosts that cannot pull python:3.11-slim:
#   debootstrap --variant=minbase bookworm  ->  docker import  ->  tierline/base:bookworm
# It holds python3 (Debian bookworm's is 3.11), python3-venv, pip, gcc and libc6-dev (the engine compiles its CPU
# paged-attention kernel at first start) and ca-certificates. Made once: a second run finds the image and exits at
# once. Needs root and debootstrap (deploy/images.sh installs it with apt-get where it can).
#   deploy/base-image.sh [IMAGE]     (default tierline/base:bookworm; DEBIAN_MIRROR overrides the mirror)
set -euo pipefail
IMAGE="${1:-tierline/base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES=python3,python3-venv,python3-pip,gcc,libc6-dev,ca-certificates

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "base image $IMAGE: present"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "debootstrap needs root" >&2; exit 1; }

root="$(mktemp -d /var/tmp/tierline-base.XXXXXX)"
trap 'rm -rf "$root"' EXIT
echo "base image $IMAGE: debootstrap bookworm from $MIRROR (a few minutes, once)"
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$root" "$MIRROR" >"$root.log" 2>&1 \
  || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# Slim it as Debian's own images do: no package lists, caches, docs or locales.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
  "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/tmp/* "$root"/var/log/*.log
find "$root"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'C.*' -exec rm -rf {} + 2>/dev/null || true
tar -C "$root" --numeric-owner -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  - "$IMAGE"
echo "base image $IMAGE: made"
