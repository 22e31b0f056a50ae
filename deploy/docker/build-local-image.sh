#!/usr/bin/env bash
# Builds a minimal image from binaries built on this machine (no registry needed):
# FROM scratch, lineage-node with lineage-witness, lineage-checkpointer and the lineage
# CLI from the same directory, the shared libraries they link, an unprivileged user. The
# entrypoint is lineage-node; deploy/compose.yaml runs the others from the same image.
# Usage: deploy/docker/build-local-image.sh [BINARY] [TAG]
#   (cargo build --release --bins first)
set -euo pipefail
bin=${1:-target/release/lineage-node}
tag=${2:-lineage-node:local}
dir=$(dirname "$bin")
bins=("$bin" "$dir/lineage-witness" "$dir/lineage-checkpointer" "$dir/lineage")
for b in "${bins[@]}"; do
  [ -x "$b" ] || { echo "no executable at $b (cargo build --release --bins)" >&2; exit 2; }
done
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/rootfs/bin" "$ctx/rootfs/tmp" "$ctx/rootfs/etc" "$ctx/data"
cp "$bin" "$ctx/rootfs/bin/lineage-node"
cp "$dir/lineage-witness" "$dir/lineage-checkpointer" "$dir/lineage" "$ctx/rootfs/bin/"
# The dynamic loader and every library the binaries link.
for b in "${bins[@]}"; do
  for lib in $(ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'); do
    mkdir -p "$ctx/rootfs$(dirname "$lib")"
    cp -L "$lib" "$ctx/rootfs$lib"
  done
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
# No curl in a scratch image: the node checks itself (/healthz). The witness and the
# checkpointer run from this image too; compose turns the check off for them.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["/bin/lineage-node", "healthcheck"]
ENTRYPOINT ["/bin/lineage-node"]
DOCKERFILE
docker build -q -t "$tag" "$ctx" >/dev/null
echo "$tag"
