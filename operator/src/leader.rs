//! Leader election: only the holder of a coordination.k8s.io Lease reconciles.
//!
//! The Lease itself is kept by `kube-lease-manager`, which publishes "I hold it" on a watch
//! channel; [`while_leader`] turns that channel into "run the controller while leading, stop when
//! the lease is lost".

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;

/// How [`while_leader`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leadership {
    /// The work finished (a shutdown) while this instance led.
    WorkEnded,
    /// Another instance took the lease: the work was stopped.
    Lost,
    /// The lease manager stopped before this instance led.
    ElectionEnded,
}

/// Waits until `leader` is true, then runs `work` until it ends or `leader` turns false.
///
/// After [`Leadership::Lost`] the caller should exit: the work was dropped mid-flight, and a
/// fresh process is the simplest way back to a clean state.
pub async fn while_leader<F: Future<Output = ()>>(
    mut leader: watch::Receiver<bool>,
    work: F,
) -> Leadership {
    if leader.wait_for(|held| *held).await.is_err() {
        return Leadership::ElectionEnded;
    }
    tracing::info!("leading: the lease is held");
    tokio::select! {
        () = work => Leadership::WorkEnded,
        lost = leader.wait_for(|held| !*held) => {
            match lost {
                Ok(_) => tracing::warn!("the lease was lost"),
                Err(_) => tracing::warn!("the lease manager stopped"),
            }
            Leadership::Lost
        }
    }
}

/// How long [`lead`] waits for the lease manager to wind down once nothing watches it.
pub const MANAGER_STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `work` under [`while_leader`] until it ends, the lease is lost, or `stop` resolves; then
/// drops every receiver of `leading` so that the lease manager (`manager`, whose task ends once
/// nothing watches its channel) finishes, and returns its output.
///
/// After `stop`, a leading `work` gets up to `grace` to finish. The manager's output is `None`
/// when it did not end within [`MANAGER_STOP_TIMEOUT`].
pub async fn lead<W, S, M>(
    leading: watch::Receiver<bool>,
    manager: M,
    work: W,
    stop: S,
    grace: Duration,
) -> (Leadership, Option<M::Output>)
where
    W: Future<Output = ()>,
    S: Future<Output = ()>,
    M: Future,
{
    // Boxed rather than pinned on the stack, so that it (and its receiver) can be dropped below.
    let mut election = Box::pin(while_leader(leading.clone(), work));
    let outcome = tokio::select! {
        o = &mut election => o,
        () = stop => {
            // A leading controller stops on the same signal: let it finish its reconciles.
            if *leading.borrow() {
                tokio::time::timeout(grace, &mut election)
                    .await
                    .unwrap_or(Leadership::WorkEnded)
            } else {
                Leadership::WorkEnded
            }
        }
    };
    drop(election);
    drop(leading);
    let ended = tokio::time::timeout(MANAGER_STOP_TIMEOUT, manager).await;
    if ended.is_err() {
        tracing::warn!("the lease manager did not stop");
    }
    (outcome, ended.ok())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[tokio::test]
    async fn work_starts_only_once_leading() {
        let (tx, rx) = watch::channel(false);
        let started = Arc::new(AtomicBool::new(false));
        let s = started.clone();
        let task = tokio::spawn(while_leader(rx, async move {
            s.store(true, Ordering::SeqCst);
        }));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !started.load(Ordering::SeqCst),
            "work ran without the lease"
        );
        tx.send(true).unwrap();
        let end = tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(end, Leadership::WorkEnded);
        assert!(started.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn losing_the_lease_stops_the_work() {
        let (tx, rx) = watch::channel(true);
        let task = tokio::spawn(while_leader(rx, std::future::pending::<()>()));
        tokio::time::sleep(Duration::from_millis(20)).await;
        tx.send(false).unwrap();
        let end = tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(end, Leadership::Lost);
    }

    /// A stand-in for the lease manager's task: it ends only once every receiver is gone.
    fn manager() -> (watch::Receiver<bool>, impl Future<Output = &'static str>) {
        let (tx, rx) = watch::channel(false);
        (rx, async move {
            tx.closed().await;
            "released"
        })
    }

    #[tokio::test]
    async fn stopping_before_leading_ends_the_manager() {
        let (rx, task) = manager();
        let task = tokio::spawn(task);
        let run = lead(
            rx,
            async { task.await.unwrap() },
            std::future::pending::<()>(),
            async {},
            Duration::from_secs(20),
        );
        let (end, released) = tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("shutdown hung");
        assert_eq!(end, Leadership::WorkEnded);
        assert_eq!(
            released,
            Some("released"),
            "the manager never saw the receivers go"
        );
    }

    #[tokio::test]
    async fn stopping_while_leading_lets_the_work_finish_then_ends_the_manager() {
        let (tx, rx) = watch::channel(true);
        let finished = Arc::new(AtomicBool::new(false));
        let f = finished.clone();
        let (stop_tx, mut stop_rx) = watch::channel(false);
        let mut work_stop = stop_rx.clone();
        let work = async move {
            let _ = work_stop.wait_for(|s| *s).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
            f.store(true, Ordering::SeqCst);
        };
        let stop = async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        };
        let manager = async move {
            tx.closed().await;
            "released"
        };
        let run = tokio::spawn(lead(rx, manager, work, stop, Duration::from_secs(20)));
        tokio::time::sleep(Duration::from_millis(20)).await;
        stop_tx.send(true).unwrap();
        let (end, released) = tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("shutdown hung")
            .unwrap();
        assert_eq!(end, Leadership::WorkEnded);
        assert!(finished.load(Ordering::SeqCst), "the work was cut short");
        assert_eq!(released, Some("released"));
    }

    #[tokio::test]
    async fn a_stopped_election_never_starts_the_work() {
        let (tx, rx) = watch::channel(false);
        drop(tx);
        let end = while_leader(rx, async { panic!("must not run") }).await;
        assert_eq!(end, Leadership::ElectionEnded);
    }
}
