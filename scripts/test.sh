#!/usr/bin/env bash
# Builds once and runs every test: formatting and lints first, then unit tests and the
# integration tests that create real sandboxes (they need root, cgroups and user namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test --harnesses
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
cargo build --workspace --all-targets
cargo test --workspace -- --test-threads=4
