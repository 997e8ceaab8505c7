//! The timeline: a Chrome trace (`chrome://tracing`, Perfetto) of what each rank's engine did
//! and when: negotiation, fusion copies, transport, cycles, elastic resets.
//!
//! Every rank appends its events to one file, one JSON object a line, each written with a
//! single `write` on a file opened for appending, so ranks' lines never interleave. The
//! launcher creates the file with the opening `[`; the trace format needs no closing `]`, so
//! a job that dies still leaves a readable trace. A rank is a process in the viewer, an op a
//! thread row; timestamps are wall-clock microseconds, so ranks line up.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Where this rank's events go.
#[derive(Debug)]
pub struct Timeline {
    file: Mutex<File>,
    rank: usize,
    /// Wall clock (µs since the epoch) at `origin`.
    wall_at_origin: u64,
    origin: Instant,
    /// Whether every engine cycle is marked.
    pub mark_cycles: bool,
}

/// `s` as a JSON string literal.
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl Timeline {
    /// Opens `path` for appending this rank's events (creating it with `[` if it is new).
    ///
    /// # Errors
    /// The file can't be opened.
    pub fn open(path: &Path, rank: usize, mark_cycles: bool) -> io::Result<Self> {
        let mut file = OpenOptions::new().create(true).append(true).open(path)?;
        if file.metadata()?.len() == 0 {
            file.write_all(b"[\n")?;
        }
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        Ok(Self {
            file: Mutex::new(file),
            rank,
            wall_at_origin: wall,
            origin: Instant::now(),
            mark_cycles,
        })
    }

    fn us(&self, t: Instant) -> u64 {
        let since = t.saturating_duration_since(self.origin).as_micros() as u64;
        self.wall_at_origin + since
    }

    fn write(&self, line: String) {
        let mut f = self
            .file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // A trace that can't be written must not stop training; the next event tries again.
        let _ = f.write_all(line.as_bytes());
    }

    /// A span `[start, end)` named `name` on row `row` (an op name), with `args` as JSON object
    /// members (`"fused":3`) or empty.
    pub fn span(&self, row: &str, name: &str, start: Instant, end: Instant, args: &str) {
        let dur = end.saturating_duration_since(start).as_micros();
        self.write(format!(
            "{{\"ph\":\"X\",\"pid\":{},\"tid\":{},\"name\":{},\"ts\":{},\"dur\":{},\"args\":{{{}}}}},\n",
            self.rank,
            json_str(row),
            json_str(name),
            self.us(start),
            dur,
            args
        ));
    }

    /// A moment named `name` on row `row`.
    pub fn instant(&self, row: &str, name: &str, at: Instant, args: &str) {
        self.write(format!(
            "{{\"ph\":\"i\",\"s\":\"p\",\"pid\":{},\"tid\":{},\"name\":{},\"ts\":{},\"args\":{{{}}}}},\n",
            self.rank,
            json_str(row),
            json_str(name),
            self.us(at),
            args
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_lines_of_a_loadable_trace() {
        let path = std::env::temp_dir().join(format!("hvd-timeline-{}.json", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let t0 = Instant::now();
        for rank in 0..2 {
            let t = Timeline::open(&path, rank, false).unwrap();
            t.span("grad \"w\"", "ALLREDUCE", t0, Instant::now(), "\"fused\":2");
            t.instant("elastic", "RESET", Instant::now(), "");
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(text.starts_with("[\n"));
        assert_eq!(text.matches("[\n").count(), 1, "the header is written once");
        // Closed, it is a JSON array of events.
        let closed = format!("{}]", text.trim_end().trim_end_matches(','));
        let v: Vec<serde_json::Value> = serde_json::from_str(&closed).unwrap();
        assert_eq!(v.len(), 4);
        assert_eq!(v[0]["tid"], "grad \"w\"");
        assert_eq!(v[0]["args"]["fused"], 2);
        assert_eq!(v[3]["pid"], 1);
    }
}
