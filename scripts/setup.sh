#!/usr/bin/env bash
# Installs what sandpit needs on Debian/Ubuntu; safe to run again.
#   protobuf-compiler: builds the agent protocol
#   crun, bubblewrap:  baselines of `sandpit bench`
#   fonts-dejavu-core: the text of `sandpit bench`'s chart
#   python3, procps:   what the quickstart and the tests run inside host-template sandboxes
#   e2fsprogs:         mkfs.ext4, which makes the file system of each volume
#   python3-venv:      with --test, a virtualenv for the test suite's Python tools
#   debootstrap:       `sandpit template build --debootstrap` (and its test)
#   python3-matplotlib: charts of the code interpreter's Python contexts (PNG results)
#   nftables, iproute2, openssl: sandbox networking (`nft` enforces egress policies; the
#                      network tests make their own namespaces with `ip` and a TLS cert)
# With --test it also installs dnsmasq-base (the DNS stub of the host-form TLS test,
# crates/tests/tests/e2b_host_tls.rs; only the binary, no service is started) and, into
# target/test-venv, the tools only the tests use:
#   moto[server]:      an S3-compatible server on loopback for the snapshot storage tests
#   e2b, e2b-code-interpreter, pytest: the E2B Python SDK scenarios (tests/e2b/python)
# into target/openapi-venv, schemathesis, the fuzzer of the OpenAPI conformance test
# (tests/openapi: its own virtualenv, as it needs a newer pytest than the E2B SDK's pin),
# into target/e2b-venv-X, each older E2B Python SDK release of tests/e2b/versions,
# and, into target/test-node, the E2B JavaScript SDK for tests/e2b/js (nodejs and npm
# come from apt when node is missing).
# With --harnesses it installs the coding-agent harnesses the agent-run tests drive, pinned,
# into .deps/harnesses (outside target/, so `cargo clean` keeps the ~1.2 GB; gitignored);
# their commands are then in .deps/harnesses/node_modules/.bin (pi, opencode, claude, codex):
#   @mariozechner/pi-coding-agent 0.73.1, opencode-ai 1.18.33, @openai/codex 0.171.0,
#   @anthropic-ai/claude-code 2.1.197 (the last release whose engines allow Node 20).
# A second run asks npm nothing when the installed versions already match the pins.
# The flags combine: `scripts/setup.sh --test --harnesses`.
set -euo pipefail
cd "$(dirname "$0")/.."
for_tests=false
harnesses=false
for arg in "$@"; do
  case "$arg" in
    --test) for_tests=true ;;
    --harnesses) harnesses=true ;;
    *) echo "setup: unknown option $arg (known: --test, --harnesses)" >&2; exit 2 ;;
  esac
done
need=()
for pkg in protobuf-compiler crun bubblewrap fonts-dejavu-core python3 python3-venv procps debootstrap e2fsprogs python3-matplotlib nftables iproute2 openssl curl; do
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
  # The test command checks formatting and lints; rustup installs the two components
  # where they are missing (a toolchain without rustup must bring them itself).
  for pair in fmt:rustfmt clippy:clippy; do
    if ! cargo "${pair%%:*}" --version >/dev/null 2>&1; then
      command -v rustup >/dev/null && rustup component add "${pair##*:}"
    fi
  done
fi
need_node() {
  if ! command -v npm >/dev/null; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nodejs npm
  fi
}
if $for_tests; then
  if ! dpkg-query -W -f='${Status}' dnsmasq-base 2>/dev/null | grep -q "install ok installed"; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dnsmasq-base
  fi
  # A stamp of the requirements keeps a second run from asking pip again.
  python_tools() {
    local venv=$1 reqs=$2
    [ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
    if ! cmp -s "$reqs" "$venv/.requirements"; then
      "$venv/bin/pip" install -q --disable-pip-version-check -r "$reqs"
      cp "$reqs" "$venv/.requirements"
    fi
  }
  python_tools target/test-venv tests/e2b/requirements.txt
  python_tools target/openapi-venv tests/openapi/requirements.txt
  # Older E2B SDK releases, one venv each: tests/e2b/versions/python-X.txt -> target/e2b-venv-X.
  for reqs in tests/e2b/versions/python-*.txt; do
    v=${reqs##*/python-}
    python_tools "target/e2b-venv-${v%.txt}" "$reqs"
  done
  need_node
  node_dir=target/test-node
  if ! cmp -s tests/e2b/js/package.json "$node_dir/package.json"; then
    mkdir -p "$node_dir"
    cp tests/e2b/js/package.json "$node_dir/package.json"
    npm install --silent --no-audit --no-fund --prefix "$node_dir"
  fi
fi
if $harnesses; then
  need_node
  harness_dir=.deps/harnesses
  pins=("@mariozechner/pi-coding-agent@0.73.1" "opencode-ai@1.18.33" "@anthropic-ai/claude-code@2.1.197" "@openai/codex@0.171.0")
  stale=false
  for pin in "${pins[@]}"; do
    name="${pin%@*}"
    manifest="$harness_dir/node_modules/$name/package.json"
    # The installed package's own manifest is the truth; a stamp could outlive a removed tree.
    have=$(node -e 'try { process.stdout.write(require(process.argv[1]).version) } catch (e) {}' "$PWD/$manifest")
    [ "$have" = "${pin##*@}" ] || stale=true
  done
  if $stale; then
    mkdir -p "$harness_dir"
    [ -f "$harness_dir/package.json" ] || echo '{"name":"sandpit-harnesses","private":true}' >"$harness_dir/package.json"
    # Claude Code's postinstall downloads nothing but copies its native binary out of an
    # optional dependency, so install scripts must run; --save-exact keeps the pins exact.
    npm install --silent --no-audit --no-fund --save-exact --prefix "$harness_dir" "${pins[@]}"
  fi
fi
