//! Scratch directories of test processes that are gone (a run that was killed, a test that
//! failed), named `<prefix><pid>-…`, removed so that they do not pile up in `/tmp` or
//! `/dev/shm`.

use std::path::Path;

/// Removes the directories under `root` named `<prefix><pid>-…` whose process no longer runs
/// (this process's own stay).
pub fn sweep(root: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| p != std::process::id() && !running(p)) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Whether process `pid` runs (a zombie does not).
pub fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
    })
}
