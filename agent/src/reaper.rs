//! Reaping orphans. As a container's PID 1 (or a child subreaper) the agent inherits every
//! process whose parent died, such as the children of a stopped training process; nobody
//! else waits for them, so without this they stay zombies for the life of the pod.
//!
//! The agent's own children are waited for by the tasks that started them; taking their exit
//! status here would rob those tasks of it. So they are registered in [`CHILDREN`] while
//! they are spawned (under the lock) and until they are reaped, and only zombies that are
//! not among them are reaped here.

use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use nix::sys::wait::{WaitPidFlag, waitpid};
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};

/// Process ids of the agent's own live children.
static CHILDREN: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

/// How often orphans are looked for even without a SIGCHLD.
const SWEEP: Duration = Duration::from_secs(1);

/// The set of the agent's own children, locked.
pub(crate) fn children() -> MutexGuard<'static, BTreeSet<i32>> {
    CHILDREN.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Reaps zombie children that the agent did not start itself, whenever a child exits (and
/// once a second); runs until the runtime ends. Meant for an agent that is PID 1 or a child
/// subreaper.
///
/// # Errors
/// When SIGCHLD can't be watched.
pub async fn reap_orphans() -> std::io::Result<()> {
    let mut sigchld = signal(SignalKind::child())?;
    let me = std::process::id();
    loop {
        let reaped = sweep(me);
        if reaped > 0 {
            tracing::debug!(reaped, "reaped orphaned processes");
        }
        let _ = tokio::time::timeout(SWEEP, sigchld.recv()).await;
    }
}

/// Reaps every zombie whose parent is `me` and that is not one of [`CHILDREN`]; returns how
/// many it reaped.
fn sweep(me: u32) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut reaped = 0;
    let own = children();
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if own.contains(&pid) || !zombie_child_of(pid, me) {
            continue;
        }
        // A zombie's pid can't be reused before it is reaped, so this waits for that one.
        if waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)).is_ok() {
            reaped += 1;
        }
    }
    reaped
}

/// Whether process `pid` is a zombie whose parent is `parent`, from `/proc/PID/stat`.
fn zombie_child_of(pid: i32, parent: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split at the last ')'.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return false;
    };
    let mut fields = rest.split_whitespace();
    fields.next() == Some("Z") && fields.next().and_then(|p| p.parse::<u32>().ok()) == Some(parent)
}
