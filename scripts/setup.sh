#!/usr/bin/env bash
# Installs what sandpit needs on Debian/Ubuntu; safe to run again.
#   protobuf-compiler: builds the agent protocol
#   crun, bubblewrap:  baselines of `sandpit bench`
#   fonts-dejavu-core: the text of `sandpit bench`'s chart
#   python3, procps:   what the quickstart and the tests run inside host-template sandboxes
#   e2fsprogs:         mkfs.ext4, which makes the file system of each volume
#   python3-venv:      with --test, a virtualenv for the test suite's Python tools
#   debootstrap:       `sandpit template build --debootstrap` (and its test)
#   nftables, iproute2, openssl: sandbox networking (`nft` enforces egress policies; the
#                      network tests make their own namespaces with `ip` and a TLS cert)
# With --test it also installs, into target/test-venv, the tools only the tests use:
#   moto[server]:      an S3-compatible server on loopback for the snapshot storage tests
set -euo pipefail
cd "$(dirname "$0")/.."
for_tests=false
[ "${1:-}" = "--test" ] && for_tests=true
need=()
for pkg in protobuf-compiler crun bubblewrap fonts-dejavu-core python3 python3-venv procps debootstrap e2fsprogs nftables iproute2 openssl curl; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
command -v cargo >/dev/null || { echo "setup: cargo (Rust) is required: https://rustup.rs" >&2; exit 1; }
if $for_tests; then
  venv=target/test-venv
  if [ ! -x "$venv/bin/moto_server" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check 'moto[server]==5.2.1'
  fi
fi
