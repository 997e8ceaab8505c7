//! Noticing a child's death when it begins, not when the kernel has finished it.
//!
//! A process killed by a signal (SIGKILL, the OOM killer, a crash) is reported ended (its
//! sockets closed, its parent's `wait` answered) only once the kernel has freed its memory:
//! 40–60 ms for a framework worker of a few hundred MB on a busy host, seconds for one of
//! tens of GB. Before that teardown the kernel marks the process as exiting, records its wait
//! status and detaches its address space. A parent that looks for the detached address space
//! (a one-byte `process_vm_readv`, a few microseconds) and then reads the status from
//! `/proc` can report the failure while the memory is still being freed, so the job re-forms
//! without waiting for it. A process that exits 0 is left to its `wait`, which reports it
//! after its last output.

use std::fs::File;
use std::io::IoSliceMut;
use std::os::unix::fs::FileExt;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::uio::{RemoteIoVec, process_vm_readv};
use nix::unistd::Pid;
use tokio::sync::oneshot;

/// How often the children are looked at. A look costs about 4 µs a child; the watching
/// thread's wake-up costs more in a VM (here about 20 µs), so every 2 ms all of it takes
/// 1–2% of one core here, and a death is seen 1 ms later on average than at every 1 ms.
pub const EVERY: Duration = Duration::from_millis(2);

/// `PF_EXITING` in the flags of `/proc/<pid>/stat`: the task has begun to exit.
const PF_EXITING: u64 = 0x4;

/// The wait status in a `/proc/<pid>/stat` line of a task that is exiting with a failure
/// (killed by a signal, or a nonzero exit code); `None` while it runs, when it exits 0,
/// when the status is hidden from the reader, or when the line can't be parsed.
pub fn failing_status(stat: &str) -> Option<i32> {
    // The command, field 2, is in parentheses and may hold spaces and parentheses itself.
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
    // Fields are numbered from 1, and `rest` starts at field 3 (the state).
    let field = |n: usize| fields.get(n - 3).copied();
    let flags: u64 = field(9)?.parse().ok()?;
    let status: i32 = field(52)?.parse().ok()?;
    (flags & PF_EXITING != 0 && status != 0).then_some(status)
}

/// Resolves with the wait status of process `pid` (a child of this process, or one it may
/// trace) once it has begun to die of a failure. Never resolves when it exits 0, when its
/// `/proc` entry can't be read, or once it is gone: its `wait` reports those. Every watched
/// process is looked at by one thread, which wakes every [`EVERY`] while there is one: a
/// timer per process would wake the runtime that often for each, a few percent of a core
/// apiece.
pub async fn failing(pid: i32) -> i32 {
    // The main thread's own entry: the process's entry sums every thread's figures, which
    // costs more and says nothing more here.
    let Ok(stat) = File::open(format!("/proc/{pid}/task/{pid}/stat")) else {
        return std::future::pending().await;
    };
    let (tx, rx) = oneshot::channel();
    let watched = Watched {
        probe: Probe::new(pid),
        stat,
        tell: tx,
    };
    if !watcher().add(watched) {
        return std::future::pending().await;
    }
    match rx.await {
        Ok(status) => status,
        // Reaped, or its status unreadable: its `wait` tells.
        Err(_) => std::future::pending().await,
    }
}

/// Waits for child `pid` (the process of `child`) until it either ends (`None`: its `wait`
/// now answers at once) or begins to die of a failure, whichever comes first: then its wait
/// status, and what is left of its process group is given the lowest priority
/// ([`yield_cores`]). The one place a launcher races a child's `wait` against its death.
pub async fn ended_or_failing(
    child: &mut tokio::process::Child,
    pid: Option<i32>,
) -> Option<std::process::ExitStatus> {
    use std::os::unix::process::ExitStatusExt;
    let Some(pid) = pid else {
        let _ = child.wait().await;
        return None;
    };
    let status = tokio::select! {
        biased;
        _ = child.wait() => return None,
        status = failing(pid) => status,
    };
    yield_cores(pid);
    Some(std::process::ExitStatus::from_raw(status))
}

/// One process being watched.
struct Watched {
    probe: Probe,
    stat: File,
    tell: oneshot::Sender<i32>,
}

impl Watched {
    /// `Some(status)` once it is dying of a failure; `Err(())` when there is nothing more to
    /// watch (reaped, or nobody waits for the answer).
    fn look(&mut self) -> Result<Option<i32>, ()> {
        if self.tell.is_closed() {
            return Err(());
        }
        if self.probe.attached() {
            return Ok(None);
        }
        let mut line = [0u8; 1024];
        let read = self.stat.read_at(&mut line, 0).map_err(|_| ())?;
        Ok(std::str::from_utf8(&line[..read])
            .ok()
            .and_then(failing_status))
    }
}

