//! The agent's side: accepts driver connections, authenticates them, starts and stops the
//! processes they ask for, and streams back their output and exits. Every process belongs to
//! the connection that started it: when that connection ends, for whatever reason, its
//! processes are stopped (SIGTERM to the group, SIGKILL after a grace), so a dead driver leaves
//! no orphans behind. When a process's leader ends, whatever is left of its group is killed.
//!
//! A connection that claimed a job ([`ToAgent::Claim`]) is the exception: its processes (a
//! [`Session`]) are parked when it ends, their output and exits kept (at most [`HOLD_BYTES`]
//! of output, the oldest lines dropped first; exits are never dropped) for the grace it named,
//! and handed to the next connection that claims the job. Nobody claiming it by then, they are
//! stopped as any connection's are.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hvd_rendezvous::{MAX_LINE, decode_line, encode_line};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::Command;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::auth;
use crate::lines::{Line, LineReader};
use crate::proto::{FromAgent, Held, Stream, ToAgent};
use crate::{dying, net, reaper};
use hvd_auth::refusals::Refused;

/// How long a new connection has to answer the challenge.
const AUTH_TIMEOUT: Duration = Duration::from_secs(10);
/// Grace between SIGTERM and SIGKILL when a connection's processes are stopped.
const TERM_GRACE: Duration = Duration::from_millis(1000);
/// How long the output pipes of a process that exited may keep the agent waiting for more
/// (or their end): its group is killed then, so only a process that left the group can hold
/// them open. Time spent waiting for the driver to take the output does not count.
const DRAIN: Duration = Duration::from_millis(500);
/// Longest line accepted before authentication: the answer to the challenge is far shorter.
const AUTH_MAX_LINE: usize = 4096;
/// Messages queued for one driver before the processes' output waits for it.
const OUT_QUEUE: usize = 1024;
/// Longest output line sent as one message; longer lines are split.
const MAX_OUTPUT_LINE: usize = 64 * 1024;

/// Bytes of output kept for a claimed job while no driver is connected.
const HOLD_BYTES: usize = 4 * 1024 * 1024;
/// How long a claim waits for the job's previous connection to let go of it.
const CLAIM_WAIT: Duration = Duration::from_secs(5);

/// Environment variables the agent keeps from the processes it starts.
const PRIVATE_ENV: &[&str] = &[crate::ENV_AGENT_SECRET];

/// Variables every process the agent starts gets, unless the driver's request sets them: the
/// host's own settings (`--preemption-watch`). Set once, before serving.
static HOST_ENV: std::sync::OnceLock<Vec<(String, String)>> = std::sync::OnceLock::new();

/// Gives every process this agent starts from now on the variables `env`, unless the driver's
/// request names them itself. Only the first call counts; returns whether it did.
pub fn set_host_env(env: Vec<(String, String)>) -> bool {
    HOST_ENV.set(env).is_ok()
}

/// How many connections an agent serves at once, so that a flood of them (before or after
/// authentication) can't exhaust its file descriptors or memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once, authenticated or not; more are closed as they arrive.
    pub connections: usize,
    /// Connections still authenticating at once; more are refused as they arrive.
    pub unauthenticated: usize,
    /// How often the refusals not logged one by one (all but the first of each address and
    /// reason) are logged as counts.
    pub refusal_summary: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            connections: 256,
            unauthenticated: 16,
            refusal_summary: hvd_auth::refusals::SUMMARY_EVERY,
        }
    }
}

/// The agent's refusals, shared by its connections.
type SharedRefusals = Arc<Mutex<hvd_auth::refusals::Refusals>>;

/// Serves driver connections on `listener` until `shutdown` completes; then stops every
/// process of every connection and returns. [`Limits::default`] bounds the connections.
pub async fn serve(listener: TcpListener, secret: String, shutdown: impl Future<Output = ()>) {
    serve_with_limits(listener, secret, Limits::default(), shutdown).await;
}

