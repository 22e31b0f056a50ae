//! The file a snapshot body travels in (openraft's `SnapshotData`). A body a follower is
//! sent is written into its spool on a blocking thread while openraft already holds the
//! spool: reads and seeks wait until the body is complete, in the task that sends it, so
//! the state machine's task (and with it every apply) does not wait for the body to be
//! written. A spool that receives a body is a plain file from the start.
//!
//! The file is nameless, so it is freed when the spool is dropped (or the process dies):
//! on the leader once openraft has sent it, or once a cancelled send's writer finishes
//! (the blocking thread writes the whole body either way, holding a redb read
//! transaction meanwhile); on a follower once installed, or, for a transfer given up
//! half-way, when openraft replaces it with the next one or the node restarts.
//!
//! Every byte read back from a spool is checked against the bytes that went in: a spool
//! keeps the SHA-256 of what was written into it, in order (`BodySeal`). The leader's
//! spool compares it as openraft reads the body to send: the read that reaches the end
//! fails when the digest differs, so the last chunk (the one that tells the follower to
//! install) is never sent. A follower's spool hashes the chunks as they arrive, and the
//! install compares that with what it parsed before it commits. A chunk received twice
//! (openraft resends one whose answer was lost) leaves the received body without a seal:
//! it is then checked only by its parse and by the record chain checks of the load that
//! follows every install.

use std::future::Future;
use std::io::{self, SeekFrom};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncSeek, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;

/// What a body's bytes hash to, and how many there are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BodySeal {
    pub len: u64,
    pub sha256: [u8; 32],
}

/// SHA-256 of the bytes at positions `0..to`, fed in order.
#[derive(Clone, Default)]
pub struct RunningSeal {
    hasher: Sha256,
    to: u64,
}

impl RunningSeal {
    pub fn update(&mut self, bytes: &[u8]) {
        self.hasher.update(bytes);
        self.to += bytes.len() as u64;
    }

    pub fn seal(&self) -> BodySeal {
        BodySeal {
            len: self.to,
            sha256: self.hasher.clone().finalize().into(),
        }
    }
}

/// A snapshot body's file, or the promise of one being written.
pub struct SnapshotSpool {
    state: State,
    /// A seek asked for, made once the body is complete.
    pending_seek: Option<SeekFrom>,
    /// A seek was started on the file and has not completed.
    seeking: bool,
    /// The file position the next read or write starts at.
    position: u64,
    /// A body written here: what reads must find, and what they found so far.
    read_check: Option<(BodySeal, RunningSeal)>,
    /// A body received here: the hash of the chunks written so far, while they came in
    /// order (`None` once one was written again).
    received: Option<RunningSeal>,
}

enum State {
    Ready(tokio::fs::File),
    /// The writer sends the file, rewound, and its seal once the whole body is in it.
    Writing(oneshot::Receiver<io::Result<(std::fs::File, BodySeal)>>),
    /// The writer failed (or went away), or the body read back was not the body
    /// written: every operation fails with this.
    Failed(io::ErrorKind, String),
}

impl SnapshotSpool {
    /// An empty spool to receive a body in.
    pub fn receiving(file: std::fs::File) -> Self {
        SnapshotSpool {
            received: Some(RunningSeal::default()),
            ..Self::with_state(State::Ready(tokio::fs::File::from_std(file)))
        }
    }

    /// A spool holding a body from elsewhere (unchecked: no seal came with it).
    pub fn ready(file: std::fs::File) -> Self {
        Self::with_state(State::Ready(tokio::fs::File::from_std(file)))
    }

    fn with_state(state: State) -> Self {
        SnapshotSpool {
            state,
            pending_seek: None,
            seeking: false,
            position: 0,
            read_check: None,
            received: None,
        }
    }

    /// The spool of a snapshot that was only built (openraft keeps its meta alone): no
    /// body, and nothing that can fail to be made. Reading it is an error.
    pub fn no_body() -> Self {
        Self::with_state(State::Failed(
            io::ErrorKind::Unsupported,
            "a built snapshot carries no body: ask for the current one".into(),
        ))
    }

