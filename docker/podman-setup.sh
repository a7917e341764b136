#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One-time set-up for building and running the images with podman on a machine without Docker or
# registry access (docs/docker.md, "Podman"): podman, runc and debootstrap from Debian's packages
# (installed as root when missing), and the base image localhost/debian:bookworm-minbase made by
# debootstrap from Debian's packages (once; kept while `podman image exists` finds it). Also
# Prometheus (its server and promtool), which the monitoring profile's tests run on the host.
# Idempotent: a second run changes nothing.
set -euo pipefail

BASE="${BASE:-localhost/debian:bookworm-minbase}"
SUITE="${SUITE:-bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"

missing=()
for tool in podman runc debootstrap promtool; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if (( ${#missing[@]} )); then
  if [[ $(id -u) != 0 ]]; then
    echo "podman-setup: missing ${missing[*]}; as root: apt-get install -y podman runc debootstrap prometheus" >&2
    exit 1
  fi
  echo "podman-setup: installing ${missing[*]} (apt)" >&2
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc debootstrap prometheus
fi

if podman image exists "$BASE"; then
  echo "podman-setup: $BASE present" >&2
  exit 0
fi
echo "podman-setup: making $BASE with debootstrap (about 2 minutes)" >&2
rootfs="$(mktemp -d /tmp/rootfs-"$SUITE".XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR" >/dev/null
tar -C "$rootfs" -c . | podman import - "$BASE" >/dev/null
echo "podman-setup: $BASE imported" >&2