/// [`serve`] with the given connection limits.
pub async fn serve_with_limits(
    listener: TcpListener,
    secret: String,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let secret = Arc::new(secret);
    let (stop_tx, stop_rx) = watch::channel(false);
    let open = Arc::new(Semaphore::new(limits.connections));
    let authenticating = Arc::new(Semaphore::new(limits.unauthenticated));
    let mut full_warned = false;
    let jobs = Jobs::default();
    let mut conns = JoinSet::new();
    let refusals: SharedRefusals = Arc::new(Mutex::new(hvd_auth::refusals::Refusals::new(
        limits.refusal_summary,
    )));
    let mut summaries =
        tokio::time::interval(hvd_auth::refusals::SUMMARY_CHECK.min(limits.refusal_summary));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            _ = summaries.tick() => {
                refusals
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .log_summary("driver", std::time::Instant::now());
            }
            acc = listener.accept() => match acc {
                Ok((stream, peer)) => match open.clone().try_acquire_owned() {
                    Ok(slot) => {
                        full_warned = false;
                        conns.spawn(connection(
                            stream,
                            peer,
                            secret.clone(),
                            (stop_rx.clone(), jobs.clone()),
                            (slot, authenticating.clone()),
                            refusals.clone(),
                        ));
                    }
                    Err(_) => {
                        if !full_warned {
                            tracing::warn!(
                                %peer,
                                limit = limits.connections,
                                "too many connections; closing new ones until some end"
                            );
                            full_warned = true;
                        }
                        drop(stream);
                    }
                },
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    refusals
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .log_rest("driver");
    tracing::info!(
        connections = conns.len(),
        "shutting down: stopping every process"
    );
    let _ = stop_tx.send(true);
    let all = async {
        while conns.join_next().await.is_some() {}
        // Jobs whose driver is away go too.
        for mut session in jobs.take_parked() {
            stop_all(&mut session.procs, &mut session.done_rx).await;
        }
    };
    if tokio::time::timeout(TERM_GRACE * 5, all).await.is_err() {
        tracing::warn!("some connections did not finish stopping their processes in time");
    }
}

/// Where a session's output and exits go: to its driver's connection, or, while the driver of
/// a claimed job is away, into a bounded buffer for the driver that claims the job next.
#[derive(Clone)]
struct Sink(Arc<tokio::sync::Mutex<SinkState>>);

enum SinkState {
    Connected(mpsc::Sender<FromAgent>),
    Holding(Holding),
}

/// Messages kept while no driver is connected.
#[derive(Default)]
struct Holding {
    msgs: VecDeque<FromAgent>,
    bytes: usize,
    dropped: u64,
}

impl Holding {
    /// Keeps `msg`; past [`HOLD_BYTES`] of output the oldest lines go (exits always stay).
    fn push(&mut self, msg: FromAgent) {
        if let FromAgent::Output { line, .. } = &msg {
            self.bytes += line.len();
        }
        self.msgs.push_back(msg);
        while self.bytes > HOLD_BYTES {
            let Some(i) = self
                .msgs
                .iter()
                .position(|m| matches!(m, FromAgent::Output { .. }))
            else {
                break;
            };
            if let Some(FromAgent::Output { line, .. }) = self.msgs.remove(i) {
                self.bytes -= line.len();
                self.dropped += 1;
            }
        }
    }
}

impl Sink {
    fn new(out: mpsc::Sender<FromAgent>) -> Self {
        Self(Arc::new(tokio::sync::Mutex::new(SinkState::Connected(out))))
    }

    /// Sends `msg` to the driver, or keeps it when none is connected.
    async fn send(&self, msg: FromAgent) {
        let mut state = self.0.lock().await;
        match &mut *state {
            SinkState::Connected(tx) => {
                if let Err(mpsc::error::SendError(msg)) = tx.send(msg).await {
                    let mut held = Holding::default();
                    held.push(msg);
                    *state = SinkState::Holding(held);
                }
            }
            SinkState::Holding(held) => held.push(msg),
        }
    }

    /// From now on, keeps what comes.
    async fn hold(&self) {
        let mut state = self.0.lock().await;
        if let SinkState::Connected(_) = &*state {
            *state = SinkState::Holding(Holding::default());
        }
    }

    /// Hands the session to a new driver: `claimed` first, then everything kept, in order;
    /// then live output goes to it.
    async fn reconnect(&self, out: mpsc::Sender<FromAgent>, processes: Vec<Held>) {
        let mut state = self.0.lock().await;
        let held = match std::mem::replace(&mut *state, SinkState::Connected(out.clone())) {
            SinkState::Holding(h) => h,
            SinkState::Connected(_) => Holding::default(),
        };
        if held.dropped > 0 {
            tracing::warn!(
                lines = held.dropped,
                kept = HOLD_BYTES,
                "output lines were dropped while no driver was connected"
            );
        }
        let claimed = FromAgent::Claimed {
            processes,
            dropped_lines: held.dropped,
        };
        for msg in std::iter::once(claimed).chain(held.msgs) {
            if out.send(msg).await.is_err() {
                break;
            }
        }
    }
}

/// The processes of one connection, or of one claimed job across its connections.
struct Session {
    procs: HashMap<u64, Proc>,
    done_tx: mpsc::UnboundedSender<u64>,
    done_rx: mpsc::UnboundedReceiver<u64>,
    sink: Sink,
    /// The job it was claimed for, how long it outlives its connection, and its claim's
    /// epoch in [`Jobs`].
    claim: Option<(String, Duration, u64)>,
}

impl Session {
    fn new(out: mpsc::Sender<FromAgent>) -> Self {
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        Self {
            procs: HashMap::new(),
            done_tx,
            done_rx,
            sink: Sink::new(out),
            claim: None,
        }
    }
}

/// The claimed jobs of this agent: each held by a connection, or parked while its driver is
/// away.
#[derive(Clone, Default)]
struct Jobs(Arc<Mutex<JobsInner>>);

#[derive(Default)]
struct JobsInner {
    slots: HashMap<String, Slot>,
    next_epoch: u64,
}

enum Slot {
    /// A connection acts for the job; `kick` asks it to let go (a new driver claims it).
    Active {
        epoch: u64,
        kick: watch::Sender<bool>,
    },
    /// No connection: the processes wait for the next claim until the grace ends.
    Parked { epoch: u64, session: Session },
}

impl Jobs {
    fn lock(&self) -> std::sync::MutexGuard<'_, JobsInner> {
        // A panic while the map was held leaves it consistent (every change is one insert or
        // remove), so a poisoned lock is still usable.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Makes the caller the job's connection: returns the parked session if there is one
    /// (asking a connection that still holds the job to let go, and waiting for it), the
    /// claim's epoch, and the receiver of kicks.
    async fn claim(
        &self,
        job: &str,
    ) -> Result<(Option<Session>, u64, watch::Receiver<bool>), String> {
        let deadline = Instant::now() + CLAIM_WAIT;
        loop {
            {
                let mut jobs = self.lock();
                match jobs.slots.remove(job) {
                    Some(Slot::Active { epoch, kick }) => {
                        let _ = kick.send(true);
                        jobs.slots
                            .insert(job.to_string(), Slot::Active { epoch, kick });
                    }
                    other => {
                        let parked = match other {
                            Some(Slot::Parked { session, .. }) => Some(session),
                            _ => None,
                        };
                        jobs.next_epoch += 1;
                        let epoch = jobs.next_epoch;
                        let (kick, kicked) = watch::channel(false);
                        jobs.slots
                            .insert(job.to_string(), Slot::Active { epoch, kick });
                        return Ok((parked, epoch, kicked));
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "job {job:?} is held by another connection that does not let go"
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Parks the session of a connection that ended, if it still holds its job; returns it
    /// back when it does not (it is then stopped).
    fn park(&self, job: &str, epoch: u64, session: Session) -> Option<Session> {
        let mut jobs = self.lock();
        match jobs.slots.get(job) {
            Some(Slot::Active { epoch: e, .. }) if *e == epoch => {
                jobs.slots
                    .insert(job.to_string(), Slot::Parked { epoch, session });
                None
            }
            _ => Some(session),
        }
    }

    /// Takes the parked session of `job` if it is still the one parked at `epoch`.
    fn expire(&self, job: &str, epoch: u64) -> Option<Session> {
        let mut jobs = self.lock();
        match jobs.slots.get(job) {
            Some(Slot::Parked { epoch: e, .. }) if *e == epoch => match jobs.slots.remove(job) {
                Some(Slot::Parked { session, .. }) => Some(session),
                _ => None,
            },
            _ => None,
        }
    }

    /// Forgets the claim of a connection that ends while its job is not parked.
    fn release(&self, job: &str, epoch: u64) {
        let mut jobs = self.lock();
        if matches!(jobs.slots.get(job), Some(Slot::Active { epoch: e, .. }) if *e == epoch) {
            jobs.slots.remove(job);
        }
    }

    /// Every parked session (the agent is shutting down).
    fn take_parked(&self) -> Vec<Session> {
        let mut jobs = self.lock();
        let names: Vec<String> = jobs
            .slots
            .iter()
            .filter(|(_, s)| matches!(s, Slot::Parked { .. }))
            .map(|(k, _)| k.clone())
            .collect();
        names
            .into_iter()
            .filter_map(|k| match jobs.slots.remove(&k) {
                Some(Slot::Parked { session, .. }) => Some(session),
                _ => None,
            })
            .collect()
    }
}

/// A process started for a connection.
struct Proc {
    pid: i32,
    /// Becomes `true` once the process has been reaped.
    done: watch::Receiver<bool>,
}

/// One driver connection: its slot among the open ones (held until it ends), and the
/// semaphore of the connections still authenticating.
type Slots = (OwnedSemaphorePermit, Arc<Semaphore>);

async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    secret: Arc<String>,
    (mut stop, jobs): (watch::Receiver<bool>, Jobs),
    (_open, authenticating): Slots,
    refusals: SharedRefusals,
) {
    let _ = stream.set_nodelay(true);
    if let Err(e) = net::keepalive(&stream) {
        tracing::warn!(%peer, error = %e, "cannot turn on TCP keepalive");
    }
    let (r, w) = stream.into_split();
    let (out, out_rx) = mpsc::channel::<FromAgent>(OUT_QUEUE);
    let writer = tokio::spawn(write_loop(w, out_rx));
    let mut reader = LineReader::new(r);
    let refused = match authenticating.try_acquire_owned() {
        Ok(_slot) => handshake(&mut reader, &out, &secret).await.err(),
        Err(_) => Some(Refused::new(
            "busy",
            "too many connections authenticating at once; try again",
        )),
    };
    if let Some(Refused { reason, detail }) = refused {
        refusals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .log("driver", peer, reason, &detail);
        let _ = out.send(FromAgent::Refused { reason: detail }).await;
        drop(out);
        let _ = tokio::time::timeout(Duration::from_secs(1), writer).await;
        return;
    }
    tracing::info!(%peer, "driver connected");
    let mut session = Session::new(out.clone());
    // Until a claim, nothing kicks this connection; the sender lives as long as the loop.
    let (_unclaimed, mut kicked) = watch::channel(false);
    let mut stopping = false;
    loop {
        // `next` is cancel safe: a request half received when a process ends is kept.
        tokio::select! {
            line = reader.next(MAX_LINE) => match line {
                Ok(Line::Eof) => { tracing::info!(%peer, "driver disconnected"); break; }
                Err(e) => { tracing::warn!(%peer, error = %e, "driver connection failed"); break; }
                Ok(Line::TooLong(bytes)) => {
                    tracing::warn!(%peer, bytes, "request too long; connection closed");
                    break;
                }
                Ok(Line::Full(buf)) => match decode_line::<ToAgent>(buf) {
                    Ok(ToAgent::Claim { job, grace_ms }) => {
                        match claim(&jobs, &mut session, job, grace_ms, &out).await {
                            Ok(k) => kicked = k,
                            Err(reason) => {
                                tracing::warn!(%peer, %reason, "claim refused");
                                let _ = out.send(FromAgent::Error { reason }).await;
                            }
                        }
                    }
                    Ok(req) => request(req, &mut session, &out).await,
                    Err(e) => {
                        tracing::warn!(%peer, error = %e, "bad request");
                        let _ = out.send(FromAgent::Error { reason: format!("bad request: {e}") }).await;
                    }
                },
            },
            Some(id) = session.done_rx.recv() => { session.procs.remove(&id); }
            _ = stop.changed() => { stopping = true; break; }
            _ = kicked.changed() => {
                tracing::info!(%peer, "another driver connection claimed this job; handing it over");
                break;
            }
        }
    }
    match session.claim.clone() {
        Some((job, grace, epoch)) if !stopping && !grace.is_zero() => {
            session.sink.hold().await;
            let processes = session.procs.len();
            match jobs.park(&job, epoch, session) {
                None => {
                    tracing::info!(
                        %peer,
                        job,
                        processes,
                        grace_ms = grace.as_millis() as u64,
                        "driver gone: the job's processes run on for its successor"
                    );
                    let jobs = jobs.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(grace).await;
                        if let Some(mut s) = jobs.expire(&job, epoch) {
                            tracing::warn!(
                                job,
                                processes = s.procs.len(),
                                "no driver claimed the job within its grace; stopping its processes"
                            );
                            stop_all(&mut s.procs, &mut s.done_rx).await;
                        }
                    });
                }
                Some(mut s) => {
                    tracing::info!(%peer, processes, "stopping the processes this driver started");
                    stop_all(&mut s.procs, &mut s.done_rx).await;
                }
            }
        }
        claim => {
            if let Some((job, _, epoch)) = claim {
                jobs.release(&job, epoch);
            }
            if !session.procs.is_empty() {
                tracing::info!(%peer, processes = session.procs.len(), "stopping the processes this driver started");
            }
            stop_all(&mut session.procs, &mut session.done_rx).await;
        }
    }
    drop(out);
    // Exits of the stopped processes still go out when the driver is there to read them.
    if tokio::time::timeout(Duration::from_secs(1), writer)
        .await
        .is_err()
    {
        tracing::debug!(%peer, "driver not reading; its last messages were dropped");
    }
}

/// Makes this connection the one acting for `job`: takes over the processes a previous
/// connection of the job left (answering [`FromAgent::Claimed`] and what they wrote
/// meanwhile); returns the receiver that says when a later claim takes the job away.
async fn claim(
    jobs: &Jobs,
    session: &mut Session,
    job: String,
    grace_ms: u64,
    out: &mpsc::Sender<FromAgent>,
) -> Result<watch::Receiver<bool>, String> {
    if session.claim.is_some() {
        return Err("this connection has already claimed a job".into());
    }
    if !session.procs.is_empty() {
        return Err("a claim must come before the connection starts processes".into());
    }
    if job.is_empty() {
        return Err("a claim must name its job".into());
    }
    let (parked, epoch, kicked) = jobs.claim(&job).await?;
    if let Some(p) = parked {
        *session = p;
    }
    session.claim = Some((job.clone(), Duration::from_millis(grace_ms), epoch));
    let mut held: Vec<Held> = session
        .procs
        .iter()
        .map(|(&id, p)| Held {
            id,
            pid: p.pid.unsigned_abs(),
        })
        .collect();
    held.sort_by_key(|h| h.id);
    tracing::info!(job, processes = held.len(), grace_ms, "job claimed");
    session.sink.reconnect(out.clone(), held).await;
    Ok(kicked)
}

async fn write_loop(mut w: OwnedWriteHalf, mut rx: mpsc::Receiver<FromAgent>) {
    while let Some(msg) = rx.recv().await {
        let line = match encode_line(&msg) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "cannot encode a message for the driver");
                continue;
            }
        };
        if w.write_all(&line).await.is_err() {
            return;
        }
    }
}

