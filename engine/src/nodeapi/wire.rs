//! How a node API connection writes to its TLS stream.
//!
//! HTTP/2 writes in pieces: its preface on its own, then SETTINGS and a
//! request's HEADERS and DATA, and each write to the TLS stream becomes a
//! record and a segment of its own at once. [`Wire`] gathers the writes until
//! HTTP/2 flushes, so that one flight goes out as one record in one segment.
//! On loopback, and to a node next to the daemon, a segment's cost is mostly
//! the kernel's, and a workflow may open a connection per call.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Past this many bytes gathered, they are sent before more are taken.
const GATHER_UP_TO: usize = 16 * 1024;

/// A stream whose writes wait for a flush.
pub(super) struct Wire<T> {
    io: T,
    out: Vec<u8>,
    sent: usize,
}

impl<T> Wire<T> {
    pub(super) fn new(io: T) -> Wire<T> {
        Wire {
            io,
            out: Vec::new(),
            sent: 0,
        }
    }
}

impl<T: AsyncWrite + Unpin> Wire<T> {
    /// Writes out what is gathered.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.out.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.out[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.sent = 0;
        // A large request (a configuration) leaves no large buffer behind on
        // a connection that is kept.
        if self.out.capacity() > GATHER_UP_TO {
            self.out = Vec::new();
        } else {
            self.out.clear();
        }
        Poll::Ready(Ok(()))
    }

    /// Room for more writes: past the gathering bound, what is gathered is
    /// written out first.
    fn poll_room(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.out.len() >= GATHER_UP_TO {
            ready!(self.poll_send(cx))?;
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Wire<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Wire<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_room(cx))?;
        this.out.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_room(cx))?;
        for b in bufs {
            this.out.extend_from_slice(b);
        }
        Poll::Ready(Ok(bufs.iter().map(|b| b.len()).sum()))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Counts the writes that reach the stream under the wire.
    struct Counted<T> {
        io: T,
        writes: Arc<AtomicUsize>,
    }

    impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let this = self.get_mut();
            this.writes.fetch_add(1, Ordering::Relaxed);
            Pin::new(&mut this.io).poll_write(cx, buf)
        }
        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().io).poll_flush(cx)
        }
        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
        }
    }

    #[tokio::test]
    async fn writes_go_out_together_at_a_flush() {
        let (near, mut far) = tokio::io::duplex(1 << 20);
        let writes = Arc::new(AtomicUsize::new(0));
        let counted = Counted {
            io: near,
            writes: writes.clone(),
        };
        let mut wire = Wire::new(counted);
        wire.write_all(b"preface ").await.unwrap();
        wire.write_all(b"settings ").await.unwrap();
        let taken = wire
            .write_vectored(&[io::IoSlice::new(b"headers "), io::IoSlice::new(b"data")])
            .await
            .unwrap();
        assert_eq!(taken, 12, "both slices taken into the flight");
        assert_eq!(
            writes.load(Ordering::Relaxed),
            0,
            "nothing before the flush"
        );
        wire.flush().await.unwrap();
        assert_eq!(writes.load(Ordering::Relaxed), 1, "one write at the flush");
        let mut got = vec![0; 29];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"preface settings headers data");

        // More than the gathering bound goes out before more is taken.
        let big = vec![7u8; GATHER_UP_TO];
        wire.write_all(&big).await.unwrap();
        wire.write_all(b"x").await.unwrap();
        assert_eq!(writes.load(Ordering::Relaxed), 2);
        wire.flush().await.unwrap();
        let mut got = vec![0; GATHER_UP_TO + 1];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(got[GATHER_UP_TO], b'x');

        // A shutdown sends what is gathered, then ends the stream.
        wire.write_all(b"last").await.unwrap();
        wire.shutdown().await.unwrap();
        // The big flight, the "x" at its flush, then "last" at the shutdown.
        assert_eq!(writes.load(Ordering::Relaxed), 4);
        let mut rest = Vec::new();
        far.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"last");
    }
}
