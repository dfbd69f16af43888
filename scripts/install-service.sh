#!/usr/bin/env bash
# Installs sandpit as a systemd service: builds the release binary, links it (and the
# benchmark) into /usr/local/bin as scripts/serve.sh does, installs scripts/sandpit.service
# as /etc/systemd/system/sandpit.service and, when systemd runs this machine, enables and
# starts it. Safe to run again: it rebuilds, relinks and restarts.
#
#   sudo ./scripts/install-service.sh            # build, install, enable, start
#   SANDPIT_NO_BUILD=1 ./scripts/install-service.sh   # install an already built binary
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "install-service.sh: run as root (it writes /usr/local/bin and /etc/systemd/system)" >&2
  exit 1
fi

bin="$PWD/target/x86_64-unknown-linux-gnu/release/sandpit"
if [ -z "${SANDPIT_NO_BUILD:-}" ]; then
  ./scripts/setup.sh
  cargo build --release -p sandpit -p sandpit-bench
fi
if [ ! -x "$bin" ]; then
  echo "install-service.sh: $bin is missing; build it first (cargo build --release -p sandpit)" >&2
  exit 1
fi
ln -sf "$bin" /usr/local/bin/sandpit
if [ -x "$bin-bench" ]; then
  ln -sf "$bin-bench" /usr/local/bin/sandpit-bench
fi

unit=/etc/systemd/system/sandpit.service
install -D -m 0644 scripts/sandpit.service "$unit"
install -D -m 0644 README.md /usr/local/share/doc/sandpit/README.md
install -d -m 0700 /var/lib/sandpit

# Only a machine that systemd runs (PID 1) can start the service now.
if [ "$(cat /proc/1/comm 2>/dev/null)" = "systemd" ] && command -v systemctl >/dev/null; then
  systemctl daemon-reload
  systemctl enable --now sandpit
  # A rerun after an upgrade: start the new binary (sandboxes stay, KillMode=process).
  systemctl restart sandpit
  systemctl --no-pager --lines=0 status sandpit || true
  echo "sandpit is running: logs with 'journalctl -u sandpit -f'; admin key in /var/lib/sandpit/admin.key"
else
  echo "Installed $unit, but systemd is not running this machine (PID 1 is $(cat /proc/1/comm 2>/dev/null || echo unknown))."
  echo "On a systemd machine run:  systemctl daemon-reload && systemctl enable --now sandpit"
  echo "Here, start the daemon yourself:  /usr/local/bin/sandpit serve --data-dir /var/lib/sandpit"
fi
