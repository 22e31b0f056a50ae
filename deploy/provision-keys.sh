#!/usr/bin/env bash
# Creates every key a deployment needs in KEYS_DIR, and KEYS_DIR/compose.env with the
# verifier keys that tie the parts together, for `docker-compose --env-file`:
#   the cluster's keys (audit.key, token.key, admin.token, cluster.secret),
#   the two witnesses' signing keys (witness.key, witness2.key),
#   a development CA (ca.pem, ca.key) and each node's TLS certificate and key
#   (node-N.pem, node-N.key: node1..3, localhost and 127.0.0.1; lineage://CLUSTER/node/N),
#   LINEAGE_CLUSTER_VKEY (the heads log's key, which the witnesses trust and the
#   checkpointer pins) and LINEAGE_WITNESS_VKEY, LINEAGE_WITNESS2_VKEY (whose cosignatures
#   the checkpointer and the nodes check).
# Refuses to overwrite existing keys. Containers run as uid 10001. Run as root (sudo),
# it gives the files to uid 10001 and a group, mode 0640 (directory 0750): the group is
# 10001 unless LINEAGE_KEYS_GROUP names a host group whose members may read them too,
# e.g. your own: `sudo env LINEAGE_KEYS_GROUP=$(id -gn) deploy/provision-keys.sh DIR`
# (sudo drops other variables). Run unprivileged, it leaves the files 0600 and says what
# to run.
# Usage: deploy/provision-keys.sh KEYS_DIR [BIN_DIR] [CLUSTER_NAME] [WITNESS_NAME] [WITNESS2_NAME]
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,10p' "$0" >&2; exit 2; }
keys=$1
bin_dir=${2:-target/release}
cluster_name=${3:-lineage.local/cluster}
witness_name=${4:-lineage.local/witness1}
witness2_name=${5:-lineage.local/witness2}
for b in lineage-node lineage-witness; do
  [ -x "$bin_dir/$b" ] || { echo "no $bin_dir/$b (cargo build --release --bins)" >&2; exit 2; }
done
"$bin_dir/lineage-node" keygen "$keys" >/dev/null
"$bin_dir/lineage-node" certs --out "$keys" --cluster-name "$cluster_name" \
  --node 1=node1,localhost,127.0.0.1 --node 2=node2,localhost,127.0.0.1 \
  --node 3=node3,localhost,127.0.0.1 >/dev/null
witness_vkey=$("$bin_dir/lineage-witness" --name "$witness_name" \
  --key-file "$keys/witness.key" keygen)
witness2_vkey=$("$bin_dir/lineage-witness" --name "$witness2_name" \
  --key-file "$keys/witness2.key" keygen)
cluster_vkey=$("$bin_dir/lineage-node" vkey --keys-dir "$keys" --cluster-name "$cluster_name")
keys_abs=$(cd "$keys" && pwd)
umask 077
cat > "$keys/compose.env" <<ENV
LINEAGE_KEYS=$keys_abs
LINEAGE_CLUSTER_NAME=$cluster_name
LINEAGE_CLUSTER_VKEY=$cluster_vkey
LINEAGE_WITNESS_NAME=$witness_name
LINEAGE_WITNESS_VKEY=$witness_vkey
LINEAGE_WITNESS2_NAME=$witness2_name
LINEAGE_WITNESS2_VKEY=$witness2_vkey
ENV
if [ "$(id -u)" -eq 0 ]; then
  group=${LINEAGE_KEYS_GROUP:-10001}
  chown -R "10001:$group" "$keys"
  chmod 0750 "$keys"
  find "$keys" -type f -exec chmod 0640 {} +
  # The CA's key signs node certificates: the operator's alone, never the containers'.
  chown 0:0 "$keys/ca.key"
  chmod 0600 "$keys/ca.key"
  echo "keys and $keys/compose.env written: owner uid 10001 (the containers), group $group, mode 0640"
else
  echo "keys and $keys/compose.env written (mode 0600, yours)."
  echo "The containers run as uid 10001: run this as root instead, or: sudo chown -R 10001:$(id -g) $keys && sudo chmod 0750 $keys && sudo chmod 0640 $keys/*"
fi
