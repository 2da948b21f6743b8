#!/usr/bin/env bash
# Build sandboxd_VERSION_ARCH.deb into OUTDIR (default: dist/).
#
#   packaging/debian/build.sh [OUTDIR]
#
# The package carries sandboxd and every Python dependency as wheels (built here, so installing
# needs no network), the systemd units and the default configuration. Its postinst makes
# /opt/sandboxd/venv from those wheels and links /usr/bin/sandboxd and /usr/bin/sandboxctl.
# Needs: dpkg-deb, python3 (>= 3.11) with venv, gcc and libc6-dev (the native call helper), network to
# the Python package index or a pip cache.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mkdir -p "${1:-$repo/dist}" && cd "${1:-$repo/dist}" && pwd)
python=${PYTHON:-python3}
version=$("$python" -c 'import re,sys; print(re.search(r"__version__ = \"([^\"]+)\"", open(sys.argv[1]).read())[1])' \
  "$repo/sandboxd/__init__.py")
arch=$(dpkg --print-architecture)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

# The native call helper goes into the wheel (package data), built for this machine.
"$python" -c 'import sys; sys.path.insert(0, sys.argv[1]); from sandboxd.launcher import native_call; native_call.build()' "$repo"
"$python" -m venv "$stage/buildenv"
"$stage/buildenv/bin/pip" install -q --disable-pip-version-check wheel 2>&1 | grep -v "^WARNING" >&2 || true
"$stage/buildenv/bin/pip" wheel -q --disable-pip-version-check -w "$stage/root/opt/sandboxd/wheels" "$repo" \
  2>&1 | grep -v "^WARNING" >&2 || true
ls "$stage"/root/opt/sandboxd/wheels/sandboxd-*.whl >/dev/null

install -D -m 0644 "$repo/packaging/systemd/sandboxd.service" "$stage/root/lib/systemd/system/sandboxd.service"
install -D -m 0644 "$repo/packaging/systemd/sandboxd.socket" "$stage/root/lib/systemd/system/sandboxd.socket"
install -D -m 0644 "$repo/packaging/sandboxd.toml" "$stage/root/etc/sandboxd/sandboxd.toml"
install -d "$stage/root/DEBIAN"
cat > "$stage/root/DEBIAN/control" <<CONTROL
Package: sandboxd
Version: $version
Architecture: $arch
Maintainer: sandboxd developers <sandboxd@example.org>
Depends: python3 (>= 3.11), python3-venv, libseccomp2, nftables, iproute2
Recommends: git, ripgrep
Section: admin
Priority: optional
Description: kernel-enforced sandboxes for AI agent tool calls
 A daemon (gRPC over a Unix socket) and a one-shot command (sandboxd run) that run shell
 commands and file tools inside namespaces with a read-only root, seccomp, Landlock and no
 capabilities, with an approval flow and an append-only audit log.
CONTROL
echo /etc/sandboxd/sandboxd.toml > "$stage/root/DEBIAN/conffiles"
cat > "$stage/root/DEBIAN/postinst" <<'POSTINST'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
  rm -rf /opt/sandboxd/venv
  python3 -m venv /opt/sandboxd/venv
  /opt/sandboxd/venv/bin/pip install -q --disable-pip-version-check --no-index --find-links /opt/sandboxd/wheels sandboxd
  /opt/sandboxd/venv/bin/python -m compileall -q /opt/sandboxd/venv/lib >/dev/null 2>&1 || true
  ln -sf /opt/sandboxd/venv/bin/sandboxd /usr/bin/sandboxd
  ln -sf /opt/sandboxd/venv/bin/sandboxctl /usr/bin/sandboxctl
  if [ -d /run/systemd/system ]; then
    systemctl daemon-reload || true
    systemctl enable --now sandboxd.socket || true
  fi
fi
POSTINST
cat > "$stage/root/DEBIAN/prerm" <<'PRERM'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
  systemctl disable --now sandboxd.socket sandboxd.service || true
fi
PRERM
cat > "$stage/root/DEBIAN/postrm" <<'POSTRM'
#!/bin/sh
set -e
if [ "$1" = remove ] || [ "$1" = purge ]; then
  rm -f /usr/bin/sandboxd /usr/bin/sandboxctl
  rm -rf /opt/sandboxd/venv
fi
POSTRM
chmod 0755 "$stage/root/DEBIAN/postinst" "$stage/root/DEBIAN/prerm" "$stage/root/DEBIAN/postrm"
deb="$out/sandboxd_${version}_${arch}.deb"
dpkg-deb --root-owner-group --build "$stage/root" "$deb" >/dev/null
echo "$deb"