    /// A spool whose body `write` produces on a blocking thread, returning the file
    /// rewound and the seal of what it wrote. Reading it waits for that, and is checked
    /// against the seal.
    pub fn written_by(
        write: impl FnOnce() -> io::Result<(std::fs::File, BodySeal)> + Send + 'static,
    ) -> Self {
        let (done, written) = oneshot::channel();
        tokio::task::spawn_blocking(move || {
            // Nobody to tell when the spool was dropped first (a send cancelled).
            let _ = done.send(write());
        });
        Self::with_state(State::Writing(written))
    }

    /// The file, once its body is complete, with every write made through the spool on
    /// disk (tokio may hold the last one); and, for a body received in order, the seal
    /// of the bytes as they arrived, for the install to hold the file to.
    pub async fn into_file(mut self) -> io::Result<(std::fs::File, Option<BodySeal>)> {
        std::future::poll_fn(|cx| self.poll_file(cx).map_ok(drop)).await?;
        let seal = self.received.as_ref().map(RunningSeal::seal);
        match self.state {
            State::Ready(mut file) => {
                tokio::io::AsyncWriteExt::flush(&mut file).await?;
                Ok((file.into_std().await, seal))
            }
            State::Writing(_) | State::Failed(..) => Err(io::Error::other("spool not ready")),
        }
    }

    /// After `bytes` were read at the current position (`at_end`: the read found the
    /// file's end): a body written here is hashed as it is read for the first time, and
    /// the read that reaches its end fails if the bytes are not the ones written, as does
    /// a read past that end or an end found early. (Bytes read again, for a chunk resent,
    /// were hashed the first time.)
    fn after_read(&mut self, bytes: &[u8], at_end: bool) -> io::Result<()> {
        let start = self.position;
        self.position += bytes.len() as u64;
        let Some((seal, running)) = &mut self.read_check else {
            return Ok(());
        };
        let problem = if self.position > seal.len {
            Some(format!("is longer than the {} bytes written", seal.len))
        } else if at_end && self.position < seal.len {
            Some(format!(
                "ends after {} of the {} bytes written",
                self.position, seal.len
            ))
        } else if start <= running.to && self.position > running.to {
            running.update(&bytes[(running.to - start) as usize..]);
            (running.to == seal.len && running.seal() != *seal)
                .then(|| "is not the body written: its SHA-256 differs".to_string())
        } else {
            None
        };
        let Some(problem) = problem else {
            return Ok(());
        };
        let message = format!(
            "the snapshot body read back from its spool {problem}: the spool was damaged, so it is not sent"
        );
        tracing::error!("{message}");
        self.state = State::Failed(io::ErrorKind::InvalidData, message.clone());
        Err(io::Error::new(io::ErrorKind::InvalidData, message))
    }

    /// After `bytes` were written at the current position: a received body is hashed
    /// while its chunks come in order; one written again loses the seal.
    fn after_write(&mut self, bytes: &[u8]) {
        let start = self.position;
        self.position += bytes.len() as u64;
        if let Some(running) = &mut self.received {
            if start == running.to {
                running.update(bytes);
            } else {
                tracing::warn!(
                    offset = start,
                    "a snapshot chunk was received out of order or again: this body is checked by its parse and record chains only"
                );
                self.received = None;
            }
        }
    }

