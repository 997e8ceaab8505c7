//! Host discovery through a user script, as `horovodrun --host-discovery-script` does it.
//!
//! The script prints one `host[:slots]` a line. [`parse_discovery_output`] is the pure parser;
//! [`ScriptDiscovery`] runs the script under a timeout and feeds its output to the parser.

use std::collections::HashMap;
use std::io;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

use crate::HostSpec;

/// The most stdout a discovery script may print; a host list is a few KiB, so more is a bug.
pub const MAX_OUTPUT_BYTES: usize = 1 << 20;

/// The most of a malformed line (or of a host name) an error quotes: enough to recognise it,
/// while a megabyte of garbage on one line still makes a readable log line.
pub const MAX_QUOTED: usize = 200;

/// `s`, cut to at most [`MAX_QUOTED`] bytes (at a character boundary) with `…` when cut.
fn clip(s: &str) -> String {
    if s.len() <= MAX_QUOTED {
        return s.to_string();
    }
    let mut end = MAX_QUOTED;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Why discovery produced no host list.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// A line of output is malformed.
    #[error("{origin}: line {line} '{text}': {reason}")]
    Line {
        /// Where the output came from (`discovery script ./d.sh`).
        origin: String,
        /// 1-based line number.
        line: usize,
        /// The line as printed, trimmed and cut to [`MAX_QUOTED`] bytes.
        text: String,
        /// What is wrong with it.
        reason: String,
    },
    /// One host is given two different slot counts.
    #[error(
        "{origin}: line {line}: host '{host}' has {slots} slots, but line {first_line} gave it \
         {first_slots}"
    )]
    Conflict {
        /// Where the output came from.
        origin: String,
        /// The host.
        host: String,
        /// 1-based line of the second mention.
        line: usize,
        /// Slots on that line.
        slots: usize,
        /// 1-based line of the first mention.
        first_line: usize,
        /// Slots on the first line.
        first_slots: usize,
    },
    /// The output is not UTF-8.
    #[error("discovery script {script}: output is not UTF-8 (bad byte at offset {offset})")]
    NotUtf8 {
        /// The script as configured.
        script: String,
        /// Offset of the first invalid byte.
        offset: usize,
    },
    /// The script printed more than [`MAX_OUTPUT_BYTES`].
    #[error("discovery script {script}: printed more than {limit} bytes; killed")]
    TooMuchOutput {
        /// The script as configured.
        script: String,
        /// The limit it crossed.
        limit: usize,
    },
    /// `/bin/sh` could not be started.
    #[error("discovery script {script}: could not start /bin/sh: {source}")]
    Spawn {
        /// The script as configured.
        script: String,
        /// What the OS reported.
        #[source]
        source: io::Error,
    },
    /// Reading the output or waiting for the script failed.
    #[error("discovery script {script}: {context}: {source}")]
    Io {
        /// The script as configured.
        script: String,
        /// What was being done.
        context: &'static str,
        /// What the OS reported.
        #[source]
        source: io::Error,
    },
    /// The script ran past its timeout; its whole process group was killed.
    #[error("discovery script {script}: did not finish within {timeout:?}; killed")]
    Timeout {
        /// The script as configured.
        script: String,
        /// The timeout it ran past.
        timeout: Duration,
    },
    /// The script exited non-zero or was killed by a signal.
    #[error("discovery script {script}: failed ({status})")]
    Failed {
        /// The script as configured.
        script: String,
        /// Its exit code or signal.
        status: ExitStatus,
    },
}

/// Parses discovery output: one `host[:slots]` a line, blank lines and `#` lines ignored.
///
/// A bare host gets `default_slots` (`--slots`); `host:0` is a host with no slots. A host repeated
/// with the same slots counts once; hosts keep the order they first appear in. Empty output is
/// an empty list, not an error.
///
/// # Errors
/// [`DiscoveryError::Line`] or [`DiscoveryError::Conflict`], naming the line.
pub fn parse_discovery_output(
    text: &str,
    default_slots: Option<usize>,
) -> Result<Vec<HostSpec>, DiscoveryError> {
    parse_from("discovery output", text, default_slots)
}

