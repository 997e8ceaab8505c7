//! The driver's recent log lines, kept in memory for the status page: a second writer of the
//! log, plain text (no colour codes), the last [`LINES_KEPT`] lines.

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Mutex, OnceLock};

/// How many lines the tail keeps.
pub const LINES_KEPT: usize = 200;

/// The process's log tail, set once logging is installed.
static TAIL: OnceLock<LogTail> = OnceLock::new();

/// The last lines written to it; clones share them.
#[derive(Debug, Clone, Default)]
pub struct LogTail {
    lines: Arc<Mutex<VecDeque<String>>>,
    /// At most this many lines are kept.
    keep: usize,
}

impl LogTail {
    /// A tail of the last `keep` lines.
    pub fn new(keep: usize) -> Self {
        Self {
            lines: Arc::default(),
            keep,
        }
    }

    /// Appends the lines of `text`; the oldest fall off past the limit.
    pub fn push(&self, text: &str) {
        let mut lines = self
            .lines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            if lines.len() == self.keep {
                lines.pop_front();
            }
            lines.push_back(line.to_string());
        }
    }

    /// The lines kept, oldest first.
    pub fn lines(&self) -> Vec<String> {
        let lines = self
            .lines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        lines.iter().cloned().collect()
    }

    /// Makes this the process's tail, the one [`recent`] reads; a second call changes nothing.
    pub fn install(&self) {
        let _ = TAIL.set(self.clone());
    }
}

/// The process's recent log lines, oldest first (none when no tail was installed).
pub fn recent() -> Vec<String> {
    TAIL.get().map(LogTail::lines).unwrap_or_default()
}

/// What one log event writes into the tail: the formatter's whole line at once.
#[derive(Debug)]
pub struct TailWriter(LogTail);

impl io::Write for TailWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.push(&String::from_utf8_lossy(buf));
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogTail {
    type Writer = TailWriter;

    fn make_writer(&'a self) -> Self::Writer {
        TailWriter(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn the_tail_keeps_the_newest_lines_without_blanks() {
        let t = LogTail::new(3);
        t.push("one\n");
        t.push("two\n\nthree\n");
        t.push("four");
        assert_eq!(t.lines(), ["two", "three", "four"]);
    }

    #[test]
    fn a_subscriber_writes_its_events_into_the_tail_without_colour() {
        use tracing_subscriber::layer::SubscriberExt;
        let t = LogTail::new(10);
        let sub = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_target(false)
                .without_time()
                .with_writer(t.clone()),
        );
        tracing::subscriber::with_default(sub, || {
            tracing::warn!(host = "10.0.0.2", "host blacklisted");
        });
        assert_eq!(t.lines(), [" WARN host blacklisted host=\"10.0.0.2\""]);
        let mut w = tracing_subscriber::fmt::MakeWriter::make_writer(&t);
        w.write_all(b"raw\n").unwrap();
        assert_eq!(t.lines().last().map(String::as_str), Some("raw"));
    }
}
