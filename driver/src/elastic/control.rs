//! The driver's hold on a job with a state store (`--state-store`): it becomes the active
//! driver (or stands by until it can), reads the job's record a predecessor left, writes the
//! record again after every decision of the core, and tells the loop when it must stop
//! acting because another driver may have taken over.
//!
//! Writes go through one background task that always writes the newest record: the loop never
//! waits for etcd, and while etcd is unreachable the newest record waits there and is written
//! when it returns. Every write is fenced (see `hvd_store`): a refused one ends this driver's
//! leadership.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use hvd_store::{Credentials, Leader, Leadership, LeaseState, Store, StoreError, StoreUrl};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use super::core::Core;

/// What `--state-store` and its companions asked for.
#[derive(Debug, Clone)]
pub struct StoreSpec {
    /// Where.
    pub url: StoreUrl,
    /// The etcd user, when etcd has authentication on.
    pub credentials: Option<Credentials>,
    /// Wait while another driver is active (`--standby`).
    pub standby: bool,
    /// The lease's time to live (`--state-store-ttl`).
    pub ttl: Duration,
    /// How long workers train on without a driver (`--driver-grace`).
    pub grace: Duration,
    /// The job's secret, shared by every driver of the job (`HVD_SECRET`).
    pub secret: String,
    /// This driver's command line, kept in the record for whoever inspects it.
    pub args: Vec<String>,
}

/// What a successor needs and cannot learn again, as kept under `PREFIX/state`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// The command line of the driver that started the job.
    pub args: Vec<String>,
    /// When the job started (ms since the Unix epoch): the core's clock counts from it.
    pub started_unix_ms: u64,
    /// The elastic core: workers, rounds, blacklist, update ids, resets.
    pub core: serde_json::Value,
    /// How many drivers took the job over from a predecessor so far.
    #[serde(default)]
    pub failovers: u64,
}

