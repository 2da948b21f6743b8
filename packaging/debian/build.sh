#!/usr/bin/env bash
# Build sandboxd_VERSION_ARCH.deb into OUTDIR (default: dist/).
#
#   packaging/debian/build.sh [OUTDIR]
#
# One package for every Debian or Ubuntu release whose python3 is 3.11 to 3.14 (Debian 12: 3.11,
# Ubuntu 24.04: 3.12, Debian 13: 3.13). Why a wheelhouse and not Debian's python3-grpcio and
# friends: the generated gRPC code needs protobuf >= 7 and grpcio >= 1.85, and `sandboxd mcp` the
# MCP SDK; Debian 12 has protobuf 3.21 and grpcio 1.51, Debian 13 no newer majors, and neither
# has the MCP SDK. So the package carries a wheelhouse (/usr/lib/sandboxd/wheels): sandboxd's own
# wheel (with the native call helper) and every dependency, as pure wheels, abi3 wheels, and one
# CPython-specific manylinux wheel per supported minor version (grpcio, cffi, pydantic-core,
# rpds-py, charset-normalizer), the `otlp` extra's included (the OpenTelemetry SDK and its OTLP/HTTP
# exporter: audit.export.sink = "otlp", how a DaemonSet's audit trail reaches a collector; a pip
# install into the package's venv would be lost at the next upgrade). The postinst runs
# /usr/lib/sandboxd/make-venv: a venv from the system's python3 with sandboxd[otlp] installed by
# pip --no-index from that wheelhouse (no network at install time). When Debian's default
# python3 changes (an upgrade from 12 to 13), python3's own maintainer scripts run
# /usr/share/python3/runtime.d/sandboxd.rtupdate, which makes the venv again for the new version.
#
#   SANDBOXD_DEB_VERSION   the package's version (default: sandboxd/__init__.py's __version__)
#   SANDBOXD_DEB_PYTHONS   the CPython minor versions to carry wheels for (default "3.11 3.12 3.13 3.14")
#   PYTHON                 the Python that builds (default python3, >= 3.11, with venv)
#
# Needs: dpkg-deb, python3 (>= 3.11) with venv, gcc and libc6-dev (the native call helper), network to
# the Python package index or a pip cache.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
here="$repo/packaging/debian"
out=$(mkdir -p "${1:-$repo/dist}" && cd "${1:-$repo/dist}" && pwd)
python=${PYTHON:-python3}
wheel_version=$("$python" -c 'import re,sys; print(re.search(r"__version__ = \"([^\"]+)\"", open(sys.argv[1]).read())[1])' \
  "$repo/sandboxd/__init__.py")
version=${SANDBOXD_DEB_VERSION:-$wheel_version}
pythons=${SANDBOXD_DEB_PYTHONS:-3.11 3.12 3.13 3.14}
arch=$(dpkg --print-architecture)
case "$arch" in
  amd64) machine=x86_64 ;;
  arm64) machine=aarch64 ;;
  *) echo "build.sh: no manylinux wheels for $arch" >&2; exit 2 ;;
esac
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root="$stage/root"
lib="$root/usr/lib/sandboxd"

# The native call helper goes into the wheel (package data), built for this machine: built on the
# oldest supported glibc (Debian 12's 2.36), it runs on every newer one.
"$python" -c 'import sys; sys.path.insert(0, sys.argv[1]); from sandboxd.launcher import native_call; native_call.build()' "$repo"
"$python" -m venv "$stage/buildenv"
pip=("$stage/buildenv/bin/pip" --disable-pip-version-check -q)
# A recent pip: the one ensurepip brings with Debian 12's Python resolves for other versions poorly.
"${pip[@]}" install -U pip wheel 2>&1 | grep -v "^WARNING" >&2 || true
"${pip[@]}" wheel --no-deps -w "$stage/own" "$repo" 2>&1 | grep -v "^WARNING" >&2 || true
own=$(ls "$stage"/own/sandboxd-*.whl)

