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

use std::future::Future;
use std::io::{self, SeekFrom};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncSeek, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;

/// A snapshot body's file, or the promise of one being written.
pub struct SnapshotSpool {
    state: State,
    /// A seek asked for, made once the body is complete.
    pending_seek: Option<SeekFrom>,
    /// A seek was started on the file and has not completed.
    seeking: bool,
}

enum State {
    Ready(tokio::fs::File),
    /// The writer sends the file, rewound, once the whole body is in it.
    Writing(oneshot::Receiver<io::Result<std::fs::File>>),
    /// The writer failed (or went away): every operation fails with this.
    Failed(io::ErrorKind, String),
}

impl SnapshotSpool {
    /// A spool whose body is complete (or empty, to receive one).
    pub fn ready(file: std::fs::File) -> Self {
        SnapshotSpool {
            state: State::Ready(tokio::fs::File::from_std(file)),
            pending_seek: None,
            seeking: false,
        }
    }

    /// The spool of a snapshot that was only built (openraft keeps its meta alone): no
    /// body, and nothing that can fail to be made. Reading it is an error.
    pub fn no_body() -> Self {
        SnapshotSpool {
            state: State::Failed(
                io::ErrorKind::Unsupported,
                "a built snapshot carries no body: ask for the current one".into(),
            ),
            pending_seek: None,
            seeking: false,
        }
    }

    /// A spool whose body `write` produces on a blocking thread, returning the file
    /// rewound. Reading it waits for that.
    pub fn written_by(write: impl FnOnce() -> io::Result<std::fs::File> + Send + 'static) -> Self {
        let (done, written) = oneshot::channel();
        tokio::task::spawn_blocking(move || {
            // Nobody to tell when the spool was dropped first (a send cancelled).
            let _ = done.send(write());
        });
        SnapshotSpool {
            state: State::Writing(written),
            pending_seek: None,
            seeking: false,
        }
    }

    /// The file, once its body is complete, with every write made through the spool on
    /// disk (tokio may hold the last one).
    pub async fn into_file(mut self) -> io::Result<std::fs::File> {
        std::future::poll_fn(|cx| self.poll_file(cx).map_ok(drop)).await?;
        match self.state {
            State::Ready(mut file) => {
                tokio::io::AsyncWriteExt::flush(&mut file).await?;
                Ok(file.into_std().await)
            }
            State::Writing(_) | State::Failed(..) => Err(io::Error::other("spool not ready")),
        }
    }

    /// The file once the body is complete, with a seek asked for meanwhile made.
    fn poll_file(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<&mut tokio::fs::File>> {
        if let State::Writing(written) = &mut self.state {
            self.state = match ready!(Pin::new(written).poll(cx)) {
                Ok(Ok(file)) => State::Ready(tokio::fs::File::from_std(file)),
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
                    self.seeking = false;
                    done?;
                }
                if let Some(position) = self.pending_seek.take() {
                    Pin::new(&mut *file).start_seek(position)?;
                    self.seeking = true;
                    let done = ready!(Pin::new(&mut *file).poll_complete(cx));
                    self.seeking = false;
                    done?;
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
        let file = ready!(self.get_mut().poll_file(cx))?;
        Pin::new(file).poll_read(cx, buf)
    }
}

impl AsyncWrite for SnapshotSpool {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let file = ready!(self.get_mut().poll_file(cx))?;
        Pin::new(file).poll_write(cx, buf)
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
        let file = ready!(self.get_mut().poll_file(cx))?;
        Pin::new(file).poll_complete(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

    use super::*;

    /// A writer that takes a while, so every call below finds the body unfinished.
    fn slow_body(body: &'static [u8]) -> SnapshotSpool {
        SnapshotSpool::written_by(move || {
            std::thread::sleep(Duration::from_millis(200));
            let mut file = tempfile::tempfile()?;
            file.write_all(body)?;
            std::io::Seek::rewind(&mut file)?;
            Ok(file)
        })
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
        let mut spool = SnapshotSpool::ready(tempfile::tempfile().unwrap());
        spool.write_all(b"hello ").await.unwrap();
        spool.seek(SeekFrom::Start(6)).await.unwrap();
        spool.write_all(b"world").await.unwrap();
        let mut file = spool.into_file().await.unwrap();
        std::io::Seek::rewind(&mut file).unwrap();
        let mut text = String::new();
        std::io::Read::read_to_string(&mut file, &mut text).unwrap();
        assert_eq!(text, "hello world");
    }
}
