//! A real browser for the status page: Debian's `chromium`, headless, installed on first use
//! when missing (with apt, as root; a lock directory makes parallel test processes install
//! once).

#[path = "../../../store/tests/support/debian.rs"]
mod debian;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The `chromium` binary, installed if missing.
pub fn chromium() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| debian::installed("chromium", "chromium"))
}

/// Runs headless Chromium on `url` with `args` (after its scripts ran for up to 3 s of
/// virtual time); returns its stdout. Each run gets its own profile directory under `dir`.
fn headless(dir: &Path, url: &str, args: &[&str]) -> String {
    let profile = dir.join(format!("chromium-{}", args.len()));
    let out = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox", // as root, Chromium refuses to start with its sandbox
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--virtual-time-budget=3000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .output()
        .expect("run chromium");
    assert!(
        out.status.success(),
        "chromium {args:?} {url}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The DOM of the page at `url` once its scripts have rendered it.
pub fn dom(dir: &Path, url: &str) -> String {
    headless(dir, url, &["--dump-dom"])
}

/// A PNG screenshot of the page at `url`, `width` by `height` pixels, written to `png`.
pub fn screenshot(dir: &Path, url: &str, png: &Path, width: u32, height: u32) {
    headless(
        dir,
        url,
        &[
            &format!("--screenshot={}", png.display()),
            &format!("--window-size={width},{height}"),
            "--hide-scrollbars",
        ],
    );
}