fn parse_from(
    origin: &str,
    text: &str,
    default_slots: Option<usize>,
) -> Result<Vec<HostSpec>, DiscoveryError> {
    let mut out: Vec<HostSpec> = Vec::new();
    // host -> (index in `out`, line it first appeared on)
    let mut seen: HashMap<String, (usize, usize)> = HashMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |reason: String| DiscoveryError::Line {
            origin: origin.into(),
            line: i + 1,
            text: clip(line),
            reason,
        };
        let spec = parse_line(line, default_slots).map_err(bad)?;
        match seen.get(&spec.host) {
            Some(&(idx, first_line)) if out[idx].slots != spec.slots => {
                return Err(DiscoveryError::Conflict {
                    origin: origin.into(),
                    host: clip(&spec.host),
                    line: i + 1,
                    slots: spec.slots,
                    first_line,
                    first_slots: out[idx].slots,
                });
            }
            Some(_) => {}
            None => {
                seen.insert(spec.host.clone(), (out.len(), i + 1));
                out.push(spec);
            }
        }
    }
    Ok(out)
}

fn parse_line(line: &str, default_slots: Option<usize>) -> Result<HostSpec, String> {
    let mut parts = line.split(':');
    let host = parts.next().unwrap_or("").trim();
    let slots = parts.next().map(str::trim);
    if parts.next().is_some() {
        return Err("too many ':'".into());
    }
    if host.is_empty() {
        return Err("empty host name".into());
    }
    if host.chars().any(char::is_whitespace) {
        return Err(format!("whitespace in host name '{}'", clip(host)));
    }
    // The static parsers reject these too: they would break `-H` lists and shell commands.
    if host.chars().any(|c| matches!(c, ',' | '\'' | '"' | ';')) {
        return Err(format!(
            "host '{}' contains a character a host name can't have",
            clip(host)
        ));
    }
    let slots = match slots {
        // `usize::from_str` accepts a leading '+', which is not part of the grammar.
        Some(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => s
            .parse::<usize>()
            .map_err(|_| format!("slots '{}' is too large", clip(s)))?,
        Some(s) => {
            return Err(format!("slots '{}' is not a non-negative integer", clip(s)));
        }
        None => default_slots.ok_or_else(|| "no slots given and no --slots".to_string())?,
    };
    Ok(HostSpec {
        host: host.into(),
        slots,
    })
}

/// Runs a host discovery script and parses what it prints.
///
/// The script runs as `/bin/sh -c <script>` in its own process group, with stdin from
/// `/dev/null` and stderr passed through. Output is what it printed before it exited: anything it
/// left running in its process group is killed then, so a background child holding stdout open
/// cannot stall discovery.
#[derive(Debug, Clone)]
pub struct ScriptDiscovery {
    script: String,
    timeout: Duration,
    default_slots: Option<usize>,
}

impl ScriptDiscovery {
    /// A runner for `script` (a path or a shell command line), killed after `timeout`; bare hosts
    /// get `default_slots`.
    pub fn new(script: String, timeout: Duration, default_slots: Option<usize>) -> Self {
        Self {
            script,
            timeout,
            default_slots,
        }
    }

    /// The script as configured, for log lines.
    pub fn script(&self) -> &str {
        &self.script
    }

    /// Runs the script once and returns the hosts it printed (possibly none).
    ///
    /// Dropping the future kills the script's process group.
    ///
    /// # Errors
    /// A [`DiscoveryError`] naming the script: it could not start, timed out, printed too much,
    /// exited non-zero, or printed something that does not parse.
    pub async fn discover(&self) -> Result<Vec<HostSpec>, DiscoveryError> {
        let script = || self.script.clone();
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(&self.script)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| DiscoveryError::Spawn {
                script: script(),
                source,
            })?;
        let mut group = GroupGuard::new(&child);
        let deadline = tokio::time::Instant::now() + self.timeout;
        let run = tokio::time::timeout_at(deadline, collect(&mut child, &mut group));
        let (status, bytes) = match run.await {
            Ok(Ok(done)) => done,
            Ok(Err(fail)) => {
                group.kill();
                reap(&mut child).await;
                return Err(match fail {
                    Collect::TooMuch => DiscoveryError::TooMuchOutput {
                        script: script(),
                        limit: MAX_OUTPUT_BYTES,
                    },
                    Collect::Io(context, source) => DiscoveryError::Io {
                        script: script(),
                        context,
                        source,
                    },
                });
            }
            Err(_elapsed) => {
                group.kill();
                reap(&mut child).await;
                return Err(DiscoveryError::Timeout {
                    script: script(),
                    timeout: self.timeout,
                });
            }
        };
        if !status.success() {
            return Err(DiscoveryError::Failed {
                script: script(),
                status,
            });
        }
        let text = std::str::from_utf8(&bytes).map_err(|e| DiscoveryError::NotUtf8 {
            script: script(),
            offset: e.valid_up_to(),
        })?;
        parse_from(
            &format!("discovery script {}", self.script),
            text,
            self.default_slots,
        )
    }
}