/// Challenges the driver and answers its challenge; `Err` says why it is refused.
async fn handshake(
    reader: &mut LineReader<OwnedReadHalf>,
    out: &mpsc::Sender<FromAgent>,
    secret: &str,
) -> Result<(), Refused> {
    let closed = |_| Refused::new("silent", "connection closed");
    let hs = auth::Handshake::new(secret, auth::CONTEXT, auth::Role::Listener)
        .map_err(|e| Refused::new("io", e.to_string()))?;
    out.send(FromAgent::Challenge {
        nonce: hs.nonce().to_hex(),
    })
    .await
    .map_err(closed)?;
    let line = tokio::time::timeout(AUTH_TIMEOUT, reader.next(AUTH_MAX_LINE))
        .await
        .map_err(|_| {
            let detail = format!("no answer to the challenge within {AUTH_TIMEOUT:?}");
            Refused::new("silent", detail)
        })?
        .map_err(|e| Refused::new("io", e.to_string()))?;
    let buf = match line {
        Line::Full(buf) => buf,
        Line::Eof => return Err(Refused::new("silent", "closed before authenticating")),
        Line::TooLong(_) => {
            let detail = format!("a line longer than {AUTH_MAX_LINE} bytes before authentication");
            return Err(Refused::new("too_long", detail));
        }
    };
    let garbage = |detail: String| Refused::new("not_auth", detail);
    let (mac, theirs) = match decode_line::<ToAgent>(buf) {
        Ok(ToAgent::Auth { mac, nonce }) => (mac, nonce),
        Ok(_) => return Err(garbage("a request before authentication".into())),
        Err(e) => return Err(garbage(format!("bad authentication message: {e}"))),
    };
    let theirs = auth::Nonce::from_hex(&theirs).map_err(|e| garbage(format!("driver {e}")))?;
    let proof = auth::Tag::from_hex(&mac).map_err(|e| garbage(format!("driver {e}")))?;
    if hs.verify(&theirs, &proof).is_err() {
        return Err(Refused::new("wrong_secret", "wrong secret"));
    }
    out.send(FromAgent::Welcome {
        mac: hs.proof(&theirs).to_hex(),
    })
    .await
    .map_err(closed)
}

