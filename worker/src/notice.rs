//! A SIGTERM to an elastic worker is a notice that its host is going away (a drained node, an
//! evicted pod, systemd shutting the machine down): the worker tells the driver, which takes the
//! host out of the job gracefully, and trains on until the round without it has formed; the
//! driver then removes it and it exits 0. A second SIGTERM, or the grace running out, ends it at
//! once, as SIGTERM's default would. A SIGTERM from the process that launched the worker (the
//! driver or an agent stopping it) is no notice: it ends the worker at once too.

use std::sync::OnceLock;
use std::thread;
use std::time::Duration;

use hvd_rendezvous::{NoticeSource, WorkerMsg};
use signal_hook::consts::SIGTERM;
use signal_hook::iterator::SignalsInfo;
use signal_hook::iterator::exfiltrator::WithOrigin;
use signal_hook::low_level::emulate_default_handler;

/// Whether SIGTERM is watched in this process already (it is watched once, by the first
/// client).
static WATCHING: OnceLock<()> = OnceLock::new();

/// What a SIGTERM means, by who sent it and how many came before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The first from anyone but the launcher: tell the driver and train on.
    Notice,
    /// End at once, as SIGTERM's default would.
    End,
}

/// What the `nth` SIGTERM (0 first) from `sender` means to a worker launched by `launcher`.
pub(crate) fn verdict(nth: usize, sender: Option<u32>, launcher: Option<u32>) -> Verdict {
    let from_launcher = sender.is_some() && sender == launcher;
    if nth == 0 && !from_launcher {
        Verdict::Notice
    } else {
        Verdict::End
    }
}

/// Ends the process as SIGTERM's default action would, so the launcher sees the signal.
fn end() -> ! {
    if let Err(e) = emulate_default_handler(SIGTERM) {
        tracing::warn!(error = %e, "could not end the worker by SIGTERM's default action");
    }
    std::process::exit(128 + SIGTERM);
}

/// Watches SIGTERM for worker `worker` from now on (once per process): the first from anyone
/// but `launcher` is sent to the driver with `send` as a notice with `grace`, after which the
/// worker ends if it is still running.
pub(crate) fn watch_sigterm(
    worker: u64,
    launcher: Option<u32>,
    grace: Duration,
    send: impl Fn(&WorkerMsg) -> bool + Send + 'static,
) {
    if WATCHING.set(()).is_err() {
        return;
    }
    let mut signals = match SignalsInfo::<WithOrigin>::new([SIGTERM]) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "could not watch SIGTERM; a SIGTERM ends this worker at once");
            return;
        }
    };
    let spawned = thread::Builder::new()
        .name("hvd-sigterm".into())
        .spawn(move || {
            for (nth, origin) in signals.forever().enumerate() {
                let sender = origin
                    .process
                    .and_then(|p| u32::try_from(p.pid).ok());
                match verdict(nth, sender, launcher) {
                    Verdict::End if nth == 0 => {
                        tracing::debug!(?sender, "SIGTERM from the launcher: ending now");
                        end();
                    }
                    Verdict::End => {
                        tracing::warn!(?sender, "SIGTERM again: ending now");
                        end();
                    }
                    Verdict::Notice => {
                        let msg = WorkerMsg::Notice {
                            worker,
                            source: NoticeSource::Sigterm,
                            within_ms: Some(u64::try_from(grace.as_millis()).unwrap_or(u64::MAX)),
                        };
                        let told = send(&msg);
                        tracing::warn!(
                            ?sender,
                            grace_s = grace.as_secs_f64(),
                            told,
                            "SIGTERM: leaving the job gracefully once the round without this host \
                             has formed; a second SIGTERM ends this worker at once"
                        );
                        let _ = thread::Builder::new()
                            .name("hvd-sigterm-grace".into())
                            .spawn(move || {
                                thread::sleep(grace);
                                tracing::warn!(
                                    grace_s = grace.as_secs_f64(),
                                    "the SIGTERM's grace ran out before the job let this worker go; ending now"
                                );
                                end();
                            });
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "could not start the SIGTERM watcher");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_sigterm_from_anyone_but_the_launcher_is_a_notice() {
        assert_eq!(verdict(0, Some(7), Some(3)), Verdict::Notice);
        assert_eq!(
            verdict(0, None, Some(3)),
            Verdict::Notice,
            "the kernel, or outside the namespace"
        );
        assert_eq!(verdict(0, Some(7), None), Verdict::Notice);
        assert_eq!(
            verdict(0, Some(3), Some(3)),
            Verdict::End,
            "the launcher stops it"
        );
        assert_eq!(verdict(1, Some(7), Some(3)), Verdict::End, "a second one");
        assert_eq!(verdict(1, None, None), Verdict::End);
    }
}
