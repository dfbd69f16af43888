#!/usr/bin/env bash
# Builds once and runs every test: formatting and lints first, then unit tests and the
# integration tests that create real sandboxes (they need root, cgroups and user namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test --harnesses
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
cargo build --workspace --all-targets
# Every test binary runs even after one fails, so a run shows all its failures.
cargo test --workspace --no-fail-fast -- --test-threads=4