    /// The file once the body is complete, with a seek asked for meanwhile made.
    fn poll_file(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<&mut tokio::fs::File>> {
        if let State::Writing(written) = &mut self.state {
            self.state = match ready!(Pin::new(written).poll(cx)) {
                Ok(Ok((file, seal))) => {
                    self.read_check = Some((seal, RunningSeal::default()));
                    State::Ready(tokio::fs::File::from_std(file))
                }
                Ok(Err(e)) => State::Failed(e.kind(), e.to_string()),
                Err(_) => State::Failed(io::ErrorKind::Other, "the body's writer went away".into()),
            };
        }
        match &mut self.state {
            State::Ready(file) => {
                // Whatever is in flight (a write, an earlier seek) completes first: tokio
                // refuses to start a seek beside another operation.
                if self.seeking || self.pending_seek.is_some() {
                    let done = ready!(Pin::new(&mut *file).poll_complete(cx));
                    // A seek of ours in flight says where it went; anything else
                    // answers tokio's last seek position, which reads do not move.
                    let was_seeking = std::mem::take(&mut self.seeking);
                    let position = done?;
                    if was_seeking {
                        self.position = position;
                    }
                }
                if let Some(position) = self.pending_seek.take() {
                    Pin::new(&mut *file).start_seek(position)?;
                    self.seeking = true;
                    let done = ready!(Pin::new(&mut *file).poll_complete(cx));
                    self.seeking = false;
                    self.position = done?;
                }
                Poll::Ready(Ok(file))
            }
            State::Failed(kind, message) => {
                Poll::Ready(Err(io::Error::new(*kind, message.clone())))
            }
            // Left just above, whatever the writer sent.
            State::Writing(_) => {
                Poll::Ready(Err(io::Error::other("the spool is still being written")))
            }
        }
    }
}

impl AsyncRead for SnapshotSpool {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let had_room = buf.remaining() > 0;
        let file = ready!(this.poll_file(cx))?;
        ready!(Pin::new(file).poll_read(cx, buf))?;
        let read = &buf.filled()[before..];
        let checked = this.after_read(read, had_room && read.is_empty());
        if checked.is_err() {
            // A read that fails hands out nothing.
            buf.set_filled(before);
        }
        Poll::Ready(checked)
    }
}

impl AsyncWrite for SnapshotSpool {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let file = ready!(this.poll_file(cx))?;
        let written = ready!(Pin::new(file).poll_write(cx, buf))?;
        this.after_write(&buf[..written]);
        Poll::Ready(Ok(written))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let file = ready!(self.get_mut().poll_file(cx))?;
        Pin::new(file).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let file = ready!(self.get_mut().poll_file(cx))?;
        Pin::new(file).poll_shutdown(cx)
    }
}

impl AsyncSeek for SnapshotSpool {
    fn start_seek(self: Pin<&mut Self>, position: SeekFrom) -> io::Result<()> {
        // Kept until the body is complete, so a seek from the end finds the whole body.
        self.get_mut().pending_seek = Some(position);
        Ok(())
    }