/// The one thread that looks at every watched process.
struct Watcher {
    watched: Mutex<Vec<Watched>>,
    more: Condvar,
}

/// The process's watcher, its thread started on first use.
fn watcher() -> &'static Watcher {
    static WATCHER: OnceLock<Watcher> = OnceLock::new();
    WATCHER.get_or_init(|| Watcher {
        watched: Mutex::new(Vec::new()),
        more: Condvar::new(),
    })
}

impl Watcher {
    /// Adds a process; false when the thread can't be started.
    fn add(&'static self, w: Watched) -> bool {
        static STARTED: OnceLock<bool> = OnceLock::new();
        let started = *STARTED.get_or_init(|| {
            std::thread::Builder::new()
                .name("hvd-dying".into())
                .spawn(move || self.run())
                .map_err(|e| tracing::warn!(error = %e, "no thread to watch for dying processes"))
                .is_ok()
        });
        if started {
            self.lock().push(w);
            self.more.notify_one();
        }
        started
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Watched>> {
        self.watched.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn run(&self) {
        loop {
            {
                let mut watched = self.lock();
                while watched.is_empty() {
                    watched = self
                        .more
                        .wait(watched)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
            std::thread::sleep(EVERY);
            let mut watched = self.lock();
            let mut i = 0;
            while i < watched.len() {
                match watched[i].look() {
                    Ok(None) => i += 1,
                    Ok(Some(status)) => {
                        let _ = watched.swap_remove(i).tell.send(status);
                    }
                    Err(()) => {
                        watched.swap_remove(i);
                    }
                }
            }
        }
    }
}

/// Gives what is left of process group `pgid`, dying or being killed, the lowest priority:
/// the kernel frees a killed process's memory on that process's own time, and at its usual
/// priority that takes a core from the workers that stay on the host just as they re-form.
pub fn yield_cores(pgid: i32) {
    let Some(group) = rustix::process::Pid::from_raw(pgid) else {
        return;
    };
    if let Err(e) = rustix::process::setpriority_pgrp(Some(group), LOWEST_PRIORITY) {
        tracing::debug!(pgid, error = %e, "could not lower the priority of a dying process group");
    }
}

/// The nice value of a process group whose work no longer counts.
const LOWEST_PRIORITY: i32 = 19;

/// Looks at whether a process still has its address space, by reading one byte of it.
struct Probe {
    pid: Pid,
    /// An address mapped in the process; `None` when none is known (it is looked for again).
    at: Option<usize>,
    /// `process_vm_readv` is refused (another user, a stricter ptrace scope): only `/proc`.
    refused: bool,
}

impl Probe {
    fn new(pid: i32) -> Self {
        Self {
            pid: Pid::from_raw(pid),
            at: None,
            refused: false,
        }
    }

    /// True while the process certainly runs with its memory; false when it may not (the
    /// caller then reads its status).
    fn attached(&mut self) -> bool {
        if self.refused {
            return false;
        }
        let Some(at) = self.at.or_else(|| first_mapping(self.pid)) else {
            return false;
        };
        self.at = Some(at);
        let mut byte = [0u8; 1];
        let mut local = [IoSliceMut::new(&mut byte)];
        let remote = [RemoteIoVec { base: at, len: 1 }];
        match process_vm_readv(self.pid, &mut local, &remote) {
            Ok(_) => true,
            Err(Errno::EPERM) => {
                self.refused = true;
                false
            }
            Err(Errno::EFAULT) => {
                // It exec'd or unmapped the page: look for another next time.
                self.at = None;
                false
            }
            Err(_) => false,
        }
    }
}

/// The start of the first mapping in `/proc/<pid>/maps`.
fn first_mapping(pid: Pid) -> Option<usize> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let (start, _) = maps.lines().next()?.split_once('-')?;
    usize::from_str_radix(start, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Command, ExitStatus};

    /// A stat line as Linux writes it, with these flags and exit code.
    fn line(comm: &str, flags: u64, exit_code: i32) -> String {
        let mut fields: Vec<String> = (3..=52).map(|_| "0".to_string()).collect();
        fields[0] = "R".into();
        fields[9 - 3] = flags.to_string();
        fields[52 - 3] = exit_code.to_string();
        format!("4242 ({comm}) {}\n", fields.join(" "))
    }

    #[test]
    fn a_task_exiting_with_a_signal_or_a_nonzero_code_gives_its_wait_status() {
        assert_eq!(failing_status(&line("python", 0x40_4144, 9)), Some(9));
        let status = failing_status(&line("python", PF_EXITING, 3 << 8)).unwrap();
        assert_eq!(ExitStatus::from_raw(status).code(), Some(3));
        assert_eq!(ExitStatus::from_raw(9).signal(), Some(9));
    }

    #[test]
    fn a_running_task_a_clean_exit_and_a_hidden_status_give_nothing() {
        assert_eq!(failing_status(&line("python", 0x40_4140, 0)), None);
        // Exiting with 0, or a reader not allowed to see the code (shown as 0).
        assert_eq!(failing_status(&line("python", 0x40_4144, 0)), None);
        // A status without the exiting flag is a stale one, not a death.
        assert_eq!(failing_status(&line("python", 0x40_4140, 9)), None);
    }

    #[test]
    fn a_command_with_spaces_and_parentheses_is_skipped_whole() {
        assert_eq!(failing_status(&line("a) (b c", PF_EXITING, 9)), Some(9));
        assert_eq!(failing_status("4242 (python) R 1 2"), None);
        assert_eq!(failing_status("garbage"), None);
    }

    #[test]
    fn the_kernels_own_line_of_a_live_process_parses_as_running() {
        let me = std::process::id();
        let stat = std::fs::read_to_string(format!("/proc/{me}/task/{me}/stat")).unwrap();
        assert_eq!(failing_status(&stat), None);
        assert!(stat.rsplit_once(')').is_some());
    }

    #[tokio::test]
    async fn one_thread_watches_every_child_and_tells_each_its_own_death() {
        let mut children: Vec<_> = (0..5)
            .map(|_| Command::new("sleep").arg("30").spawn().unwrap())
            .collect();
        let watches: Vec<_> = children
            .iter()
            .map(|c| tokio::spawn(failing(i32::try_from(c.id()).unwrap())))
            .collect();
        tokio::time::sleep(Duration::from_millis(20)).await;
        children[1].kill().unwrap();
        children[3].kill().unwrap();
        let mut watches: Vec<Option<_>> = watches.into_iter().map(Some).collect();
        for i in [1, 3] {
            let status = tokio::time::timeout(Duration::from_secs(10), watches[i].take().unwrap())
                .await
                .expect("each death is told")
                .unwrap();
            assert_eq!(ExitStatus::from_raw(status).signal(), Some(9));
        }
        for i in [0, 2, 4] {
            assert!(
                !watches[i].as_ref().unwrap().is_finished(),
                "child {i} lives"
            );
        }
        let me = std::process::id();
        let threads = std::fs::read_dir(format!("/proc/{me}/task"))
            .unwrap()
            .flatten()
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|c| c.trim() == "hvd-dying")
            })
            .count();
        assert_eq!(threads, 1, "one watching thread for every child");
        for w in watches.into_iter().flatten() {
            w.abort();
        }
        for c in &mut children {
            let _ = c.kill();
            c.wait().unwrap();
        }
    }

