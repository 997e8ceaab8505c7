//! The stderr every hvd process logs to. A launcher relays its processes' stderr through a
//! pipe; when the launcher dies (an agent killed, a `horovodrun | tee` whose `tee` ended) the
//! pipe breaks, and a log line must not end the process: `tracing-subscriber` reports a failed
//! write with `eprintln!`, which panics on that same broken pipe.

use std::io::{self, Write};

/// A writer whose writes never fail: what the inner one can't take is dropped.
#[derive(Debug)]
pub struct Lossy<W>(pub W);

/// Stderr as [`Lossy`]; give this function to `tracing_subscriber::fmt().with_writer(..)`.
#[must_use]
pub fn log_stderr() -> Lossy<io::Stderr> {
    Lossy(io::stderr())
}

impl<W: Write> Write for Lossy<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // A lost line is the lesser harm: nobody reads this stream any more.
        Ok(self.0.write(buf).unwrap_or(buf.len()))
    }

    fn flush(&mut self) -> io::Result<()> {
        let _ = self.0.flush();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Broken;

    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> io::Result<()> {
            Err(io::ErrorKind::BrokenPipe.into())
        }
    }

    #[test]
    fn a_broken_stream_takes_whole_lines_and_flushes() {
        let mut w = Lossy(Broken);
        // `write_all` would fail with WriteZero on a short count, as `writeln!` would.
        w.write_all(b"a log line\n").unwrap();
        writeln!(w, "another").unwrap();
        w.flush().unwrap();
    }

    #[test]
    fn a_working_stream_gets_every_byte() {
        let mut w = Lossy(Vec::new());
        w.write_all(b"one\n").unwrap();
        assert_eq!(w.0, b"one\n");
    }
}
