#!/usr/bin/env bash
# Builds a sandpit template with node and the pinned coding-agent harnesses inside it, so
# that agent runtimes on its sandboxes need no host bind (the daemon prefers a harness the
# template carries at /opt/sandpit/template-harnesses over the host's `[agents] harness_dir`).
#
#   scripts/build-agent-template.sh NAME [options]
#
#   --harnesses LIST  harnesses to put in (comma-separated: pi,opencode,claude,codex;
#                     default: all four)
#   --from DIR        copy them from an npm tree that already holds them (e.g. .deps/harnesses,
#                     made by `scripts/setup.sh --harnesses`) instead of `npm install`: the
#                     packages and what they depend on, per DIR/package-lock.json; no network
#   --base DIR        start from a copy of this root filesystem instead of debootstrap
#   --suite SUITE     debootstrap suite (default bookworm); --mirror URL its mirror
#   --node PATH       the node binary to put in /usr/local/bin (default: the host's `node`,
#                     with the libraries ldd names that the base lacks)
#   --sandpit PATH    the sandpit CLI (default: `sandpit` on PATH); it reaches the daemon
#                     through SANDPIT_URL / SANDPIT_DATA_DIR / SANDPIT_API_KEY as usual
#   --keep DIR        also leave the assembled root filesystem in DIR (default: removed)
#
# The root filesystem is assembled in a directory under /var/tmp (as root: debootstrap and
# the owners of copied files need it), handed to `sandpit template build NAME --dir`, which
# copies it into the daemon's data directory, and removed afterwards.
set -euo pipefail

# The pins of scripts/setup.sh --harnesses (one truth for the versions the tests prove).
declare -A PINS=(
  [pi]="@mariozechner/pi-coding-agent@0.73.1"
  [opencode]="opencode-ai@1.18.33"
  [claude]="@anthropic-ai/claude-code@2.1.197"
  [codex]="@openai/codex@0.171.0"
)
INSIDE=opt/sandpit/template-harnesses

die() { echo "build-agent-template: $*" >&2; exit 2; }

[ $# -ge 1 ] || die "usage: $0 NAME [--harnesses pi,...] [--from DIR] [--base DIR | --suite SUITE [--mirror URL]] [--node PATH] [--sandpit PATH] [--keep DIR]"
name=$1; shift
case $name in -*) die "the template name comes first" ;; esac
harnesses=pi,opencode,claude,codex from="" base="" suite=bookworm mirror="" keep=""
node=$(command -v node || true)
sandpit=$(command -v sandpit || true)
while [ $# -gt 0 ]; do
  case $1 in
    --harnesses) harnesses=${2:?}; shift ;;
    --from) from=${2:?}; shift ;;
    --base) base=${2:?}; shift ;;
    --suite) suite=${2:?}; shift ;;
    --mirror) mirror=${2:?}; shift ;;
    --node) node=${2:?}; shift ;;
    --sandpit) sandpit=${2:?}; shift ;;
    --keep) keep=${2:?}; shift ;;
    *) die "unknown option $1" ;;
  esac
  shift
done
[ -n "$node" ] && [ -x "$node" ] || die "no node binary (install node 20+ or pass --node PATH)"
[ -n "$sandpit" ] && [ -x "$sandpit" ] || die "no sandpit CLI (put it on PATH or pass --sandpit PATH)"
pins=() programs=()
IFS=, read -ra wanted <<<"$harnesses"
for h in "${wanted[@]}"; do
  [ -n "${PINS[$h]:-}" ] || die "unknown harness $h (known: pi, opencode, claude, codex)"
  pins+=("${PINS[$h]}")
  programs+=("$h")
done

work=$(mktemp -d /var/tmp/sandpit-agent-template.XXXXXX)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs

if [ -n "$base" ]; then
  [ -d "$base" ] || die "--base $base is not a directory"
  echo "copying the base $base"
  mkdir "$root"
  cp -a "$base/." "$root/"
else
  command -v debootstrap >/dev/null || die "debootstrap missing (scripts/setup.sh installs it) or pass --base DIR"
  echo "debootstrap $suite"
  debootstrap --variant=minbase --include=ca-certificates,git "$suite" "$root" ${mirror:+"$mirror"}