async fn request(req: ToAgent, session: &mut Session, out: &mpsc::Sender<FromAgent>) {
    let procs = &mut session.procs;
    match req {
        ToAgent::Auth { .. } => {
            let _ = out
                .send(FromAgent::Error {
                    reason: "already authenticated".into(),
                })
                .await;
        }
        ToAgent::Start { id, argv, env, cwd } => {
            let reply = match procs.entry(id) {
                Entry::Occupied(_) => FromAgent::StartFailed {
                    id,
                    error: format!("process {id} of this connection is still running"),
                },
                Entry::Vacant(slot) => match start(
                    id,
                    &argv,
                    env,
                    cwd.as_deref(),
                    &session.sink,
                    &session.done_tx,
                ) {
                    Ok(p) => {
                        let pid = p.pid.unsigned_abs();
                        slot.insert(p);
                        FromAgent::Started { id, pid }
                    }
                    Err(error) => {
                        tracing::warn!(id, %error, "cannot start a process");
                        FromAgent::StartFailed { id, error }
                    }
                },
            };
            // The driver names the process when it asks, so output may precede this reply.
            let _ = out.send(reply).await;
        }
        ToAgent::Stop { id, grace_ms } => match procs.get(&id) {
            Some(p) => stop(id, p, Duration::from_millis(grace_ms)),
            None => tracing::debug!(id, "stop for a process that is not running"),
        },
        ToAgent::Claim { .. } => {} // handled by the connection
    }
}

