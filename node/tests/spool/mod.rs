//! Snapshot bodies travel in spool files (`SnapshotData = tokio::fs::File`): the tests
//! read one whole, or make one from bytes.

use std::io::{Seek, SeekFrom, Write};

use tokio::io::{AsyncReadExt, AsyncSeekExt};

/// The whole body in a snapshot's spool.
pub async fn body_bytes(spool: &mut tokio::fs::File) -> Vec<u8> {
    spool.seek(SeekFrom::Start(0)).await.expect("rewind spool");
    let mut bytes = Vec::new();
    spool.read_to_end(&mut bytes).await.expect("read spool");
    bytes
}

/// A spool holding `bytes`, as a follower holds a body it received.
pub fn spool_of(bytes: &[u8]) -> Box<tokio::fs::File> {
    let mut file = tempfile::tempfile().expect("spool");
    file.write_all(bytes).expect("write spool");
    file.seek(SeekFrom::Start(0)).expect("rewind spool");
    Box::new(tokio::fs::File::from_std(file))
}