/// Why collecting a script's output stopped early.
enum Collect {
    TooMuch,
    Io(&'static str, io::Error),
}

/// Reads stdout (capped) while waiting for the shell; once it exits, kills what it left behind so
/// the pipe reaches EOF.
async fn collect(
    child: &mut Child,
    group: &mut GroupGuard,
) -> Result<(ExitStatus, Vec<u8>), Collect> {
    let Some(stdout) = child.stdout.take() else {
        return Err(Collect::Io(
            "reading output",
            io::Error::other("stdout was not captured"),
        ));
    };
    let read = async move {
        let mut buf = Vec::new();
        let cap = u64::try_from(MAX_OUTPUT_BYTES).unwrap_or(u64::MAX);
        let mut limited = stdout.take(cap.saturating_add(1));
        match limited.read_to_end(&mut buf).await {
            Ok(_) if buf.len() > MAX_OUTPUT_BYTES => Err(Collect::TooMuch),
            Ok(_) => Ok(buf),
            Err(e) => Err(Collect::Io("reading output", e)),
        }
    };
    tokio::pin!(read);
    let mut early: Option<Vec<u8>> = None;
    let status = tokio::select! {
        status = child.wait() => status,
        bytes = &mut read => {
            // EOF before exit: the script closed stdout but is still running.
            early = Some(bytes?);
            child.wait().await
        }
    }
    .map_err(|e| Collect::Io("waiting for the script", e))?;
    group.kill_and_disarm();
    let bytes = match early {
        Some(bytes) => bytes,
        None => read.await?,
    };
    Ok((status, bytes))
}

/// Waits for a killed child so it leaves no zombie; `kill_on_drop` covers the case where this is
/// itself cancelled.
async fn reap(child: &mut Child) {
    let _ = child.start_kill();
    let _ = child.wait().await;
}

/// Kills the script's process group unless disarmed, including when `discover` is cancelled.
struct GroupGuard {
    pgid: Option<Pid>,
}

impl GroupGuard {
    fn new(child: &Child) -> Self {
        let pgid = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .map(Pid::from_raw);
        Self { pgid }
    }

    fn kill(&self) {
        if let Some(pgid) = self.pgid {
            // ESRCH just means the group is already gone.
            let _ = killpg(pgid, Signal::SIGKILL);
        }
    }