/// The active driver's link to the store.
pub struct Control {
    store: Store,
    leadership: Arc<Leadership>,
    latest: watch::Sender<Option<Vec<u8>>>,
    fenced: mpsc::Receiver<String>,
    writer: tokio::task::JoinHandle<()>,
    args: Vec<String>,
    started_unix_ms: u64,
    failovers: u64,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Control {
    /// Connects to the store and becomes the active driver, `address` being where its
    /// workers reach it; with `--standby`, waits while another driver is active. Returns the
    /// record a predecessor left, if any.
    ///
    /// # Errors
    /// The store cannot be reached (the error names it); another driver is active and this
    /// one is not a standby; the record cannot be read.
    pub async fn elect(
        spec: &StoreSpec,
        address: String,
    ) -> anyhow::Result<(Self, Option<Record>)> {
        let store =
            Store::connect(&spec.url, Duration::from_secs(5), spec.credentials.as_ref()).await?;
        let me = Leader {
            id: format!(
                "{}:{}:{}",
                nix::unistd::gethostname()
                    .map(|h| h.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                std::process::id(),
                unix_ms(SystemTime::now())
            ),
            address,
        };
        let leadership = if spec.standby {
            tracing::info!(store = %spec.url, "standing by to take over the job");
            store.wait_for_leadership(&me, spec.ttl).await?
        } else {
            match store.campaign(&me, spec.ttl).await? {
                hvd_store::Campaign::Won(l) => l,
                hvd_store::Campaign::Held(holder) => anyhow::bail!(
                    "another driver ({}, rendezvous at {}) is active for the job at {}; start \
                     this one with --standby to take over when it goes away",
                    holder.id,
                    holder.address,
                    spec.url
                ),
            }
        };
        let record = match store.load().await? {
            Some(bytes) => Some(
                serde_json::from_slice::<Record>(&bytes)
                    .with_context(|| format!("the job's record at {}/state", spec.url.prefix))?,
            ),
            None => None,
        };
        let started_unix_ms = record
            .as_ref()
            .map_or_else(|| unix_ms(SystemTime::now()), |r| r.started_unix_ms);
        // Taking over a record is a failover: this driver is one more.
        let failovers = record.as_ref().map_or(0, |r| r.failovers + 1);
        let leadership = Arc::new(leadership);
        let (latest, rx) = watch::channel(None);
        let (fenced_tx, fenced) = mpsc::channel(1);
        let writer = tokio::spawn(write_records(
            store.clone(),
            Arc::clone(&leadership),
            rx,
            fenced_tx,
        ));
        Ok((
            Self {
                store,
                leadership,
                latest,
                fenced,
                writer,
                args: spec.args.clone(),
                started_unix_ms,
                failovers,
            },
            record,
        ))
    }

    /// When the job started, by the record (or now, for a new job).
    pub fn started(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.started_unix_ms)
    }

    /// How many drivers took the job over so far, this one included.
    pub fn failovers(&self) -> u64 {
        self.failovers
    }

    /// Hands the core's state to the writer if it changed since the last time.
    pub fn publish(&self, core: &Core) {
        let record = core.save().map(|core| Record {
            args: self.args.clone(),
            started_unix_ms: self.started_unix_ms,
            core,
            failovers: self.failovers,
        });
        match record.and_then(|r| serde_json::to_vec(&r)) {
            Ok(bytes) => {
                self.latest.send_if_modified(|old| {
                    let changed = old.as_deref() != Some(&bytes[..]);
                    if changed {
                        *old = Some(bytes);
                    }
                    changed
                });
            }
            Err(e) => tracing::error!(error = %e, "cannot encode the job's record"),
        }
    }

    /// Whether the lease went unrenewed for its whole time to live (etcd unreachable): this
    /// driver must hold still, since another may be acting.
    pub fn unsure(&self) -> bool {
        matches!(self.leadership.state(), LeaseState::Unsure(_))
    }

    /// Waits while the lease is unsure; returns `Ok` once it is renewed again, or why this
    /// driver must step down.
    pub async fn settled(&mut self) -> Result<(), String> {
        let leadership = Arc::clone(&self.leadership);
        let mut seen = leadership.state();
        loop {
            match seen {
                LeaseState::Held => return Ok(()),
                LeaseState::Lost(why) => return Err(why),
                LeaseState::Unsure(_) => {}
            }
            tokio::select! {
                next = leadership.changed(&seen) => seen = next,
                Some(why) = self.fenced.recv() => return Err(why),
            }
        }
    }

    /// Resolves when this driver must stop acting: its lease lapsed, or a write found
    /// another driver in charge.
    pub async fn lost(&mut self) -> String {
        let leadership = Arc::clone(&self.leadership);
        tokio::select! {
            why = leadership.lost() => why,
            Some(why) = self.fenced.recv() => why,
        }
    }

    /// The job is over: its record is removed and the leadership given up, so nothing is
    /// left in the store and no standby takes over a finished job.
    pub async fn finish(self) {
        // A write still on its way would land after the removal: let the writer finish.
        let (store, leadership, _, _) = self.settle().await;
        if let Err(e) = store.clear(&leadership).await {
            tracing::warn!(error = %e, "could not remove the job's record");
        }
        match Arc::try_unwrap(leadership) {
            Ok(l) => {
                if let Err(e) = store.resign(l).await {
                    tracing::warn!(error = %e, "could not give the leadership up; it lapses with its lease");
                }
            }
            Err(_) => tracing::debug!("the leadership is still shared; it lapses with its lease"),
        }
    }
}

impl Control {
    /// Hands the job to a successor (a SIGTERM: a drained node, an evicted pod): writes the
    /// newest record, then gives the leadership up at once, so a standby takes over without
    /// waiting for the lease to lapse. The workers are left running for it.
    ///
    /// # Errors
    /// The record cannot be written (etcd unreachable, or the leadership already lost): the
    /// successor then starts from the record written before.
    pub async fn hand_over(self) -> anyhow::Result<()> {
        // The writer writes the newest record and ends; one it could not write (etcd away) is
        // tried once more here.
        let (store, leadership, newest, written) = self.settle().await;
        let saved = match (&newest, written) {
            (Some(bytes), false) => store.save(&leadership, bytes).await,
            _ => Ok(()),
        };
        if let Ok(l) = Arc::try_unwrap(leadership)
            && let Err(e) = store.resign(l).await
        {
            tracing::warn!(error = %e, "could not give the leadership up; it lapses with its lease");
        }
        saved.context("writing the job's record before handing it over")
    }
}

impl Control {
    /// Closes the writer's channel and waits (a few seconds at most) for it to write the
    /// newest record and end. Returns the store, the leadership, the newest record, and
    /// whether the writer ended by itself (false: it had to be stopped).
    async fn settle(self) -> (Store, Arc<Leadership>, Option<Vec<u8>>, bool) {
        let Self {
            store,
            leadership,
            latest,
            mut writer,
            ..
        } = self;
        let newest = latest.borrow().clone();
        drop(latest);
        let ended = match tokio::time::timeout(Duration::from_secs(5), &mut writer).await {
            Ok(_) => true,
            Err(_) => {
                writer.abort();
                false
            }
        };
        (store, leadership, newest, ended)
    }
}

/// Writes the newest record whenever there is a newer one; while etcd fails, retries with
/// backoff (whatever record is newest by then). A fenced write is reported and ends it.
async fn write_records(
    store: Store,
    leadership: Arc<Leadership>,
    mut rx: watch::Receiver<Option<Vec<u8>>>,
    fenced: mpsc::Sender<String>,
) {
    let mut failing_since: Option<std::time::Instant> = None;
    while rx.changed().await.is_ok() {
        let mut pause = Duration::from_millis(100);
        loop {
            let Some(bytes) = rx.borrow_and_update().clone() else {
                break;
            };
            match store.save(&leadership, &bytes).await {
                Ok(()) => {
                    if let Some(t) = failing_since.take() {
                        tracing::info!(after = ?t.elapsed(), "the state store is back; the job's record is written again");
                    }
                    break;
                }
                Err(e @ StoreError::Fenced { .. }) => {
                    let _ = fenced.send(e.to_string()).await;
                    return;
                }
                Err(e) => {
                    if failing_since.is_none() {
                        failing_since = Some(std::time::Instant::now());
                        tracing::warn!(error = %e, "cannot write the job's record; training goes on, and the record is written when the store is back");
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
            }
        }
    }
}
