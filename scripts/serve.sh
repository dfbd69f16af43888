#!/usr/bin/env bash
# Builds sandpit and starts the daemon on its embedded defaults (SQLite, local disk, the
# host template, 127.0.0.1:7423). The first start writes an admin key the CLI finds itself.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cargo build --release -p sandpit -p sandpit-bench
bin="$PWD/target/x86_64-unknown-linux-gnu/release/sandpit"
# Put the CLI (and the benchmark `sandpit bench` runs) on PATH for the second terminal
# (root only; otherwise use the path above).
if [ "$(id -u)" -eq 0 ] && [ -d /usr/local/bin ]; then
  ln -sf "$bin" /usr/local/bin/sandpit
  ln -sf "$bin-bench" /usr/local/bin/sandpit-bench
fi
exec "$bin" serve "$@"
