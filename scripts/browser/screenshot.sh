#!/usr/bin/env bash
# Render an HTML file in headless Chromium: scripts/browser/screenshot.sh PAGE.html OUT.png [WIDTH,HEIGHT]
# Needs /usr/bin/chromium (Debian: apt-get install -y --no-install-recommends chromium). Offline flags only.
set -euo pipefail
page=$(realpath "$1"); out=$(realpath -m "$2"); size=${3:-1200,900}
profile=$(mktemp -d); trap 'rm -rf "$profile"' EXIT
timeout 60 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync --hide-scrollbars \
  --user-data-dir="$profile" --window-size="$size" --screenshot="$out" "file://$page" 2>/dev/null
echo "$out"
