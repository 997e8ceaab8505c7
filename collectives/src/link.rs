//! The sockets of one communicator and the switch that tears them all down.
//!
//! Every peer has one TCP connection, held as two handles (`try_clone`) so that one thread can
//! read from it while another writes. Shutting every socket down is how a failure anywhere
//! reaches every blocked call at once: a rank that fails closes its connections, its neighbours'
//! reads end with an error at once, and they close theirs.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::error::CommError;

/// State shared between a communicator, its worker threads and its [`AbortHandle`]s.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// Set by [`AbortHandle::abort`].
    aborted: AtomicBool,
    /// Set by the first failure of any kind; later failures are consequences of it.
    tripped: AtomicBool,
    reason: Mutex<Option<String>>,
    streams: Mutex<Vec<TcpStream>>,
}

impl Shared {
    /// Adds `stream` to those a failure shuts down. A stream registered after the trip is shut
    /// down at once, so an abort that lands between a socket's creation and its registration
    /// still reaches it.
    pub(crate) fn register(&self, stream: &TcpStream) -> io::Result<()> {
        let clone = stream.try_clone()?;
        let mut streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
        if self.tripped.load(Ordering::SeqCst) {
            let _ = clone.shutdown(Shutdown::Both);
        }
        streams.push(clone);
        Ok(())
    }

    /// Shuts `stream` down and forgets it (a connection refused while the mesh forms: a
    /// stranger must see it close, and must not hold a descriptor until the mesh is built).
    pub(crate) fn unregister(&self, stream: &TcpStream) {
        let _ = stream.shutdown(Shutdown::Both);
        // Duplicates of one socket share its inode; no other open socket has it.
        let inode = |s: &TcpStream| {
            use std::os::unix::fs::MetadataExt;
            let fd = std::os::fd::AsFd::as_fd(s).try_clone_to_owned().ok()?;
            std::fs::File::from(fd).metadata().ok().map(|m| m.ino())
        };
        let Some(ino) = inode(stream) else { return };
        self.streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|s| inode(s) != Some(ino));
    }

    /// Forgets the registered streams without closing them (the connect phase hands its
    /// sockets over to the communicator, which registers its own duplicates).
    pub(crate) fn forget_streams(&self) {
        self.streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// Whether [`AbortHandle::abort`] has been called.
    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// Closes every socket; returns true for the caller whose failure came first.
    pub(crate) fn trip(&self) -> bool {
        let first = !self.tripped.swap(true, Ordering::SeqCst);
        for s in self
            .streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            // An already closed socket reports ENOTCONN here; nothing else to do for it.
            let _ = s.shutdown(Shutdown::Both);
        }
        first
    }

    pub(crate) fn abort_reason(&self) -> Option<String> {
        if !self.aborted.load(Ordering::SeqCst) {
            return None;
        }
        let reason = self
            .reason
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Some(reason.unwrap_or_else(|| "aborted".into()))
    }
}

/// Aborts a communicator from any thread: every blocked or later collective on it returns
/// [`CommError::Aborted`] promptly. Elastic reset uses it to cancel in-flight collectives.
///
/// A handle made with [`AbortHandle::new`] before connecting and passed to
/// [`crate::Communicator::connect_abortable`] also cancels the connecting itself: dialing,
/// accepting, the handshake and the agreements that follow it.
#[derive(Debug, Clone, Default)]
pub struct AbortHandle {
    pub(crate) shared: Arc<Shared>,
}

impl AbortHandle {
    /// A handle for a communicator not connected yet (see
    /// [`crate::Communicator::connect_abortable`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// Aborts the communicator, recording `reason` for the error its calls return.
    pub fn abort(&self, reason: impl Into<String>) {
        {
            let mut r = self
                .shared
                .reason
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            r.get_or_insert_with(|| reason.into());
        }
        self.shared.aborted.store(true, Ordering::SeqCst);
        self.shared.trip();
    }

    /// Whether [`AbortHandle::abort`] has been called.
    pub fn is_aborted(&self) -> bool {
        self.shared.aborted.load(Ordering::SeqCst)
    }
}

/// An I/O failure on the connection to one peer, before it is turned into a [`CommError`].
#[derive(Debug)]
pub(crate) struct LinkFailure {
    pub peer: usize,
    pub error: io::Error,
    /// Whether this was the first failure of the communicator (the cause, not a consequence).
    pub primary: bool,
}

impl LinkFailure {
    pub(crate) fn new(shared: &Shared, peer: usize, error: io::Error) -> Self {
        let primary = shared.trip();
        Self {
            peer,
            error,
            primary,
        }
    }

    /// Names the failure for the user: an abort, a timeout or a lost peer.
    pub(crate) fn into_error(
        self,
        shared: &Shared,
        op: &'static str,
        timeout: Duration,
    ) -> CommError {
        if let Some(reason) = shared.abort_reason() {
            return CommError::Aborted { reason };
        }
        match self.error.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => CommError::Timeout {
                rank: self.peer,
                op,
                waited: timeout,
            },
            _ => CommError::PeerLost {
                rank: self.peer,
                op,
                source: self.error,
            },
        }
    }
}

/// Reads exactly `buf.len()` bytes, treating a clean close as an error that says so.
pub(crate) fn read_full<R: Read + ?Sized>(stream: &mut R, buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match stream.read(&mut buf[done..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed by peer",
                ));
            }
            Ok(k) => done += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads and drops `len` bytes (the payload of a message that is being rejected).
pub(crate) fn discard<R: Read + ?Sized>(stream: &mut R, mut len: u64) -> io::Result<()> {
    let mut sink = [0u8; 8192];
    while len > 0 {
        let k = usize::try_from(len).unwrap_or(usize::MAX).min(sink.len());
        read_full(stream, &mut sink[..k])?;
        len -= k as u64;
    }
    Ok(())
}

/// Writes all of `buf`.
pub(crate) fn write_full(stream: &mut TcpStream, buf: &[u8]) -> io::Result<()> {
    stream.write_all(buf)
}
