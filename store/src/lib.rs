//! Where an elastic job's driver keeps what a successor needs, so that the driver is not the
//! one process whose loss ends a job.
//!
//! Without a store (the default) the driver's state lives in its memory, as it always has.
//! With `--state-store etcd://HOST:PORT[,HOST:PORT…]/PREFIX` it lives in etcd under `PREFIX`:
//!
//! - `PREFIX/leader`: the active driver ([`Leader`]), written with the driver's lease, so the
//!   key vanishes when the driver stops renewing it. Creating it is the election: one driver
//!   holds it at a time; a standby waits for it to vanish and creates it in turn.
//! - `PREFIX/state`: the job's record (the driver's, opaque here).
//!
//! Every write of the active driver is a transaction conditional on its own leader key still
//! being the one it created (fencing): a driver whose lease lapsed can no longer write, even
//! while it has not noticed yet, and learns it from the refused write.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, PutOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions,
};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// What can go wrong with the state store; each names what it was given.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// `--state-store` is not a store this build knows.
    #[error("--state-store {url:?}: {why}")]
    Url {
        /// What was given.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// No endpoint answered.
    #[error("the state store at {endpoints} cannot be reached: {source}")]
    Unreachable {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// The client's error.
        source: etcd_client::Error,
    },
    /// A request failed.
    #[error("the state store at {endpoints}: {what} failed: {source}")]
    Request {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// What was asked.
        what: &'static str,
        /// The client's error.
        source: etcd_client::Error,
    },
    /// This driver no longer holds the leadership: its lease lapsed and another driver may be
    /// acting. It must stop acting at once.
    #[error("this driver lost the leadership of {prefix}: its lease lapsed ({why})")]
    Fenced {
        /// The job's prefix.
        prefix: String,
        /// How it was found out.
        why: String,
    },
    /// The etcd credentials in the environment are incomplete.
    #[error("the state store's credentials: {why}")]
    Credentials {
        /// What is missing.
        why: String,
    },
    /// What the store holds is not what this driver writes.
    #[error("the state store's {key} holds something this driver cannot read: {why}")]
    Corrupt {
        /// The key.
        key: String,
        /// The decoding error.
        why: String,
    },
}

/// A user name and password for an etcd with authentication on, from
/// `HVD_STATE_STORE_USERNAME` and `HVD_STATE_STORE_PASSWORD` (never from the command line,
/// where `ps` would show the password).
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The etcd user.
    pub username: String,
    /// Its password.
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<hidden>")
            .finish()
    }
}

pub use hvd_rendezvous::{
    ENV_STATE_STORE_PASSWORD as ENV_PASSWORD, ENV_STATE_STORE_USERNAME as ENV_USERNAME,
};

impl Credentials {
    /// The credentials the environment gives: none when neither variable is set.
    ///
    /// # Errors
    /// [`StoreError::Credentials`] when only one of the two is set, or one is empty.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(
            std::env::var(ENV_USERNAME).ok(),
            std::env::var(ENV_PASSWORD).ok(),
        )
    }

    /// [`Credentials::from_env`] on given values.
    ///
    /// # Errors
    /// As [`Credentials::from_env`].
    pub fn from_vars(username: Option<String>, password: Option<String>) -> Result<Option<Self>> {
        let bad = |why: String| StoreError::Credentials { why };
        match (username, password) {
            (None, None) => Ok(None),
            (Some(_), None) => Err(bad(format!(
                "{ENV_USERNAME} is set but {ENV_PASSWORD} is not"
            ))),
            (None, Some(_)) => Err(bad(format!(
                "{ENV_PASSWORD} is set but {ENV_USERNAME} is not"
            ))),
            (Some(u), Some(_)) if u.is_empty() => Err(bad(format!("{ENV_USERNAME} is empty"))),
            (Some(_), Some(p)) if p.is_empty() => Err(bad(format!("{ENV_PASSWORD} is empty"))),
            (Some(username), Some(password)) => Ok(Some(Self { username, password })),
        }
    }
}

