//! Snapshot bodies travel in spool files (`SnapshotData = SnapshotSpool`): the tests
//! read one whole, or make one from bytes.

use std::io::{Seek, SeekFrom, Write};

use lineage_node::snapshot_spool::SnapshotSpool;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

/// The whole body in a snapshot's spool (waiting for it, as a send does).
pub async fn body_bytes(spool: &mut SnapshotSpool) -> Vec<u8> {
    spool.seek(SeekFrom::Start(0)).await.expect("rewind spool");
    let mut bytes = Vec::new();
    spool.read_to_end(&mut bytes).await.expect("read spool");
    bytes
}

/// A spool holding `bytes`, as a follower holds a body it received.
pub fn spool_of(bytes: &[u8]) -> Box<SnapshotSpool> {
    let mut file = tempfile::tempfile().expect("spool");
    file.write_all(bytes).expect("write spool");
    file.seek(SeekFrom::Start(0)).expect("rewind spool");
    Box::new(SnapshotSpool::ready(file))
}

/// Builds a snapshot of `sm`, as openraft asks for one: the point it names.
pub async fn build(
    sm: &mut lineage_node::store::StateMachine,
) -> openraft::SnapshotMeta<u64, openraft::BasicNode> {
    use openraft::storage::RaftStateMachine;
    use openraft::RaftSnapshotBuilder;
    sm.get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .expect("build snapshot")
        .meta
}

/// Builds a snapshot of `sm` and asks for it as a follower's send would: its meta and
/// the spool its body is written into.
#[allow(dead_code)] // format_pin shares this module and serves no snapshot
pub async fn build_and_serve(
    sm: &mut lineage_node::store::StateMachine,
) -> (
    openraft::SnapshotMeta<u64, openraft::BasicNode>,
    Box<SnapshotSpool>,
) {
    use openraft::storage::RaftStateMachine;
    let meta = build(sm).await;
    let served = sm
        .get_current_snapshot()
        .await
        .expect("current snapshot")
        .expect("a snapshot was just built");
    (meta, served.snapshot)
}