/// SIGTERM to the process group now and SIGKILL after `grace` unless the leader ended by
/// then (SIGKILL at once for no grace). When the leader ends, its task kills the rest of the
/// group, so nothing that ignored the SIGTERM stays behind.
fn stop(id: u64, p: &Proc, grace: Duration) {
    let pid = p.pid;
    if grace.is_zero() {
        tracing::info!(id, pid, "killing process group");
        signal_group(pid, Signal::SIGKILL);
        return;
    }
    tracing::info!(
        id,
        pid,
        grace_ms = grace.as_millis() as u64,
        "stopping process group"
    );
    signal_group(pid, Signal::SIGTERM);
    let mut done = p.done.clone();
    tokio::spawn(async move {
        if tokio::time::timeout(grace, done.wait_for(|d| *d))
            .await
            .is_err()
        {
            tracing::info!(id, pid, "still running after the grace; SIGKILL");
            signal_group(pid, Signal::SIGKILL);
        }
    });
}

fn signal_group(pid: i32, sig: Signal) {
    if sig == Signal::SIGKILL {
        dying::yield_cores(pid);
    }
    if let Err(e) = killpg(Pid::from_raw(pid), sig) {
        tracing::debug!(pid, %sig, error = %e, "signalling the process group failed (gone?)");
    }
}