/// Result of a store call.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// A parsed `--state-store`: `etcd://HOST:PORT[,HOST:PORT…]/PREFIX`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreUrl {
    /// `HOST:PORT` of each etcd member.
    pub endpoints: Vec<String>,
    /// The job's key prefix, without a trailing `/` (`/hvd/jobs/train-42`).
    pub prefix: String,
}

impl FromStr for StoreUrl {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| StoreError::Url {
            url: s.to_string(),
            why: why.to_string(),
        };
        let rest = s.strip_prefix("etcd://").ok_or_else(|| {
            bad("expected etcd://HOST:PORT[,HOST:PORT…]/PREFIX (etcd is the only store)")
        })?;
        let (hosts, prefix) = rest
            .split_once('/')
            .ok_or_else(|| bad("no /PREFIX after the endpoints: name the job's keys"))?;
        let prefix = prefix.trim_end_matches('/');
        if prefix.is_empty() {
            return Err(bad("the PREFIX is empty: name the job's keys"));
        }
        if prefix.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("the PREFIX holds whitespace"));
        }
        let mut endpoints = Vec::new();
        for h in hosts.split(',') {
            let (host, port) = h
                .rsplit_once(':')
                .ok_or_else(|| bad(&format!("endpoint {h:?} has no :PORT")))?;
            if host.is_empty() {
                return Err(bad(&format!("endpoint {h:?} has no host")));
            }
            match port.parse::<u16>() {
                Ok(p) if p > 0 => {}
                _ => return Err(bad(&format!("endpoint {h:?}: {port:?} is not a port"))),
            }
            endpoints.push(h.to_string());
        }
        Ok(Self {
            endpoints,
            prefix: format!("/{}", prefix.trim_start_matches('/')),
        })
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "etcd://{}{}", self.endpoints.join(","), self.prefix)
    }
}

/// Who the active driver is, as its leader key says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leader {
    /// A name unique to this driver process (host, pid, start time).
    pub id: String,
    /// Where its workers reach its rendezvous (`HOST:PORT`).
    pub address: String,
}

/// How a campaign for the leadership ended.
#[derive(Debug)]
pub enum Campaign {
    /// This driver is the active one now.
    Won(Leadership),
    /// Another driver is active.
    Held(Leader),
}

/// How sure the active driver is of its lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseState {
    /// Renewed within its time to live.
    Held,
    /// Not renewed for a whole time to live (etcd unreachable): it may have lapsed, and
    /// another driver may be acting. The driver holds still until etcd answers again.
    Unsure(String),
    /// etcd says it expired: another driver may be acting. The driver must step down.
    Lost(String),
}

/// The active driver's hold on the leadership: its lease is renewed in the background, and
/// [`Leadership::state`] and [`Leadership::changed`] report how that goes.
#[derive(Debug)]
pub struct Leadership {
    lease: i64,
    /// The revision that created this driver's leader key: writes are conditional on it.
    created: i64,
    state: watch::Receiver<LeaseState>,
    keeper: tokio::task::JoinHandle<()>,
}

impl Leadership {
    /// Where the lease stands now.
    pub fn state(&self) -> LeaseState {
        self.state.borrow().clone()
    }

    /// Resolves with the lease's state once it differs from `seen`.
    pub async fn changed(&self, seen: &LeaseState) -> LeaseState {
        let mut rx = self.state.clone();
        loop {
            let now = rx.borrow_and_update().clone();
            if &now != seen {
                return now;
            }
            if rx.changed().await.is_err() {
                return LeaseState::Lost("the lease keeper stopped".into());
            }
        }
    }

