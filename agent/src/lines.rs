//! Reading newline-delimited messages in a way that survives cancellation: both ends read
//! inside `select!` loops, and a line half received when another branch fires must not be
//! lost.

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};

/// Reads lines of at most a given length; [`LineReader::next`] is cancel safe.
#[derive(Debug)]
pub(crate) struct LineReader<R> {
    reader: BufReader<R>,
    /// The line being received; bytes read by a cancelled call stay here.
    buf: Vec<u8>,
    /// Whether `buf` holds a line already returned, to clear before reading on.
    returned: bool,
}

/// What [`LineReader::next`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Line<'a> {
    /// The peer closed the connection between lines.
    Eof,
    /// A line longer than the limit; holds how many bytes were read before giving up.
    TooLong(usize),
    /// One line, with its newline when it had one (the last line of a stream may not).
    Full(&'a [u8]),
}

impl<R: AsyncRead + Unpin> LineReader<R> {
    /// Reads lines from `reader`.
    pub(crate) fn new(reader: R) -> Self {
        Self {
            reader: BufReader::new(reader),
            buf: Vec::new(),
            returned: false,
        }
    }

    /// The next line, refusing one of more than `limit` bytes (newline included).
    ///
    /// Cancel safe: when the future is dropped before it completes, the bytes it read are
    /// kept and the next call goes on with the same line.
    pub(crate) async fn next(&mut self, limit: usize) -> std::io::Result<Line<'_>> {
        if self.returned {
            self.buf.clear();
            self.returned = false;
        }
        // `read_until` appends what it reads to `buf` as it goes, so nothing is lost when
        // this future is dropped halfway; only a completed call marks the line as returned.
        let room = (limit + 1).saturating_sub(self.buf.len()) as u64;
        let read = (&mut self.reader)
            .take(room)
            .read_until(b'\n', &mut self.buf)
            .await;
        self.returned = true;
        let n = read?;
        if self.buf.len() > limit {
            Ok(Line::TooLong(self.buf.len()))
        } else if n == 0 && self.buf.is_empty() {
            Ok(Line::Eof)
        } else {
            Ok(Line::Full(&self.buf))
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncWriteExt;

    use super::*;

    #[tokio::test]
    async fn a_line_cut_by_cancellation_is_kept_whole() {
        let (mut w, r) = tokio::io::duplex(64);
        let mut lines = LineReader::new(r);
        w.write_all(b"{\"half\":").await.unwrap();
        // The read is cancelled with half a line received.
        let cut = tokio::time::timeout(Duration::from_millis(50), lines.next(100)).await;
        assert!(cut.is_err(), "no line yet");
        w.write_all(b"1}\nnext\n").await.unwrap();
        assert_eq!(
            lines.next(100).await.unwrap(),
            Line::Full(b"{\"half\":1}\n")
        );
        assert_eq!(lines.next(100).await.unwrap(), Line::Full(b"next\n"));
        w.write_all(b"last").await.unwrap();
        drop(w);
        assert_eq!(lines.next(100).await.unwrap(), Line::Full(b"last"));
        assert_eq!(lines.next(100).await.unwrap(), Line::Eof);
    }

    #[tokio::test]
    async fn the_limit_counts_bytes_read_before_a_cancellation() {
        let (mut w, r) = tokio::io::duplex(64);
        let mut lines = LineReader::new(r);
        w.write_all(b"0123456").await.unwrap();
        let cut = tokio::time::timeout(Duration::from_millis(50), lines.next(8)).await;
        assert!(cut.is_err());
        w.write_all(b"789\n").await.unwrap();
        assert_eq!(lines.next(8).await.unwrap(), Line::TooLong(9));
        let (mut w, r) = tokio::io::duplex(64);
        let mut lines = LineReader::new(r);
        w.write_all(b"0123456\n").await.unwrap();
        assert_eq!(lines.next(8).await.unwrap(), Line::Full(b"0123456\n"));
    }
}
