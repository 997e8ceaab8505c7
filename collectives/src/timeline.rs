//! The timeline: a Chrome trace (`chrome://tracing`, Perfetto) of what each rank's engine did
//! and when: negotiation, fusion copies, transport, cycles, elastic resets.
//!
//! Every rank appends its events to one file, one JSON object a line, each written with a
//! single `write` on a file opened for appending, so ranks' lines never interleave. The
//! launcher creates the file with the opening `[`; the trace format needs no closing `]`, so
//! a job that dies still leaves a readable trace. A rank is a process in the viewer, an op a
//! thread row; timestamps are wall-clock microseconds, so ranks line up.
//!
//! Recording can start and stop while the job runs (Horovod's `start_timeline` and
//! `stop_timeline`): a stopped timeline costs one atomic load per event.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Where this rank's events go, while it records.
#[derive(Debug)]
pub struct Timeline {
    /// The open trace; `None` while stopped.
    file: Mutex<Option<File>>,
    active: AtomicBool,
    mark_cycles: AtomicBool,
    rank: usize,
    /// Wall clock (µs since the epoch) at `origin`.
    wall_at_origin: u64,
    origin: Instant,
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

/// Opens `path` for appending, creating it holding the trace's opening `[` if it does not
/// exist. Ranks starting one trace at once race to create it: the file appears by a hard
/// link of a complete one, so exactly one `[` is written and always first.
fn open_trace(path: &Path, rank: usize) -> io::Result<File> {
    if !path.exists() {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        let name = path
            .file_name()
            .map_or_else(Default::default, |n| n.to_os_string());
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(&name);
        tmp_name.push(format!(".{}.{rank}.new", std::process::id()));
        let tmp = dir.map_or_else(|| tmp_name.clone().into(), |d| d.join(&tmp_name));
        std::fs::write(&tmp, b"[\n")?;
        let linked = std::fs::hard_link(&tmp, path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    let mut file = OpenOptions::new().append(true).open(path)?;
    if file.metadata()?.len() == 0 {
        // An empty file someone else made (the launcher's, or a user's `touch`).
        file.write_all(b"[\n")?;
    }
    Ok(file)
}

impl Timeline {
    /// Opens `path` for appending this rank's events (creating it with `[` if it is new).
    ///
    /// # Errors
    /// The file can't be opened.
    pub fn open(path: &Path, rank: usize, mark_cycles: bool) -> io::Result<Self> {
        let t = Self::stopped(rank);
        t.start(path, mark_cycles)?;
        Ok(t)
    }

    /// A timeline for `rank` that records nothing until [`Timeline::start`].
    pub fn stopped(rank: usize) -> Self {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        Self {
            file: Mutex::new(None),
            active: AtomicBool::new(false),
            mark_cycles: AtomicBool::new(false),
            rank,
            wall_at_origin: wall,
            origin: Instant::now(),
        }
    }

    /// Starts recording into `path` (appending to a trace already there), in place of any
    /// file recorded into before; `mark_cycles` marks every engine cycle.
    ///
    /// # Errors
    /// The file can't be created or opened; the timeline is then stopped.
    pub fn start(&self, path: &Path, mark_cycles: bool) -> io::Result<()> {
        let mut f = self.lock();
        self.active.store(false, Ordering::Release);
        *f = Some(open_trace(path, self.rank)?);
        self.mark_cycles.store(mark_cycles, Ordering::Release);
        self.active.store(true, Ordering::Release);
        Ok(())
    }

    /// Stops recording and closes the file; events until then are in it.
    pub fn stop(&self) {
        let mut f = self.lock();
        self.active.store(false, Ordering::Release);
        *f = None;
    }

    /// Whether events are being recorded.
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    /// Whether every engine cycle is marked.
    pub fn marks_cycles(&self) -> bool {
        self.is_active() && self.mark_cycles.load(Ordering::Acquire)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<File>> {
        self.file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn us(&self, t: Instant) -> u64 {
        let since = t.saturating_duration_since(self.origin).as_micros() as u64;
        self.wall_at_origin + since
    }

    fn write(&self, line: String) {
        // A trace that can't be written must not stop training; the next event tries again.
        if let Some(f) = self.lock().as_mut() {
            let _ = f.write_all(line.as_bytes());
        }
    }

    /// A span `[start, end)` named `name` on row `row` (an op name), with `args` as JSON object
    /// members (`"fused":3`) or empty.
    pub fn span(&self, row: &str, name: &str, start: Instant, end: Instant, args: &str) {
        if !self.is_active() {
            return;
        }
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
        if !self.is_active() {
            return;
        }
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

    #[test]
    fn recording_starts_and_stops_while_running() {
        let dir = std::env::temp_dir().join(format!("hvd-timeline-switch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.json"), dir.join("b.json"));
        let t = Timeline::stopped(0);
        let now = Instant::now();
        t.span("x", "BEFORE", now, now, "");
        assert!(
            !t.is_active() && !a.exists(),
            "a stopped timeline writes nothing"
        );
        t.start(&a, true).unwrap();
        assert!(t.marks_cycles());
        t.span("x", "DURING", now, now, "");
        t.stop();
        t.span("x", "AFTER", now, now, "");
        assert!(!t.marks_cycles());
        t.start(&b, false).unwrap();
        t.instant("x", "SECOND", now, "");
        let text_a = std::fs::read_to_string(&a).unwrap();
        let text_b = std::fs::read_to_string(&b).unwrap();
        assert_eq!(text_a.lines().count(), 2, "{text_a}");
        assert!(
            text_a.contains("DURING") && !text_a.contains("AFTER"),
            "{text_a}"
        );
        assert!(
            text_b.starts_with("[\n") && text_b.contains("SECOND"),
            "{text_b}"
        );
        // A file that can't be created is an error, and leaves the timeline stopped.
        assert!(t.start(&dir.join("missing/c.json"), false).is_err());
        assert!(!t.is_active());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn ranks_starting_one_trace_at_once_write_one_header() {
        for round in 0..20 {
            let path =
                std::env::temp_dir().join(format!("hvd-race-{}-{round}.json", std::process::id()));
            let _ = std::fs::remove_file(&path);
            let threads: Vec<_> = (0..6)
                .map(|rank| {
                    let path = path.clone();
                    std::thread::spawn(move || {
                        let t = Timeline::open(&path, rank, false).unwrap();
                        t.instant("x", "HELLO", Instant::now(), "");
                    })
                })
                .collect();
            threads.into_iter().for_each(|t| t.join().unwrap());
            let text = std::fs::read_to_string(&path).unwrap();
            let _ = std::fs::remove_file(&path);
            assert!(text.starts_with("[\n"), "{text}");
            assert_eq!(text.matches('[').count(), 1, "{text}");
            assert_eq!(text.matches("HELLO").count(), 6, "{text}");
        }
    }
}