    /// Resolves once etcd says the lease expired, with why; pending while it holds or
    /// etcd cannot be reached.
    pub async fn lost(&self) -> String {
        let mut seen = self.state();
        loop {
            match self.changed(&seen).await {
                LeaseState::Lost(why) => return why,
                other => seen = other,
            }
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

/// A connection to the job's keys in etcd.
#[derive(Clone)]
pub struct Store {
    client: Client,
    url: StoreUrl,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store").field("url", &self.url).finish()
    }
}

impl Store {
    /// Connects to `url`'s endpoints (as `credentials`' user when given), giving up after
    /// `timeout` with an error that names them.
    ///
    /// # Errors
    /// [`StoreError::Unreachable`], also for credentials etcd refuses.
    pub async fn connect(
        url: &StoreUrl,
        timeout: Duration,
        credentials: Option<&Credentials>,
    ) -> Result<Self> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout);
        if let Some(c) = credentials {
            options = options.with_user(c.username.clone(), c.password.clone());
        }
        let unreachable = |source| StoreError::Unreachable {
            endpoints: url.endpoints.join(","),
            source,
        };
        let mut client = Client::connect(&url.endpoints, Some(options))
            .await
            .map_err(unreachable)?;
        // The channel connects lazily: one read proves a member answers.
        client
            .get(format!("{}/leader", url.prefix), None)
            .await
            .map_err(unreachable)?;
        Ok(Self {
            client,
            url: url.clone(),
        })
    }

    /// The store's address, as given.
    pub fn url(&self) -> &StoreUrl {
        &self.url
    }

    fn key(&self, name: &str) -> String {
        format!("{}/{name}", self.url.prefix)
    }

    fn request(&self, what: &'static str) -> impl FnOnce(etcd_client::Error) -> StoreError {
        let endpoints = self.url.endpoints.join(",");
        move |source| StoreError::Request {
            endpoints,
            what,
            source,
        }
    }

    /// The active driver, if any.
    ///
    /// # Errors
    /// [`StoreError::Request`]; [`StoreError::Corrupt`] for a leader key this driver can't read.
    pub async fn leader(&self) -> Result<Option<Leader>> {
        let key = self.key("leader");
        let got = self
            .client
            .clone()
            .get(key.clone(), None)
            .await
            .map_err(self.request("reading the leader"))?;
        got.kvs()
            .first()
            .map(|kv| decode(&key, kv.value()))
            .transpose()
    }

    /// Tries once to become the active driver, with a lease of `ttl` (whole seconds, at least
    /// one) renewed every third of it.
    ///
    /// # Errors
    /// [`StoreError::Request`] when etcd fails.
    pub async fn campaign(&self, me: &Leader, ttl: Duration) -> Result<Campaign> {
        let mut client = self.client.clone();
        let ttl_s = ttl.as_secs().max(1) as i64;
        let lease = client
            .lease_grant(ttl_s, None)
            .await
            .map_err(self.request("granting a lease"))?
            .id();
        let key = self.key("leader");
        let value = serde_json::to_vec(me).map_err(|e| StoreError::Corrupt {
            key: key.clone(),
            why: e.to_string(),
        })?;
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                key.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then(vec![TxnOp::put(
                key.clone(),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else(vec![TxnOp::get(key.clone(), None)]);
        let resp = client
            .txn(txn)
            .await
            .map_err(self.request("creating the leader key"))?;
        if !resp.succeeded() {
            // Not needed: let it lapse rather than fail on a revoke.
            let _ = client.lease_revoke(lease).await;
            let holder = resp.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.value().to_vec()),
                _ => None,
            });
            return match holder {
                Some(v) => Ok(Campaign::Held(decode(&key, &v)?)),
                // It vanished between the compare and the read: try again.
                None => Box::pin(self.campaign(me, ttl)).await,
            };
        }
        let created = resp.header().map_or(0, |h| h.revision());
        let (tx, rx) = watch::channel(LeaseState::Held);
        let keeper = tokio::spawn(keep_alive(client, lease, ttl, tx));
        tracing::info!(store = %self.url, id = %me.id, lease, "this driver is the active one");
        Ok(Campaign::Won(Leadership {
            lease,
            created,
            state: rx,
            keeper,
        }))
    }

