#!/usr/bin/env bash
# Make sure a Docker daemon answers, for `make images` and the compose test (tests/e2e/test_images.py): nothing to do
# when `docker info` works; else, as root, install Debian's docker.io and docker-compose when missing and start
# dockerd in the background (no systemd needed), logging to ${DOCKERD_LOG:-/var/log/tierline-dockerd.log}.
# Exit 0 once the daemon answers, 1 (saying why) where it cannot start: unprivileged, no apt, no kernel support.
set -uo pipefail
LOG="${DOCKERD_LOG:-/var/log/tierline-dockerd.log}"

if docker info >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "dockerd: not running, and only root can start it here" >&2
  exit 1
fi
if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null \
   || ! { command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1; }; then
  if ! command -v apt-get >/dev/null; then
    echo "dockerd: not installed, and there is no apt-get to install it" >&2
    exit 1
  fi
  packages="docker.io docker-compose"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q $packages >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q $packages >/dev/null; } \
    || { echo "dockerd: apt-get install $packages failed" >&2; exit 1; }
fi
if ! pgrep -x dockerd >/dev/null; then
  nohup dockerd >>"$LOG" 2>&1 &
fi
for _ in $(seq 60); do
  docker info >/dev/null 2>&1 && { echo "dockerd: running (log: $LOG)"; exit 0; }
  sleep 1
done
echo "dockerd: did not start within 60 s; the end of $LOG:" >&2
tail -5 "$LOG" >&2
exit 1
