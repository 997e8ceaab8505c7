//! A Debian package the tests need, installed on first use when its binary is missing (with
//! apt, as root): etcd's `etcd-server`, Prometheus' `prometheus` (for `promtool`). A lock
//! directory makes the test processes that get here at once install it once.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The path of `binary` (in /usr/bin or /usr/local/bin), installing `package` if it is
/// missing.
///
/// # Panics
/// When the binary is missing and the package could not be installed.
pub fn installed(binary: &str, package: &str) -> PathBuf {
    let found = || {
        ["/usr/bin", "/usr/local/bin"]
            .iter()
            .map(|d| PathBuf::from(d).join(binary))
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
    let install = ["install", "-y", "-qq", "--no-install-recommends", package];
    let lock = std::env::temp_dir().join(format!("hvd-{package}-install.lock"));
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
    found().unwrap_or_else(|| {
        panic!("{binary} is not installed and could not be (apt-get install {package}, as root)")
    })
}