    /// Waits until this driver is the active one: campaigns, and while another driver holds
    /// the leadership, waits for its key to vanish (its lease lapsed or it resigned).
    ///
    /// # Errors
    /// [`StoreError::Request`] when etcd fails.
    pub async fn wait_for_leadership(&self, me: &Leader, ttl: Duration) -> Result<Leadership> {
        loop {
            match self.campaign(me, ttl).await? {
                Campaign::Won(l) => return Ok(l),
                Campaign::Held(holder) => {
                    tracing::info!(active = %holder.id, at = %holder.address, "standing by while another driver is active");
                    self.until_vacant().await?;
                }
            }
        }
    }

    /// Returns once the leader key is gone (at once if it is).
    async fn until_vacant(&self) -> Result<()> {
        let key = self.key("leader");
        let mut client = self.client.clone();
        let got = client
            .get(key.clone(), None)
            .await
            .map_err(self.request("reading the leader"))?;
        if got.kvs().is_empty() {
            return Ok(());
        }
        let from = got.header().map_or(0, |h| h.revision()) + 1;
        let (_watcher, mut events) = client
            .watch(key, Some(WatchOptions::new().with_start_revision(from)))
            .await
            .map_err(self.request("watching the leader"))?;
        while let Some(resp) = events
            .message()
            .await
            .map_err(self.request("watching the leader"))?
        {
            if resp
                .events()
                .iter()
                .any(|e| e.event_type() == EventType::Delete)
            {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Writes the job's record, if `leadership` still holds (fencing).
    ///
    /// # Errors
    /// [`StoreError::Fenced`] when another driver took over or the lease lapsed;
    /// [`StoreError::Request`] when etcd fails.
    pub async fn save(&self, leadership: &Leadership, record: &[u8]) -> Result<()> {
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                self.key("leader"),
                CompareOp::Equal,
                leadership.created,
            )])
            .and_then(vec![TxnOp::put(self.key("state"), record, None)]);
        let resp = self
            .client
            .clone()
            .txn(txn)
            .await
            .map_err(self.request("writing the job's record"))?;
        if resp.succeeded() {
            Ok(())
        } else {
            Err(StoreError::Fenced {
                prefix: self.url.prefix.clone(),
                why: "a write found another driver's leader key, or none".into(),
            })
        }
    }

    /// The job's record, if one was written.
    ///
    /// # Errors
    /// [`StoreError::Request`].
    pub async fn load(&self) -> Result<Option<Vec<u8>>> {
        let got = self
            .client
            .clone()
            .get(self.key("state"), None)
            .await
            .map_err(self.request("reading the job's record"))?;
        Ok(got.kvs().first().map(|kv| kv.value().to_vec()))
    }

    /// Gives the leadership up at once (a standby takes over without waiting for the lease).
    ///
    /// # Errors
    /// [`StoreError::Request`].
    pub async fn resign(&self, leadership: Leadership) -> Result<()> {
        leadership.keeper.abort();
        self.client
            .clone()
            .lease_revoke(leadership.lease)
            .await
            .map_err(self.request("revoking the lease"))?;
        Ok(())
    }

    /// Revokes the active driver's lease, whoever holds it: a standby takes over at once, and
    /// the evicted driver finds itself fenced (to move the driver off a node being drained).
    /// Returns whether there was one.
    ///
    /// # Errors
    /// [`StoreError::Request`].
    pub async fn evict_leader(&self) -> Result<bool> {
        let mut client = self.client.clone();
        let got = client
            .get(self.key("leader"), None)
            .await
            .map_err(self.request("reading the leader"))?;
        let Some(lease) = got.kvs().first().map(|kv| kv.lease()).filter(|&l| l != 0) else {
            return Ok(false);
        };
        client
            .lease_revoke(lease)
            .await
            .map_err(self.request("revoking the active driver's lease"))?;
        Ok(true)
    }