fi

echo "node $("$node" --version) from $node"
install -D -m 0755 "$node" "$root/usr/local/bin/node"
# Whatever the binary loads that the base lacks (nothing, for a Debian base).
for lib in $(ldd "$node" | grep -o '/[^ ]*'); do
  [ -e "$root$lib" ] || install -D -m 0755 "$lib" "$root$lib"
done
[ -e "$root/usr/bin/env" ] || [ -e "$root/bin/env" ] \
  || die "the base has no /usr/bin/env (the harnesses start with #!/usr/bin/env node)"

dest=$root/$INSIDE
mkdir -p "$dest"
if [ -n "$from" ]; then
  [ -f "$from/package-lock.json" ] || die "--from $from has no package-lock.json (an npm install tree)"
  echo "copying ${pins[*]} and their dependencies from $from"
  # The closure of the wanted packages as npm resolves it (nearest node_modules upwards),
  # read from the lock file; every path is checked to stay inside the tree.
  "$node" - "$from" "${pins[@]}" >"$work/closure" <<'EOF'
const [from, ...pins] = process.argv.slice(2);
const lock = require(require("path").resolve(from, "package-lock.json"));
const pk = lock.packages || {};
const resolve = (at, dep) => {
  for (let p = at; ; ) {
    const c = (p ? p + "/" : "") + "node_modules/" + dep;
    if (c in pk) return c;
    if (!p) return null;
    const i = p.lastIndexOf("/node_modules/");
    p = i >= 0 ? p.slice(0, i) : "";
  }
};
const seen = new Set();
const todo = pins.map((p) => "node_modules/" + p.slice(0, p.lastIndexOf("@")));
while (todo.length) {
  const k = todo.pop();
  if (seen.has(k)) continue;
  if (!(k in pk)) { console.error("not in the lock file: " + k); process.exit(1); }
  if (k.split("/").some((s) => s === ".." || s === ".")) { console.error("bad path " + k); process.exit(1); }
  seen.add(k);
  const e = pk[k];
  for (const d of Object.keys({ ...e.dependencies, ...e.optionalDependencies, ...e.peerDependencies })) {
    const r = resolve(k, d);
    if (r) todo.push(r); // an optional dependency of another platform is not installed
  }
}
for (const k of [...seen].sort()) console.log(k);
EOF
  while IFS= read -r rel; do
    [ -e "$from/$rel" ] || continue # optional, not installed on this platform
    [ -e "$dest/$rel" ] && continue # came along with its parent package
    mkdir -p "$dest/$(dirname "$rel")"
    cp -a "$from/$rel" "$dest/$rel"
  done <"$work/closure"
  mkdir -p "$dest/node_modules/.bin"
  for p in "${programs[@]}"; do
    [ -L "$from/node_modules/.bin/$p" ] || die "$from has no node_modules/.bin/$p"
    cp -a "$from/node_modules/.bin/$p" "$dest/node_modules/.bin/$p"
  done
  printf '{"name":"sandpit-template-harnesses","private":true}\n' >"$dest/package.json"
else
  command -v npm >/dev/null || die "npm missing: install node's npm or pass --from DIR"
  echo "npm install ${pins[*]}"
  printf '{"name":"sandpit-template-harnesses","private":true}\n' >"$dest/package.json"
  # As in setup.sh: install scripts must run (Claude Code places its binary in one).
  PATH="$(dirname "$node"):$PATH" npm install --silent --no-audit --no-fund --save-exact --prefix "$dest" "${pins[@]}"
fi
for p in "${programs[@]}"; do
  [ -e "$dest/node_modules/.bin/$p" ] || die "no $INSIDE/node_modules/.bin/$p after the install"
done
# Readable and runnable by the sandbox's user, whatever umask made them.
chmod -R a+rX "$dest"

if [ -n "$keep" ]; then
  mkdir -p "$keep"
  cp -a "$root/." "$keep/"
fi
echo "building template $name"
"$sandpit" template build "$name" --dir "$root"
