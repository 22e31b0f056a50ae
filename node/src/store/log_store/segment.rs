//! The files: segment paths and frames (`[len][crc32][entry as JSON]`), and the small
//! JSON files written atomically beside them.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use openraft::Entry;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::FRAME_HEADER;
use crate::raft_types::TypeConfig;

pub(in crate::store) fn segment_path(dir: &Path, first: u64) -> PathBuf {
    dir.join(format!("{first:020}.seg"))
}

pub(in crate::store) fn create_segment(dir: &Path, first: u64) -> Result<File, String> {
    let path = segment_path(dir, first);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    sync_dir(dir).map_err(|e| format!("cannot sync {}: {e}", dir.display()))?;
    Ok(file)
}

pub(in crate::store) fn remove_file(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

pub(in crate::store) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Replaces `dir/name` atomically and durably.
pub(in crate::store) fn write_json_file<T: Serialize>(
    dir: &Path,
    name: &str,
    value: &T,
) -> io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let bytes = serde_json::to_vec(value).map_err(io::Error::other)?;
    {
        let mut file = File::create(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
    }
    std::fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

pub(in crate::store) fn read_json_file<T: DeserializeOwned>(
    path: &Path,
) -> Result<Option<T>, String> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("{} is unreadable: {e}", path.display())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

/// Appends `entry`'s frame to `buf` and returns the frame's CRC.
pub(in crate::store) fn encode_frame(
    entry: &Entry<TypeConfig>,
    buf: &mut Vec<u8>,
) -> Result<u32, String> {
    let start = buf.len();
    buf.extend_from_slice(&[0; FRAME_HEADER]);
    serde_json::to_writer(&mut *buf, entry).map_err(|e| format!("encode entry: {e}"))?;
    let payload = &buf[start + FRAME_HEADER..];
    let len = u32::try_from(payload.len()).map_err(|_| "entry too large".to_string())?;
    let crc = crc32fast::hash(payload);
    buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
    buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    Ok(crc)
}

/// Decodes one whole frame (header + payload).
pub(in crate::store) fn decode_frame(frame: &[u8]) -> Result<Entry<TypeConfig>, String> {
    let (len, crc) = frame_header(frame).ok_or("short frame")?;
    let payload = frame
        .get(FRAME_HEADER..FRAME_HEADER + len as usize)
        .ok_or("short frame")?;
    if crc32fast::hash(payload) != crc {
        return Err("checksum mismatch".into());
    }
    serde_json::from_slice(payload).map_err(|e| format!("bad entry: {e}"))
}

pub(in crate::store) fn frame_header(bytes: &[u8]) -> Option<(u32, u32)> {
    let len = u32::from_le_bytes(bytes.get(0..4)?.try_into().ok()?);
    let crc = u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?);
    Some((len, crc))
}
