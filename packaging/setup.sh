#!/usr/bin/env bash
# Set up sandboxd on a fresh Debian or Ubuntu machine, as root, and run it.
#
#   packaging/setup.sh serve [SERVE ARGS...]      install, then run the daemon (sandboxd serve, defaults:
#                                                 /run/sandboxd/sandboxd.sock) in the foreground
#   packaging/setup.sh run [-- PROGRAM ARGS...]   install, then run PROGRAM in the default sandbox
#   packaging/setup.sh test [PYTEST ARGS...]      install (with test tools), then run the test suite
#   packaging/setup.sh install                    install only (the container image's build step)
#
# Installs only what is missing: the Debian packages below, then a virtualenv in
# .venv (from the system's python3, which every user can run; $PYTHON for another) with sandboxd
# and its Python dependencies, and puts `sandboxd` and `sandboxctl` on PATH (symlinks in
# /usr/local/bin, or $SANDBOXD_BIN_DIR, to .venv/bin). Safe to run again.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
mode=${1:-}
shift || true

# gcc, libc6-dev: the native call helper (sandboxd/launcher/sandboxd_call.c) is compiled here.
# libseccomp2: the seccomp filter compiler (pyseccomp loads it with ctypes).
# nftables: NAT and the egress filter of isolated networks (the `nft` command).
# iproute2, procps, git: used by the tests (ip link, pgrep, git add/commit in a sandbox).
# bubblewrap: the baseline the benchmark compares against.
# ripgrep: the daemon's Search uses it when installed (a built-in search otherwise).
packages=(python3 python3-venv gcc libc6-dev libseccomp2 nftables iproute2 procps git bubblewrap ca-certificates
          ripgrep)
# nodejs, npm: the test that drives the daemon from Node's @grpc/grpc-js (tests/test_node_client.py).
# Checked by command, not package: a NodeSource nodejs ships npm itself and conflicts with Debian's.
if [ "$mode" = test ] && ! { command -v node && command -v npm; } >/dev/null 2>&1; then
  packages+=(nodejs npm)
fi
# fuse3: fusermount3, with which tests/test_hung_fs.py mounts, as a plain user, a FUSE file system that never answers.
# tmux: tests/test_terminals.py types into `sandboxctl shell` as a person would and reads the screen.
# btrfs-progs: mkfs.btrfs, for the loop-mounted btrfs on which tests/test_btrfs_sockets.py checks that the
# connect broker names a socket file as sock_diag does (a subvolume's stat() device is not its superblock's).
# curl, openssl: tests/test_interception.py runs curl through the intercepting proxy, and
# tests/test_session_ca.py verifies the session CA's leaves with `openssl verify`.
if [ "$mode" = test ]; then
  packages+=(fuse3 tmux btrfs-progs curl openssl)
fi

die() { echo "setup.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root: sandboxd needs CAP_SYS_ADMIN to build namespaces and mounts"
case "$mode" in serve|run|test|install) ;; *) die "usage: packaging/setup.sh serve [ARGS...] | run [-- PROGRAM ARGS...] | test [PYTEST ARGS...] | install";; esac

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup.sh: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The venv's interpreter: $PYTHON, else the system's python3 when it is new enough, else the first
# python3 on PATH. Plain users run this venv too (rootless `sandboxd run`, `sandboxd mcp`): a venv
# only links to its interpreter, so one made from a Python only root can reach (a pyenv under
# /root, mode 0700) gives them "bad interpreter".
new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
if [ -n "${PYTHON:-}" ]; then
  python=$PYTHON
elif new_enough /usr/bin/python3; then
  python=/usr/bin/python3
else
  python=python3
fi
new_enough "$python" \
  || die "sandboxd needs Python 3.11 or newer; $("$python" --version 2>&1) found (set PYTHON=/path/to/python3.11)"

umask 022                   # the venv, the helper and the byte code: readable by every user
venv="$repo/.venv"
# A venv made from another interpreter (before, root's own python3: a pyenv under /root) is remade
# from this one: in place when it is the same X.Y (the installed packages fit it; the running tests'
# imports keep working), else anew.
home=$("$python" -c 'import os, sys; print(os.path.dirname(os.path.abspath(sys._base_executable)))')
version=$("$python" -c 'import platform; print(platform.python_version())')
made_home=$(sed -n 's/^home = //p' "$venv/pyvenv.cfg" 2>/dev/null || true)      # none yet: no venv
made_version=$(sed -n 's/^version = //p' "$venv/pyvenv.cfg" 2>/dev/null || true)
if [ -x "$venv/bin/python" ] && [ "$made_home" != "$home" ]; then
  echo "setup.sh: $venv was made from the Python in $made_home ($made_version); remaking it from $python ($version)" >&2
  if [ "${made_version%.*}" = "${version%.*}" ]; then
    rm -f "$venv"/bin/python "$venv"/bin/python3 "$venv/bin/python${version%.*}"
    "$python" -m venv --upgrade --without-pip "$venv"
  else
    rm -rf "$venv"
  fi
