#!/usr/bin/env bash
# Refreshes the chat page's vendored libraries from the npm registry:
#   tools/webui-vendor.sh 18.3.0 3.5.0     # marked, dompurify
# Then update the table in engine/crates/tine-server/webui/vendor/README.md with the printed sha256.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 MARKED_VERSION DOMPURIFY_VERSION" >&2; exit 2; }
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/engine/crates/tine-server/webui/vendor"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "marked@$1" "dompurify@$2" >/dev/null)
mkdir -p "$tmp/m" "$tmp/d"
tar xzf "$tmp/marked-$1.tgz" -C "$tmp/m"
tar xzf "$tmp/dompurify-$2.tgz" -C "$tmp/d"
cp "$tmp/m/package/lib/marked.umd.js" "$dest/marked.umd.js.new" && mv "$dest/marked.umd.js.new" "$dest/marked.umd.js"
cp "$tmp/d/package/dist/purify.min.js" "$dest/purify.min.js.new" && mv "$dest/purify.min.js.new" "$dest/purify.min.js"
cp "$tmp/m/package/LICENSE" "$dest/LICENSE-marked.md"
cp "$tmp/d/package/LICENSE" "$dest/LICENSE-dompurify"
(cd "$dest" && sha256sum marked.umd.js purify.min.js)