    /// Removes the job's keys (a job that finished leaves nothing behind).
    ///
    /// # Errors
    /// [`StoreError::Fenced`] when this driver no longer leads; [`StoreError::Request`].
    pub async fn clear(&self, leadership: &Leadership) -> Result<()> {
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                self.key("leader"),
                CompareOp::Equal,
                leadership.created,
            )])
            .and_then(vec![TxnOp::delete(self.key("state"), None)]);
        let resp = self
            .client
            .clone()
            .txn(txn)
            .await
            .map_err(self.request("removing the job's record"))?;
        if resp.succeeded() {
            Ok(())
        } else {
            Err(StoreError::Fenced {
                prefix: self.url.prefix.clone(),
                why: "clearing found another driver's leader key, or none".into(),
            })
        }
    }
}

fn decode<T: serde::de::DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
        key: key.to_string(),
        why: e.to_string(),
    })
}

/// Renews `lease` every third of `ttl`. Reports [`LeaseState::Unsure`] once no renewal has
/// succeeded for `ttl` (and goes on trying), [`LeaseState::Held`] again when one succeeds (etcd
/// extends leases when it restarts, so a lease outlives an outage of etcd itself), and
/// [`LeaseState::Lost`] when etcd says the lease expired, which ends it.
async fn keep_alive(
    mut client: Client,
    lease: i64,
    ttl: Duration,
    state: watch::Sender<LeaseState>,
) {
    let every = (ttl / 3).max(Duration::from_millis(100));
    let mut last_ok = tokio::time::Instant::now();
    let mut stream = None;
    loop {
        if last_ok.elapsed() >= ttl && *state.borrow() == LeaseState::Held {
            let why = format!("no renewal of the lease succeeded for {ttl:?}");
            tracing::warn!(%why, "the state store cannot be reached; holding still");
            let _ = state.send(LeaseState::Unsure(why));
        }
        if stream.is_none() {
            stream = tokio::time::timeout(every, client.lease_keep_alive(lease))
                .await
                .ok()
                .and_then(Result::ok);
        }
        if let Some((keeper, responses)) = stream.as_mut() {
            let renewed = async {
                keeper.keep_alive().await?;
                responses.message().await
            };
            match tokio::time::timeout(every, renewed).await {
                Ok(Ok(Some(r))) if r.ttl() > 0 => {
                    last_ok = tokio::time::Instant::now();
                    if *state.borrow() != LeaseState::Held {
                        tracing::info!("the lease is renewed again");
                        let _ = state.send(LeaseState::Held);
                    }
                }
                Ok(Ok(Some(_))) => {
                    let _ = state.send(LeaseState::Lost("etcd says the lease expired".into()));
                    return;
                }
                // The stream broke: open another on the next turn.
                _ => stream = None,
            }
        }
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a test that cannot set up fails loudly
mod tests {
    use super::*;

    #[test]
    fn urls_parse_or_name_what_is_wrong() {
        let u: StoreUrl = "etcd://10.0.0.1:2379,etcd-1:2379/hvd/jobs/a"
            .parse()
            .unwrap();
        assert_eq!(u.endpoints, vec!["10.0.0.1:2379", "etcd-1:2379"]);
        assert_eq!(u.prefix, "/hvd/jobs/a");
        assert_eq!(u.to_string(), "etcd://10.0.0.1:2379,etcd-1:2379/hvd/jobs/a");
        let one: StoreUrl = "etcd://[::1]:2379/job/".parse().unwrap();
        assert_eq!(
            (one.endpoints[0].as_str(), one.prefix.as_str()),
            ("[::1]:2379", "/job")
        );
        for (bad, says) in [
            ("http://h:1/p", "etcd://"),
            ("etcd://h:2379", "no /PREFIX"),
            ("etcd://h:2379/", "PREFIX is empty"),
            ("etcd://h/p", "has no :PORT"),
            ("etcd://h:0/p", "is not a port"),
            ("etcd://h:x/p", "is not a port"),
            ("etcd://:1/p", "has no host"),
            ("etcd://h:1,/p", "has no :PORT"),
            ("etcd://h:1/a b", "whitespace"),
        ] {
            let e = bad.parse::<StoreUrl>().unwrap_err().to_string();
            assert!(e.contains(says) && e.contains(bad), "{bad}: {e}");
        }
    }
}