fi
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
stamp="$venv/.sandboxd-installed"  # the pyproject.toml hash and extras of the last install
extras=""; [ "$mode" = test ] && extras="[test]"
want="$(sha256sum "$repo/pyproject.toml" | cut -d' ' -f1)$extras"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$venv/bin/python" -c 'import sandboxd' 2>/dev/null; then
  "$venv/bin/pip" install -q --disable-pip-version-check --config-settings editable_mode=compat -e "$repo$extras" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  "$venv/bin/python" -c 'import sandboxd, pyseccomp, psutil, grpc, dns.message' || die "the Python install failed (see above)"
  echo "$want" > "$stamp"
fi

# Byte-compile the source tree now: an editable install leaves that to the first
# import, which never writes it when PYTHONDONTWRITEBYTECODE is set, and then every
# `sandboxd run` recompiles all its modules (tens of milliseconds).
"$venv/bin/python" -m compileall -q "$repo/sandboxd" >/dev/null

# The daemon's session calls run through this small static helper when it is built
# (sandboxd/launcher/native_call.py says why); rebuilt when its source changes, or the
# Python constants its generated header holds (-V prints the digest it was built with).
helper="$repo/sandboxd/launcher/sandboxd-call"
if [ ! -x "$helper" ] || [ "$repo/sandboxd/launcher/sandboxd_call.c" -nt "$helper" ] \
   || [ "$("$helper" -V 2>/dev/null)" != "$("$venv/bin/python" -m sandboxd.launcher.native_call digest)" ]; then
  "$venv/bin/python" -m sandboxd.launcher.native_call build >/dev/null || die "building the call helper failed (see above)"
fi

# Plain users run the venv's commands too: when they cannot (a checkout under /root, mode 0700; a
# PYTHON= only root can reach), say exactly why. Root's daemon works either way.
as_nobody() { (cd / && runuser -u nobody -- "$@"); }
first_closed() {            # the outermost directory on the way to $1 that plain users cannot enter
  local path="" part parts
  IFS=/ read -ra parts <<< "${1#/}"
  for part in "${parts[@]:0:${#parts[@]}-1}"; do
    path="$path/$part"
    as_nobody test -x "$path" || { echo "$path"; return; }
  done
}
if id nobody >/dev/null 2>&1 && ! why=$(as_nobody "$venv/bin/python" -c 'import sandboxd' 2>&1); then
  closed=$(first_closed "$(readlink -f "$venv/bin/python")")
  [ -n "$closed" ] || closed=$(first_closed "$repo/sandboxd/__init__.py")
  if [ -n "$closed" ]; then
    why="they cannot enter $closed (mode $(stat -c %a "$closed"), owner $(stat -c %U "$closed"))"
  fi
  echo "setup.sh: plain users cannot run $venv/bin/sandboxd: $(echo "$why" | tail -n 1). Rootless" \
       "\`sandboxd run\` and \`sandboxd mcp\` work from this checkout only for root; for every user, clone" \
       "sandboxd where all can read it (e.g. /opt/sandboxd)${closed:+, or let them through $closed (chmod o+x)}" >&2
fi

# `sandboxd` and `sandboxctl` on PATH, as the .deb does in /usr/bin: a symlink to this checkout's
# venv, made when missing (or dangling), left alone when it is one already; any other file of that
# name (another checkout's link, an installed package's command) is not replaced: say so, and how.
bin_dir=${SANDBOXD_BIN_DIR:-/usr/local/bin}
mkdir -p "$bin_dir"
for name in sandboxd sandboxctl; do
  link="$bin_dir/$name" target="$venv/bin/$name"
  if [ -L "$link" ] && [ "$(readlink "$link")" = "$target" ]; then
    continue
  elif [ -L "$link" ] && [ ! -e "$link" ]; then
    echo "setup.sh: replacing $link, a link to $(readlink "$link"), which is gone" >&2
    ln -sfn "$target" "$link"
  elif [ -e "$link" ] || [ -L "$link" ]; then
    echo "setup.sh: $link exists and is not a link to $target$([ -L "$link" ] && echo " (it points to $(readlink "$link"))"):" \
         "left as it is; run $target, or remove $link and run setup.sh again" >&2
  else
    ln -s "$target" "$link"
    echo "setup.sh: $name is on PATH: $link -> $target" >&2
  fi
done

cd "$repo"
case "$mode" in
  serve)
    exec "$venv/bin/sandboxd" serve "$@"
    ;;
  run)
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || set -- /bin/sh -c 'echo "hello from $(hostname): uid $(id -u), $(ls /proc | grep -c "^[0-9]") processes visible"'
    exec "$venv/bin/sandboxd" run -- "$@"
    ;;
  test)
    exec "$venv/bin/python" -m pytest "$@"
    ;;
  install)
    echo "setup.sh: installed; the daemon: sandboxd serve ($venv/bin/sandboxd)" >&2
    ;;
esac