# Every dependency for each Python, the otlp extra's too (make-venv installs sandboxd[otlp]):
# binary wheels only, for any manylinux glibc up to 2.36 (Debian 12's; pip does not widen a
# manylinux_2_X platform to the older ones itself).
platforms=()
for minor in $(seq 5 36); do platforms+=(--platform "manylinux_2_${minor}_$machine"); done
platforms+=(--platform "manylinux2014_$machine" --platform "manylinux2010_$machine" --platform "manylinux1_$machine")
for version_ in $pythons; do
  if ! "${pip[@]}" download --only-binary=:all: --implementation cp --python-version "$version_" \
         "${platforms[@]}" -d "$lib/wheels" "$own[otlp]" > "$stage/download-$version_.log" 2>&1; then
    cat "$stage/download-$version_.log" >&2
    echo "build.sh: no complete set of wheels for CPython $version_ on $machine" >&2
    exit 1
  fi
done
ls "$lib"/wheels/sandboxd-*.whl "$lib"/wheels/opentelemetry_sdk-*.whl >/dev/null

install -D -m 0755 "$here/make-venv" "$lib/make-venv"
install -D -m 0755 "$here/rtupdate" "$root/usr/share/python3/runtime.d/sandboxd.rtupdate"
# The commands: links into the venv, which the postinst makes (dangling until then, as the venv
# is not in the package: it is built for whichever python3 the system has).
install -d "$root/usr/bin"
ln -s ../lib/sandboxd/venv/bin/sandboxd "$root/usr/bin/sandboxd"
ln -s ../lib/sandboxd/venv/bin/sandboxctl "$root/usr/bin/sandboxctl"
install -D -m 0644 "$repo/packaging/systemd/sandboxd.service" "$root/lib/systemd/system/sandboxd.service"
install -D -m 0644 "$repo/packaging/systemd/sandboxd.socket" "$root/lib/systemd/system/sandboxd.socket"
install -D -m 0644 "$repo/packaging/sandboxd.toml" "$root/etc/sandboxd/sandboxd.toml"

# Documentation: the copyright file (DEP-5), sandboxd's own and each bundled wheel's licence, and a
# native package's changelog.
doc="$root/usr/share/doc/sandboxd"
install -d "$doc"
"$python" "$here/copyright" "$lib/wheels" > "$doc/copyright"
sed -e "s/@VERSION@/$version/" -e "s/@DATE@/$(date -R -u -d "@${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct 2>/dev/null || date +%s)}")/" \
  "$here/changelog" | gzip -9n > "$doc/changelog.gz"

install -d "$root/DEBIAN"
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
cat > "$root/DEBIAN/control" <<CONTROL
Package: sandboxd
Version: $version
Architecture: $arch
Maintainer: sandboxd developers <sandboxd@example.org>
Installed-Size: $size
Depends: python3 (>= 3.11), python3 (<< 3.15), python3-venv, init-system-helpers (>= 1.54~), libseccomp2, nftables, iproute2
Recommends: git, ripgrep
Section: admin
Priority: optional
Homepage: https://github.com/sandboxd/sandboxd
Description: kernel-enforced sandboxes for AI agent tool calls
 A daemon (gRPC over a Unix socket) and a one-shot command (sandboxd run)
 that run shell commands and file tools inside namespaces with a read-only
 root, seccomp, Landlock and no capabilities, with an approval flow and an
 append-only audit log.
CONTROL
echo /etc/sandboxd/sandboxd.toml > "$root/DEBIAN/conffiles"
for script in postinst prerm postrm; do install -m 0755 "$here/$script" "$root/DEBIAN/$script"; done
(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum) > "$root/DEBIAN/md5sums"
deb="$out/sandboxd_${version}_${arch}.deb"
# gzip, not xz: the bulk is wheels, zip archives already (xz took minutes here for little).
dpkg-deb --root-owner-group -Zgzip --build "$root" "$deb" >/dev/null
echo "$deb"