    /// Kills what is left and forgets the group: once the leader is reaped its id may be reused,
    /// so it must not be signalled again.
    fn kill_and_disarm(&mut self) {
        self.kill();
        self.pgid = None;
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn spec(h: &str, s: usize) -> HostSpec {
        HostSpec {
            host: h.into(),
            slots: s,
        }
    }

    fn err(text: &str, default_slots: Option<usize>) -> String {
        parse_discovery_output(text, default_slots)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn parses_hosts_comments_and_crlf() {
        let text = "# hosts\r\n\r\n  node1:4  \r\nnode2 : 2\r\n   # indented comment\n\tnode3:0\n";
        assert_eq!(
            parse_discovery_output(text, None).unwrap(),
            vec![spec("node1", 4), spec("node2", 2), spec("node3", 0)]
        );
        // A final line without a newline, and a lone trailing CR.
        assert_eq!(
            parse_discovery_output("a:1\nb:2\r", None).unwrap(),
            vec![spec("a", 1), spec("b", 2)]
        );
    }

    #[test]
    fn empty_output_is_no_hosts() {
        for text in ["", "\n", "\r\n\r\n", "# none today\n", "   \n\t\n"] {
            assert_eq!(
                parse_discovery_output(text, None).unwrap(),
                vec![],
                "{text:?}"
            );
        }
    }

    #[test]
    fn bare_hosts_need_default_slots() {
        assert_eq!(
            parse_discovery_output("a\nb:3\n", Some(2)).unwrap(),
            vec![spec("a", 2), spec("b", 3)]
        );
        assert_eq!(
            err("a:1\nb\n", None),
            "discovery output: line 2 'b': no slots given and no --slots"
        );
    }

    #[test]
    fn malformed_lines_name_line_and_text() {
        for (text, want) in [
            ("a:1\nb:2\nh:1:2\n", "line 3 'h:1:2': too many ':'"),
            (
                "h:x",
                "line 1 'h:x': slots 'x' is not a non-negative integer",
            ),
            (
                "h:-1",
                "line 1 'h:-1': slots '-1' is not a non-negative integer",
            ),
            (
                "h:+1",
                "line 1 'h:+1': slots '+1' is not a non-negative integer",
            ),
            ("h:", "line 1 'h:': slots '' is not a non-negative integer"),
            (
                "h:1.5",
                "line 1 'h:1.5': slots '1.5' is not a non-negative integer",
            ),
            (
                "h:99999999999999999999999",
                "line 1 'h:99999999999999999999999': slots '99999999999999999999999' is too large",
            ),
            ("# c\n:2\n", "line 2 ':2': empty host name"),
            (" :2", "line 1 ':2': empty host name"),
            (
                "my host:2",
                "line 1 'my host:2': whitespace in host name 'my host'",
            ),
            ("a b", "line 1 'a b': whitespace in host name 'a b'"),
            (
                "h;rm:2",
                "line 1 'h;rm:2': host 'h;rm' contains a character",
            ),
            ("h:2 # gpus", "line 1 'h:2 # gpus': slots '2 # gpus' is not"),
        ] {
            let e = err(text, Some(1));
            assert!(e.starts_with("discovery output: "), "{text:?}: {e}");
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn duplicates() {
        assert_eq!(
            parse_discovery_output("a:2\nb:1\na:2\n", None).unwrap(),
            vec![spec("a", 2), spec("b", 1)]
        );
        // A bare host that resolves to the same slots is the same entry.
        assert_eq!(
            parse_discovery_output("a:2\na\n", Some(2)).unwrap(),
            vec![spec("a", 2)]
        );
        assert_eq!(
            err("a:2\nb:1\n\na:4\n", None),
            "discovery output: line 4: host 'a' has 4 slots, but line 1 gave it 2"
        );
        let e = parse_discovery_output("a:2\na:0", None).unwrap_err();
        assert!(
            matches!(
                e,
                DiscoveryError::Conflict {
                    line: 2,
                    slots: 0,
                    first_line: 1,
                    first_slots: 2,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    /// A fresh directory under the system temp dir, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            static N: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "hvd-discovery-test-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        fn script(&self, name: &str, body: &str) -> String {
            let path = self.0.join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            path.display().to_string()
        }

        fn path(&self, name: &str) -> PathBuf {
            self.0.join(name)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Waits up to 2 s for the process whose pid was written to `pidfile` to be gone.
    fn assert_dies(pidfile: &Path) {
        let pid = std::fs::read_to_string(pidfile).unwrap();
        let stat = format!("/proc/{}/stat", pid.trim());
        for _ in 0..200 {
            match std::fs::read_to_string(&stat) {
                Err(_) => return,
                // A zombie is dead; only its parent's reaping is pending.
                Ok(s)
                    if s.rsplit(')')
                        .next()
                        .is_some_and(|r| r.trim_start().starts_with('Z')) =>
                {
                    return;
                }
                Ok(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        panic!("process {} still running", pid.trim());
    }

    async fn run(script: &str, timeout: Duration) -> Result<Vec<HostSpec>, DiscoveryError> {
        let d = ScriptDiscovery::new(script.into(), timeout, Some(1));
        // Every awaited test future gets an outer bound.
        tokio::time::timeout(Duration::from_secs(10), d.discover())
            .await
            .expect("discover() hung")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn script_success() {
        let dir = TempDir::new();
        let s = dir.script(
            "ok.sh",
            "echo '# hosts'\necho node1:2\necho node2\necho 'warn' >&2\n",
        );
        assert_eq!(
            run(&s, Duration::from_secs(5)).await.unwrap(),
            vec![spec("node1", 2), spec("node2", 1)]
        );
        // A command line works as well as a path.
        assert_eq!(
            run("printf 'a:1\\r\\nb:2\\r\\n'", Duration::from_secs(5))
                .await
                .unwrap(),
            vec![spec("a", 1), spec("b", 2)]
        );
        assert_eq!(run("true", Duration::from_secs(5)).await.unwrap(), vec![]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn script_failure() {
        let dir = TempDir::new();
        let s = dir.script("fail.sh", "echo node1:2\nexit 3\n");
        let e = run(&s, Duration::from_secs(5)).await.unwrap_err();
        match &e {
            DiscoveryError::Failed { script, status } => {
                assert_eq!(script, &s);
                assert_eq!(status.code(), Some(3));
            }
            other => panic!("{other:?}"),
        }
        assert!(
            e.to_string()
                .starts_with(&format!("discovery script {s}: failed (")),
            "{e}"
        );

        let e = run("kill -9 $$", Duration::from_secs(5)).await.unwrap_err();
        assert!(e.to_string().contains("SIGKILL"), "{e}");

        let missing = dir.path("missing.sh").display().to_string();
        let e = run(&missing, Duration::from_secs(5)).await.unwrap_err();
        assert!(
            matches!(&e, DiscoveryError::Failed { status, .. } if status.code() == Some(127)),
            "{e:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn script_bad_output() {
        let dir = TempDir::new();
        let s = dir.script("bad.sh", "echo a:1\necho b:2\necho h:1:2\n");
        let e = run(&s, Duration::from_secs(5)).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("discovery script {s}: line 3 'h:1:2': too many ':'")
        );

        let e = run("printf 'a:1\\n\\377\\n'", Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(
            matches!(e, DiscoveryError::NotUtf8 { offset: 4, .. }),
            "{e:?}"
        );

        let e = run("yes h:1", Duration::from_secs(5)).await.unwrap_err();
        assert!(
            matches!(
                e,
                DiscoveryError::TooMuchOutput {
                    limit: MAX_OUTPUT_BYTES,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    /// The contract for any output: hosts that parse back from their own `host:slots` lines,
    /// or an error naming the line (its number, its text, cut to [`MAX_QUOTED`]) and why.
    fn check_output(
        text: &str,
        default_slots: Option<usize>,
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        use proptest::prelude::*;
        match parse_discovery_output(text, default_slots) {
            Ok(hosts) => {
                let printed: String = hosts
                    .iter()
                    .map(|h| format!("{}:{}\n", h.host, h.slots))
                    .collect();
                prop_assert_eq!(parse_discovery_output(&printed, None).unwrap(), hosts);
            }
            Err(DiscoveryError::Line {
                origin,
                line,
                text: quoted,
                reason,
            }) => {
                prop_assert_eq!(origin, "discovery output");
                let raw = text.lines().nth(line - 1).unwrap_or_default().trim();
                prop_assert!(
                    quoted.len() <= MAX_QUOTED + '…'.len_utf8(),
                    "{}",
                    quoted.len()
                );
                prop_assert!(
                    raw.starts_with(quoted.trim_end_matches('…')),
                    "{quoted:?} vs {raw:?}"
                );
                prop_assert!(
                    !reason.is_empty() && reason.len() < 2 * MAX_QUOTED + 100,
                    "{reason}"
                );
            }
            Err(DiscoveryError::Conflict {
                line,
                first_line,
                slots,
                first_slots,
                ..
            }) => {
                prop_assert!(first_line < line && slots != first_slots);
            }
            Err(e) => prop_assert!(false, "not a parse error: {e}"),
        }
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(1000))]

        /// Random text, with and without `--slots`.
        #[test]
        fn random_output_parses_or_names_the_line(
            text in "(?s).{0,160}",
            default_slots in proptest::option::of(0usize..8),
        ) {
            check_output(&text, default_slots)?;
        }

        /// Real output edited: cut, characters replaced, text inserted, spans repeated, long runs.
        #[test]
        fn mutated_output_parses_or_names_the_line(
            text in "([a-z0-9.-]{1,10}(:[0-9]{1,3})?\r?\n|# [a-z ]*\n){0,8}",
            edits in proptest::collection::vec(
                (0u8..5, proptest::prelude::any::<usize>(), "(?s).{0,6}|99999999999999999999999|:"),
                0..5,
            ),
            default_slots in proptest::option::of(1usize..8),
        ) {
            let text = crate::hosts::tests::mutate(&text, &edits);
            check_output(&text, default_slots)?;
        }
    }

    /// A megabyte of garbage on one line is an error of a readable size.
    #[test]
    fn a_huge_bad_line_is_quoted_in_part() {
        let text = format!("a:1\n{}:{}\n", "h".repeat(600_000), "9".repeat(400_000));
        let e = err(&text, None);
        assert!(
            e.starts_with("discovery output: line 2 'hhh"),
            "{}",
            &e[..100]
        );
        assert!(e.len() < 1000, "{} bytes", e.len());
        assert!(e.contains("is too large"), "{e}");
        // A cut never splits a character.
        let e = err(&format!("{}\n", "é h".repeat(1000)), None);
        assert!(e.contains("…"), "{e}");
    }

    /// Scripts printing random bytes: each run is an error naming the script, or hosts; a
    /// good script run after them works.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn scripts_printing_random_bytes_fail_cleanly() {
        use proptest::strategy::{Strategy, ValueTree};
        let dir = TempDir::new();
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let junk = proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4096);
        for i in 0..8 {
            let mut bytes = junk.new_tree(&mut runner).unwrap().current();
            if i % 2 == 0 {
                // ASCII from a host list's alphabet, so these runs reach the parser.
                bytes
                    .iter_mut()
                    .for_each(|b| *b = b"ab:1\n# \t9"[usize::from(*b) % 9]);
            }
            let out = dir.path(&format!("out{i}"));
            std::fs::write(&out, &bytes).unwrap();
            let s = dir.script(&format!("junk{i}.sh"), &format!("cat {}\n", out.display()));
            match run(&s, Duration::from_secs(5)).await {
                Ok(hosts) => assert!(hosts.iter().all(|h| !h.host.is_empty())),
                Err(e) => assert!(
                    e.to_string().starts_with(&format!("discovery script {s}")),
                    "{e}"
                ),
            }
        }
        let s = dir.script("good.sh", "echo a:2\n");
        assert_eq!(
            run(&s, Duration::from_secs(5)).await.unwrap(),
            vec![spec("a", 2)]
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn hanging_script_is_killed_at_timeout() {
        let dir = TempDir::new();
        let pidfile = dir.path("pid");
        let s = dir.script(
            "hang.sh",
            &format!("echo a:1\necho $$ > {}\nsleep 30\n", pidfile.display()),
        );
        let started = std::time::Instant::now();
        let e = run(&s, Duration::from_millis(300)).await.unwrap_err();
        let took = started.elapsed();
        assert!(took < Duration::from_secs(2), "took {took:?}");
        assert!(took >= Duration::from_millis(300), "took {took:?}");
        match &e {
            DiscoveryError::Timeout { script, timeout } => {
                assert_eq!(script, &s);
                assert_eq!(*timeout, Duration::from_millis(300));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            e.to_string(),
            format!("discovery script {s}: did not finish within 300ms; killed")
        );
        assert_dies(&pidfile);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn background_child_holding_stdout_does_not_stall() {
        let dir = TempDir::new();
        let pidfile = dir.path("pid");
        let s = dir.script(
            "bg.sh",
            &format!(
                "echo a:2\nsleep 30 &\necho $! > {}\necho b:1\n",
                pidfile.display()
            ),
        );
        let started = std::time::Instant::now();
        let hosts = run(&s, Duration::from_secs(5)).await.unwrap();
        let took = started.elapsed();
        assert_eq!(hosts, vec![spec("a", 2), spec("b", 1)]);
        assert!(took < Duration::from_secs(2), "took {took:?}");
        assert_dies(&pidfile);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn script_closing_stdout_early_still_times_out() {
        let started = std::time::Instant::now();
        let e = run("echo a:1; exec >&-; sleep 30", Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(matches!(e, DiscoveryError::Timeout { .. }), "{e:?}");
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn cancelled_discover_kills_the_group() {
        let dir = TempDir::new();
        let pidfile = dir.path("pid");
        let s = dir.script(
            "slow.sh",
            &format!("echo $$ > {}\nsleep 30\n", pidfile.display()),
        );
        let d = ScriptDiscovery::new(s, Duration::from_secs(60), None);
        let cut = tokio::time::timeout(Duration::from_millis(300), d.discover()).await;
        assert!(cut.is_err());
        assert_dies(&pidfile);
    }
}