    fn poll_complete(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<u64>> {
        let this = self.get_mut();
        let file = ready!(this.poll_file(cx))?;
        // Any seek was made by `poll_file`, which noted where it went; tokio's own answer
        // here is its last seek's, not moved by reads since.
        ready!(Pin::new(file).poll_complete(cx))?;
        Poll::Ready(Ok(this.position))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

    use super::*;

    fn seal_of(bytes: &[u8]) -> BodySeal {
        let mut running = RunningSeal::default();
        running.update(bytes);
        running.seal()
    }

    /// A writer that takes a while, so every call below finds the body unfinished.
    fn slow_body(body: &'static [u8]) -> SnapshotSpool {
        spool_sealed_as(body, body)
    }

    /// A spool holding `stored`, sealed as though `written` had been written: the spool
    /// damaged between the two.
    fn spool_sealed_as(stored: &'static [u8], written: &'static [u8]) -> SnapshotSpool {
        SnapshotSpool::written_by(move || {
            std::thread::sleep(Duration::from_millis(200));
            let mut file = tempfile::tempfile()?;
            file.write_all(stored)?;
            std::io::Seek::rewind(&mut file)?;
            Ok((file, seal_of(written)))
        })
    }

    /// Reads the spool from `offset` up to `len` bytes, as openraft reads a chunk.
    async fn chunk(spool: &mut SnapshotSpool, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        spool.seek(SeekFrom::Start(offset)).await?;
        let mut buf = vec![0; len];
        let mut filled = 0;
        while filled < len {
            let n = spool.read(&mut buf[filled..]).await?;
            if n == 0 {
                break;
            }
            filled += n;
        }
        buf.truncate(filled);
        Ok(buf)
    }

    #[tokio::test]
    async fn a_body_read_back_in_chunks_is_held_to_what_was_written() {
        let mut good = slow_body(b"0123456789");
        assert_eq!(chunk(&mut good, 0, 4).await.unwrap(), b"0123");
        // The first chunk again (its answer was lost), then the rest.
        assert_eq!(chunk(&mut good, 0, 4).await.unwrap(), b"0123");
        assert_eq!(chunk(&mut good, 4, 4).await.unwrap(), b"4567");
        assert_eq!(chunk(&mut good, 8, 4).await.unwrap(), b"89");

        let mut damaged = spool_sealed_as(b"0123X56789", b"0123456789");
        assert_eq!(chunk(&mut damaged, 0, 4).await.unwrap(), b"0123");
        assert_eq!(chunk(&mut damaged, 4, 4).await.unwrap(), b"X567");
        let error = chunk(&mut damaged, 8, 4).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData, "{error}");
        assert!(error.to_string().contains("SHA-256 differs"), "{error}");
        // And it stays refused.
        assert!(chunk(&mut damaged, 0, 4).await.is_err());

        let mut cut = spool_sealed_as(b"01234", b"0123456789");
        let error = cut.read_to_end(&mut Vec::new()).await.unwrap_err();
        assert!(
            error.to_string().contains("ends after 5 of the 10 bytes"),
            "{error}"
        );
        let mut longer = spool_sealed_as(b"0123456789+", b"0123456789");
        let error = chunk(&mut longer, 8, 4).await.unwrap_err();
        assert!(
            error.to_string().contains("longer than the 10 bytes"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn a_received_body_is_sealed_as_its_chunks_arrive_in_order() {
        let mut spool = SnapshotSpool::receiving(tempfile::tempfile().unwrap());
        spool.write_all(b"hello ").await.unwrap();
        spool.seek(SeekFrom::Start(6)).await.unwrap();
        spool.write_all(b"world").await.unwrap();
        let (_, seal) = spool.into_file().await.unwrap();
        assert_eq!(seal, Some(seal_of(b"hello world")));

        let mut again = SnapshotSpool::receiving(tempfile::tempfile().unwrap());
        again.write_all(b"hello ").await.unwrap();
        again.seek(SeekFrom::Start(0)).await.unwrap();
        again.write_all(b"hello world").await.unwrap();
        let (_, seal) = again.into_file().await.unwrap();
        assert_eq!(
            seal, None,
            "a chunk written again leaves no seal to hold it to"
        );
    }

    #[tokio::test]
    async fn a_seek_from_the_end_finds_the_whole_body() {
        let mut spool = slow_body(b"0123456789");
        assert_eq!(spool.seek(SeekFrom::End(0)).await.unwrap(), 10);
        assert_eq!(spool.seek(SeekFrom::Start(4)).await.unwrap(), 4);
        let mut rest = String::new();
        spool.read_to_string(&mut rest).await.unwrap();
        assert_eq!(rest, "456789");
    }

    #[tokio::test]
    async fn a_read_waits_for_the_body_and_a_failed_writer_fails_every_call() {
        let mut spool = slow_body(b"abc");
        let mut all = Vec::new();
        spool.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"abc");

        let mut failed = SnapshotSpool::written_by(|| {
            Err(io::Error::new(io::ErrorKind::StorageFull, "disk full"))
        });
        let error = failed.read_to_end(&mut Vec::new()).await.unwrap_err();
        assert_eq!(
            (error.kind(), error.to_string()),
            (io::ErrorKind::StorageFull, "disk full".into())
        );
        let error = failed.seek(SeekFrom::End(0)).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::StorageFull);
        assert!(failed.into_file().await.is_err());
    }

    #[tokio::test]
    async fn a_received_body_written_at_offsets_reads_back_from_its_file() {
        let mut spool = SnapshotSpool::receiving(tempfile::tempfile().unwrap());
        spool.write_all(b"hello ").await.unwrap();
        spool.seek(SeekFrom::Start(6)).await.unwrap();
        spool.write_all(b"world").await.unwrap();
        let (mut file, _) = spool.into_file().await.unwrap();
        std::io::Seek::rewind(&mut file).unwrap();
        let mut text = String::new();
        std::io::Read::read_to_string(&mut file, &mut text).unwrap();
        assert_eq!(text, "hello world");
    }
}
