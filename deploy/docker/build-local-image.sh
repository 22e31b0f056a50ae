#!/usr/bin/env bash
# Builds a minimal image from a lineage-node binary built on this machine (no registry
# needed): FROM scratch, the binary, the shared libraries it links, an unprivileged user.
# Usage: deploy/docker/build-local-image.sh [BINARY] [TAG]
set -euo pipefail
bin=${1:-target/release/lineage-node}
tag=${2:-lineage-node:local}
[ -x "$bin" ] || { echo "no executable at $bin (cargo build --release -p lineage-node)" >&2; exit 2; }
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/rootfs/bin" "$ctx/rootfs/tmp" "$ctx/rootfs/etc" "$ctx/data"
cp "$bin" "$ctx/rootfs/bin/lineage-node"
# The dynamic loader and every library the binary links.
for lib in $(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'); do
  mkdir -p "$ctx/rootfs$(dirname "$lib")"
  cp -L "$lib" "$ctx/rootfs$lib"
done
echo 'lineage:x:10001:10001:lineage:/data:/bin/lineage-node' > "$ctx/rootfs/etc/passwd"
echo 'lineage:x:10001:' > "$ctx/rootfs/etc/group"
chmod 1777 "$ctx/rootfs/tmp"
cat > "$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY rootfs/ /
# COPY does not keep ownership from the context; a directory it creates takes --chown.
COPY --chown=10001:10001 data /data
USER 10001:10001
VOLUME ["/data"]
EXPOSE 9200
ENTRYPOINT ["/bin/lineage-node"]
DOCKERFILE
docker build -q -t "$tag" "$ctx" >/dev/null
echo "$tag"
