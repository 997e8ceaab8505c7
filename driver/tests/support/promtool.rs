//! `promtool check metrics` on an exposition: Debian's `prometheus` package, installed on
//! first use when `promtool` is missing (with apt, as root; a lock directory makes parallel
//! test processes install once).

#[path = "../../../store/tests/support/debian.rs"]
mod debian;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// The `promtool` binary, installed if missing.
pub fn promtool() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| debian::installed("promtool", "prometheus"))
}

/// Runs `promtool check metrics` on `exposition`; returns its exit success and what it said.
pub fn check_metrics(exposition: &str) -> (bool, String) {
    let mut child = Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    child
        .stdin
        .take()
        .expect("promtool's stdin")
        .write_all(exposition.as_bytes())
        .expect("feed promtool");
    let out = child.wait_with_output().expect("promtool's answer");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

/// Asserts that `promtool check metrics` passes `exposition` with nothing to say.
pub fn assert_clean(exposition: &str) {
    let (ok, said) = check_metrics(exposition);
    assert!(
        ok && said.trim().is_empty(),
        "promtool check metrics: {said}\n{exposition}"
    );
}