    #[tokio::test]
    async fn a_killed_child_is_reported_with_its_signal_and_a_clean_one_is_not() {
        let mut killed = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = i32::try_from(killed.id()).unwrap();
        let watch = tokio::spawn(failing(pid));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!watch.is_finished(), "a live child is not failing");
        killed.kill().unwrap();
        let status = tokio::time::timeout(Duration::from_secs(10), watch)
            .await
            .expect("the death is noticed")
            .unwrap();
        assert_eq!(ExitStatus::from_raw(status).signal(), Some(9));
        killed.wait().unwrap();

        let mut clean = Command::new("true").spawn().unwrap();
        let pid = i32::try_from(clean.id()).unwrap();
        let watch = tokio::spawn(failing(pid));
        assert!(clean.wait().unwrap().success());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!watch.is_finished(), "an exit 0 is left to wait");
        watch.abort();

        let mut failed = Command::new("sh")
            .args(["-c", "sleep 0.05; exit 3"])
            .spawn()
            .unwrap();
        let pid = i32::try_from(failed.id()).unwrap();
        let status = tokio::time::timeout(Duration::from_secs(10), failing(pid))
            .await
            .expect("a nonzero exit is noticed");
        assert_eq!(ExitStatus::from_raw(status).code(), Some(3));
        failed.wait().unwrap();
    }
}