/// Stops every process (SIGTERM, SIGKILL after the grace) and waits until they are reaped.
async fn stop_all(procs: &mut HashMap<u64, Proc>, done_rx: &mut mpsc::UnboundedReceiver<u64>) {
    for sig in [Signal::SIGTERM, Signal::SIGKILL] {
        if procs.is_empty() {
            return;
        }
        for p in procs.values() {
            signal_group(p.pid, sig);
        }
        let _ = tokio::time::timeout(TERM_GRACE, async {
            while !procs.is_empty() {
                match done_rx.recv().await {
                    Some(id) => {
                        procs.remove(&id);
                    }
                    None => return,
                }
            }
        })
        .await;
    }
}

fn start(
    id: u64,
    argv: &[String],
    env: Vec<(String, String)>,
    cwd: Option<&str>,
    out: &Sink,
    done_tx: &mpsc::UnboundedSender<u64>,
) -> Result<Proc, String> {
    let Some(program) = argv.first() else {
        return Err("empty command".into());
    };
    let mut cmd = Command::new(program);
    cmd.args(&argv[1..]);
    for k in PRIVATE_ENV {
        cmd.env_remove(k);
    }
    for (k, v) in HOST_ENV.get().into_iter().flatten() {
        if !env.iter().any(|(name, _)| name == k) {
            cmd.env(k, v);
        }
    }
    cmd.envs(env);
    // This agent starts it: its SIGTERM is a stop, anyone else's a notice (an hvd worker's).
    cmd.env(
        hvd_rendezvous::ENV_LAUNCHER_PID,
        std::process::id().to_string(),
    );
    if let Some(dir) = cwd {
        if !std::path::Path::new(dir).is_dir() {
            return Err(format!(
                "working directory {dir} does not exist on this host"
            ));
        }
        cmd.current_dir(dir);
    }
    // Its own process group, so stopping it stops whatever it started too.
    cmd.process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let (mut child, pid) = {
        // Registered before the orphan reaper can see it exit, so only its task reaps it.
        let mut own = reaper::children();
        let child = cmd.spawn().map_err(|e| format!("{program}: {e}"))?;
        let pid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| format!("{program}: exited before its pid was known"))?;
        own.insert(pid);
        (child, pid)
    };
    tracing::info!(id, pid, %program, "process started");
    let (done_set, done) = watch::channel(false);
    let mut relays = Vec::new();
    if let Some(o) = child.stdout.take() {
        relays.push(tokio::spawn(relay(
            id,
            Stream::Stdout,
            o,
            out.clone(),
            done.clone(),
        )));
    }
    if let Some(e) = child.stderr.take() {
        relays.push(tokio::spawn(relay(
            id,
            Stream::Stderr,
            e,
            out.clone(),
            done.clone(),
        )));
    }
    let (out, done_tx) = (out.clone(), done_tx.clone());
    tokio::spawn(async move {
        // A failure is told as soon as the process starts dying: its memory may take longer
        // to free than the job takes to re-form without it.
        if let Some(st) = dying::ended_or_failing(&mut child, Some(pid)).await {
            tracing::info!(id, pid, code = ?st.code(), signal = ?st.signal(), "process is dying");
            out.send(FromAgent::Dying {
                id,
                code: st.code(),
                signal: st.signal(),
            })
            .await;
        }
        let (code, signal) = match child.wait().await {
            Ok(st) => (st.code(), st.signal()),
            Err(e) => {
                tracing::error!(id, error = %e, "waiting for the process failed");
                (None, None)
            }
        };
        reaper::children().remove(&pid);
        // Whatever it left behind in its group goes with it: a child that ignored SIGTERM, a
        // background job. Nothing would signal that group again (the driver only knows
        // the leader), and it would keep the output pipes open.
        signal_group(pid, Signal::SIGKILL);
        let _ = done_set.send(true);
        tracing::info!(id, pid, ?code, ?signal, "process exited");
        // Every line it wrote goes out before its exit, however long the driver takes to
        // read them: a crash's last lines are the ones that say why.
        for r in relays {
            let _ = r.await;
        }
        out.send(FromAgent::Exited { id, code, signal }).await;
        let _ = done_tx.send(id);
    });
    Ok(Proc { pid, done })
}

