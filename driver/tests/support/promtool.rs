//! `promtool check metrics` on an exposition: Debian's `prometheus` package, installed on
//! first use when `promtool` is missing (with apt, as root; a lock directory makes parallel
//! test processes install once).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

/// The `promtool` binary, installed if missing.
pub fn promtool() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let found = || {
            ["/usr/bin/promtool", "/usr/local/bin/promtool"]
                .iter()
                .map(PathBuf::from)
                .find(|p| p.exists())
        };
        if let Some(p) = found() {
            return p;
        }
        let apt = |args: &[&str]| {
            Command::new("apt-get")
                .args(args)
                .env("DEBIAN_FRONTEND", "noninteractive")
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        let install = [
            "install",
            "-y",
            "-qq",
            "--no-install-recommends",
            "prometheus",
        ];
        let lock = std::env::temp_dir().join("hvd-promtool-install.lock");
        for _ in 0..600 {
            if found().is_some() {
                break;
            }
            if std::fs::create_dir(&lock).is_ok() {
                if !apt(&install) {
                    apt(&["update", "-qq"]);
                    apt(&install);
                }
                let _ = std::fs::remove_dir(&lock);
                break;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        found().expect(
            "promtool is not installed and could not be (apt-get install prometheus, as root)",
        )
    })
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
