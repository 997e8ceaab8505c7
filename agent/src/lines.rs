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
    use std::collections::VecDeque;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use std::time::Duration;

    use proptest::collection::vec;
    use proptest::prelude::*;
    use tokio::io::{AsyncWriteExt, ReadBuf};

    use super::*;

    /// The capacity of the [`BufReader`] under a [`LineReader`]: what it may read past a line.
    const READ_AHEAD: usize = 8 * 1024;

    /// A peer whose bytes arrive in the given pieces, then an end; `endless` more `x` bytes
    /// after them, never a newline. Counts what was taken from it.
    struct Peer {
        pieces: VecDeque<Vec<u8>>,
        endless: bool,
        taken: usize,
    }

    impl AsyncRead for Peer {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            let this = self.get_mut();
            let n = match this.pieces.front_mut() {
                Some(p) => {
                    let n = p.len().min(buf.remaining());
                    buf.put_slice(&p[..n]);
                    p.drain(..n);
                    if p.is_empty() {
                        this.pieces.pop_front();
                    }
                    n
                }
                None if this.endless => {
                    let n = buf.remaining();
                    buf.put_slice(&vec![b'x'; n]);
                    n
                }
                None => 0,
            };
            this.taken += n;
            Poll::Ready(Ok(()))
        }
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any bytes, cut into any pieces: the reader returns the stream's lines one by one,
        /// refuses the first longer than the limit, and never holds or takes much more than
        /// a line's limit.
        #[test]
        fn lines_come_whole_and_long_ones_are_refused(
            bytes in vec(prop_oneof![4 => any::<u8>(), 1 => Just(b'\n')], 0..2048),
            cuts in vec(1usize..64, 1..64),
            limit in 1usize..300,
        ) {
            let mut pieces = VecDeque::new();
            let mut rest = &bytes[..];
            for c in cuts.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (p, r) = rest.split_at((*c).min(rest.len()));
                pieces.push_back(p.to_vec());
                rest = r;
            }
            let mut lines = LineReader::new(Peer { pieces, endless: false, taken: 0 });
            let mut want = bytes.split_inclusive(|&b| b == b'\n');
            let mut returned = 0;
            block_on(async {
                loop {
                    // Owned, so the reader's buffer can be looked at.
                    let got = match lines.next(limit).await.unwrap() {
                        Line::Full(l) => Ok(l.to_vec()),
                        Line::TooLong(n) => Err(Some(n)),
                        Line::Eof => Err(None),
                    };
                    prop_assert!(lines.buf.capacity() <= 2 * (limit + 1) + 8);
                    match (got, want.next()) {
                        (Err(None), None) => break,
                        (Ok(l), Some(w)) => {
                            prop_assert!(l.len() <= limit);
                            prop_assert_eq!(&l[..], w);
                            returned += l.len();
                        }
                        (Err(Some(n)), Some(w)) => {
                            prop_assert!(w.len() > limit, "{} bytes refused", w.len());
                            prop_assert_eq!(n, limit + 1);
                            break;
                        }
                        (got, w) => prop_assert!(false, "{:?} for {:?}", got, w),
                    }
                    let taken = lines.reader.get_ref().taken;
                    prop_assert!(taken <= returned + READ_AHEAD, "{} taken", taken);
                }
                Ok(())
            })?;
        }
    }

    #[test]
    fn an_endless_line_is_refused_after_its_limit_without_reading_on() {
        for limit in [0, 1, 4096, 1 << 20] {
            let peer = Peer {
                pieces: VecDeque::from([b"ok\n".to_vec()]),
                endless: true,
                taken: 0,
            };
            let mut lines = LineReader::new(peer);
            block_on(async {
                if limit >= 3 {
                    assert_eq!(lines.next(limit).await.unwrap(), Line::Full(b"ok\n"));
                }
                assert!(matches!(lines.next(limit).await.unwrap(), Line::TooLong(_)));
            });
            let taken = lines.reader.get_ref().taken;
            assert!(taken <= limit + 1 + 3 + READ_AHEAD, "{taken} bytes read");
            assert!(
                lines.buf.capacity() <= 2 * (limit + 1) + 8,
                "{}",
                lines.buf.capacity()
            );
        }
    }

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