/// What one wait of an output relay ended with.
enum Step {
    /// A read returned (0 at the end of the pipe).
    Read(std::io::Result<usize>),
    /// The process exited while the relay was waiting for output.
    Exited,
    /// The pipe stayed open longer than [`DRAIN`] after the exit.
    Drained,
}

/// Sends each line of one pipe of process `id` to the driver, until the pipe closes or,
/// once `exited` is set, until the pipe has kept it waiting for [`DRAIN`] in all.
async fn relay(
    id: u64,
    stream: Stream,
    pipe: impl AsyncRead + Unpin,
    out: Sink,
    mut exited: watch::Receiver<bool>,
) {
    let mut r = BufReader::new(pipe);
    let mut buf = Vec::new();
    let mut draining = *exited.borrow();
    let mut wait_left = DRAIN;
    loop {
        // `read_until` keeps what it read in `buf` when cancelled, so a line cut by the exit
        // or the drain limit is still sent.
        let room = MAX_OUTPUT_LINE.saturating_sub(buf.len()) as u64;
        let mut limited = (&mut r).take(room);
        let read = limited.read_until(b'\n', &mut buf);
        let step = if draining {
            let t = Instant::now();
            let step = match tokio::time::timeout(wait_left, read).await {
                Ok(n) => Step::Read(n),
                Err(_) => Step::Drained,
            };
            wait_left = wait_left.saturating_sub(t.elapsed());
            step
        } else {
            tokio::select! {
                n = read => Step::Read(n),
                _ = exited.wait_for(|d| *d) => Step::Exited,
            }
        };
        let last = match step {
            Step::Exited => {
                draining = true;
                continue;
            }
            Step::Read(Ok(0)) | Step::Read(Err(_)) => true,
            Step::Read(Ok(_)) => false,
            Step::Drained => {
                tracing::debug!(
                    id,
                    ?stream,
                    "output still open after the exit (a process outside its group holds it); \
                     not waiting"
                );
                true
            }
        };
        if !buf.is_empty() {
            if buf.ends_with(b"\n") {
                buf.pop();
            }
            let line = String::from_utf8_lossy(&buf).into_owned();
            buf.clear();
            out.send(FromAgent::Output { id, stream, line }).await;
        }
        if last {
            return;
        }
    }
}
