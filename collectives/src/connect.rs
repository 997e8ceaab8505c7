//! Building the connections between ranks, with a handshake that authenticates every peer.
//!
//! Of each pair of ranks that connects, the higher dials and the lower accepts, `streams`
//! times while the world forms (pairs connected on first use, once). The connecting side sends a hello (protocol magic and version, its rank, the rank it
//! expects with the stream's index and the stream count, the rendezvous generation, and a fresh
//! nonce); the accepting side answers one status byte, so a refused peer learns why. When the
//! hello's numbers agree, both sides prove that they hold the job's token with `hvd-auth`'s
//! challenge-response over both nonces, in a context that names the round, both ranks and the
//! stream: the token never crosses the wire, a recorded handshake is refused on any later
//! connection, and a hello whose numbers were altered on the way fails the proofs.
//!
//! ```text
//! dialer   -> listener   hello (37 bytes)
//! listener -> dialer     status; when 0: the listener's nonce and proof
//! dialer   -> listener   the dialer's proof (only once the listener's proof checked out)
//! listener -> dialer     status: 0, or 1 (wrong job token)
//! ```

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use hvd_auth::refusals::{Refusals, Refused, SUMMARY_EVERY as CONNECT_SUMMARY};
use hvd_auth::{Handshake, NONCE_BYTES, Nonce, Role, TAG_BYTES, Tag};

use crate::config::CommConfig;
use crate::error::{CommError, Result};
use crate::link::{Shared, read_full};

const HELLO_MAGIC: u32 = 0x4856_4448; // "HVDH"
const PROTOCOL_VERSION: u8 = 7;
/// Bytes of a hello: magic, version, from, to, generation, nonce.
const HELLO_LEN: usize = 4 + 1 + 4 + 4 + 8 + NONCE_BYTES;
/// The hello's `to` word: the rank in the low 24 bits, the stream's index in the next 4, the
/// stream count in the top 4.
const RANK_BITS: u32 = 24;
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a wait for peers goes without checking for an abort (or a dead peer).
const CHECK_EVERY: Duration = Duration::from_millis(5);
/// The pause before dialing a peer that refused again (its listener is bound before the
/// addresses are exchanged, so a refusal is rare: a slow network, or a peer that is gone).
const RETRY_EVERY: Duration = Duration::from_millis(10);
/// How often accepting, with every higher rank in, checks whether the dialing thread is done.
const DIALER_CHECK: Duration = Duration::from_millis(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Status {
    Ok = 0,
    BadToken = 1,
    WrongGeneration = 2,
    WrongRank = 3,
    BadVersion = 4,
    WrongStreams = 5,
}

impl Status {
    /// The label a refusal for this status is counted under.
    fn label(self) -> &'static str {
        match self {
            Self::Ok => "none",
            Self::BadToken => "wrong_secret",
            Self::WrongGeneration => "wrong_round",
            Self::WrongRank => "wrong_rank",
            Self::BadVersion => "wrong_version",
            Self::WrongStreams => "wrong_streams",
        }
    }

    fn describe(code: u8) -> &'static str {
        match code {
            1 => "refused: wrong job token",
            2 => "refused: peer belongs to another rendezvous round",
            3 => "refused: rank numbering disagrees",
            4 => "refused: protocol version differs",
            5 => "refused: the number of connections per peer differs",
            _ => "refused",
        }
    }
}

struct Hello {
    version: u8,
    from: u32,
    to: u32,
    generation: u64,
    nonce: Nonce,
}

impl Hello {
    /// What both sides' proofs are bound to: the round, both ranks, the stream.
    fn context(&self) -> String {
        format!("hvd-mesh/{}/{}/{:#x}", self.generation, self.from, self.to)
    }
}

fn encode_hello(h: &Hello) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4] = h.version;
    b[5..9].copy_from_slice(&h.from.to_le_bytes());
    b[9..13].copy_from_slice(&h.to.to_le_bytes());
    b[13..21].copy_from_slice(&h.generation.to_le_bytes());
    b[21..].copy_from_slice(&h.nonce.0);
    b
}

/// Reads a hello: a fixed number of bytes, whatever the peer claims.
fn read_hello(s: &mut TcpStream) -> io::Result<Hello> {
    let mut b = [0u8; HELLO_LEN];
    read_full(s, &mut b)?;
    let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    if word(0) != HELLO_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not an hvd peer (magic {:#010x})", word(0)),
        ));
    }
    let mut g = [0u8; 8];
    g.copy_from_slice(&b[13..21]);
    let mut nonce = [0u8; NONCE_BYTES];
    nonce.copy_from_slice(&b[21..]);
    Ok(Hello {
        version: b[4],
        from: word(5),
        to: word(9),
        generation: u64::from_le_bytes(g),
        nonce: Nonce(nonce),
    })
}

fn tune(s: &TcpStream) -> io::Result<()> {
    s.set_nodelay(true)?;
    s.set_nonblocking(false)
}

/// The connections to the peers a mesh was built for.
pub(crate) struct Mesh {
    /// The first connection to each rank (`None` at this rank's own index and where no
    /// connection was wanted): it carries every opening and all but the ring's data.
    pub(crate) primary: Vec<Option<TcpStream>>,
    /// The further connections to each rank (`streams - 1` of them where one is wanted).
    pub(crate) extra: Vec<Vec<TcpStream>>,
}

/// Connects to every peer `wanted` names, `cfg.streams` times each (`wanted` must name the
/// same pairs from both ends).
///
/// Every socket is registered with `shared` as soon as it exists, so an abort (which shuts the
/// registered sockets down) ends a blocked handshake at once; the waits between sockets check
/// for an abort every [`CHECK_EVERY`]. While it waits for higher ranks to dial in, it watches
/// the connections it already has: a peer that closes one (it died) fails the mesh at once
/// with [`CommError::PeerLost`] instead of leaving this rank waiting for the deadline.
pub(crate) fn mesh(
    cfg: &CommConfig,
    listener: &TcpListener,
    peers: &[SocketAddr],
    wanted: &[bool],
    shared: &Shared,
) -> Result<Mesh> {
    let plan = Plan {
        wanted,
        within: cfg.connect_timeout,
        watch: &[],
        listening: false,
    };
    let built = build(cfg, listener, peers, &plan, shared);
    match (built, shared.abort_reason()) {
        (Err(_), Some(reason)) => Err(CommError::Aborted { reason }),
        (built, _) => built,
    }
}

/// Connects the pairs `wanted` names once a call needs them, one connection each, through
/// the communicator's own listener for them (`peers` holds every rank's), waiting for the
/// peers to arrive at that call up to `within`. Higher ranks may dial in meanwhile for a later
/// call: they are admitted too, and returned with the rest. `watch` are the connections the
/// communicator already has: one that closes (a peer died, or failed and shut its sockets)
/// fails the wait at once.
pub(crate) fn pairs(
    cfg: &CommConfig,
    listener: &TcpListener,
    peers: &[SocketAddr],
    wanted: &[bool],
    watch: &[(usize, &TcpStream)],
    within: Duration,
    shared: &Shared,
) -> Result<Vec<Option<TcpStream>>> {
    let mut cfg = cfg.clone();
    cfg.streams = 1;
    let plan = Plan {
        wanted,
        within,
        watch,
        listening: true,
    };
    let built = build(&cfg, listener, peers, &plan, shared);
    match (built, shared.abort_reason()) {
        (Err(_), Some(reason)) => Err(CommError::Aborted { reason }),
        (built, _) => built.map(|m| m.primary),
    }
}

/// Which pairs a build connects, and how.
struct Plan<'a> {
    /// The peers this rank connects with (the higher ones dial in).
    wanted: &'a [bool],
    /// How long the whole build may take.
    within: Duration,
    /// Connections made before this build, watched for a peer that closes one.
    watch: &'a [(usize, &'a TcpStream)],
    /// Whether every peer's listener is known to be there already: a refused dial then means
    /// the peer is gone, and is not tried again.
    listening: bool,
}

fn build(
    cfg: &CommConfig,
    listener: &TcpListener,
    peers: &[SocketAddr],
    plan: &Plan<'_>,
    shared: &Shared,
) -> Result<Mesh> {
    let deadline = Instant::now() + plan.within;
    let lower: Vec<usize> = (0..cfg.rank).filter(|&j| plan.wanted[j]).collect();
    // Dialing the lower ranks runs beside accepting the higher ones: a rank that accepted
    // only once its own dials were done held up every higher rank, a chain through the world.
    // Either side's failure stops the other. The connections dialed so far are watched with
    // the accepted ones while accepting waits, so a lower rank that dies is noticed at once.
    let stop = AtomicBool::new(false);
    let done = Mutex::new(Vec::with_capacity(lower.len()));
    let wait = Waiting {
        plan,
        dialed: &done,
        dialing: AtomicBool::new(true),
    };
    let (dialed, accepted) = thread::scope(|scope| {
        let dialer = scope.spawn(|| {
            let dialed = dial_lower(cfg, &lower, peers, deadline, shared, &stop, &wait);
            match dialed {
                Ok(()) => wait.dialing.store(false, Ordering::SeqCst),
                Err(_) => stop.store(true, Ordering::SeqCst),
            }
            dialed
        });
        let accepted = accept_higher(cfg, listener, peers, deadline, shared, &stop, &wait);
        if accepted.is_err() {
            stop.store(true, Ordering::SeqCst);
            // A dial blocked in its handshake ends when its socket is shut.
            shared.trip();
        }
        let dialed = dialer.join().unwrap_or_else(|_| {
            Err(io_err(
                "dialing peers",
                io::Error::other("the dialing thread panicked"),
            ))
        });
        (dialed, accepted)
    });
    // The side that failed first names the cause; the other only saw it stop.
    let mut slots = match (dialed, accepted) {
        (Ok(()), Ok(a)) => a,
        (_, Err(Stopped::Failed(e))) | (Err(e), _) => return Err(e),
        (Ok(_), Err(Stopped::Halted)) => {
            let e = io::Error::other("accepting stopped with every dial made");
            return Err(io_err("accepting peer connections", e));
        }
    };
    let dialed = done.into_inner().unwrap_or_else(PoisonError::into_inner);
    for (j, per_peer) in dialed {
        slots[j] = per_peer.into_iter().map(Some).collect();
    }
    let mut primary = Vec::with_capacity(cfg.size);
    let mut extra = Vec::with_capacity(cfg.size);
    for mut per_peer in slots {
        let first = per_peer.first_mut().and_then(Option::take);
        primary.push(first);
        extra.push(per_peer.into_iter().flatten().collect());
    }
    Ok(Mesh { primary, extra })
}

/// What accepting waits for, and what it watches meanwhile.
struct Waiting<'a> {
    plan: &'a Plan<'a>,
    /// The dialing thread's connections so far, by rank.
    dialed: &'a Mutex<Vec<(usize, Vec<TcpStream>)>>,
    /// Whether the dialing thread is still at work: accepting watches the connections until
    /// it is done, even with every higher rank in.
    dialing: AtomicBool,
}

/// Why accepting stopped before every higher rank was in.
enum Stopped {
    /// The dialing side failed (it reports why).
    Halted,
    Failed(CommError),
}

/// Connects to the ranks `lower`, `cfg.streams` times each, one after another, putting each
/// rank's connections in `done` as soon as they are made.
fn dial_lower(
    cfg: &CommConfig,
    lower: &[usize],
    peers: &[SocketAddr],
    deadline: Instant,
    shared: &Shared,
    stop: &AtomicBool,
    wait: &Waiting<'_>,
) -> Result<()> {
    let patient = !wait.plan.listening;
    for &j in lower {
        let per_peer = (0..cfg.streams)
            .map(|index| dial(cfg, j, index, peers[j], deadline, shared, stop, patient))
            .collect::<Result<Vec<_>>>()?;
        wait.dialed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((j, per_peer));
    }
    Ok(())
}

/// Admits the wanted higher ranks' connections, `cfg.streams` each, into their slots (the
/// lower ranks' slots stay empty). Another higher rank's connection is admitted as well (it
/// dialed for a later call); it is not waited for.
fn accept_higher(
    cfg: &CommConfig,
    listener: &TcpListener,
    peers: &[SocketAddr],
    deadline: Instant,
    shared: &Shared,
    stop: &AtomicBool,
    wait: &Waiting<'_>,
) -> std::result::Result<Vec<Vec<Option<TcpStream>>>, Stopped> {
    let mut dialed = Vec::new();
    // Strangers refused while connecting are logged once per address and reason, then
    // counted; what is left of the counts is logged when accepting ends.
    let mut refusals = CountedUntilDropped(Refusals::new(CONNECT_SUMMARY));
    let refusals = &mut refusals.0;
    let k = cfg.streams;
    let mut slots: Vec<Vec<Option<TcpStream>>> = (0..cfg.size)
        .map(|_| (0..k).map(|_| None).collect())
        .collect();
    let failed = Stopped::Failed;
    listener
        .set_nonblocking(true)
        .map_err(|e| failed(io_err("listener", e)))?;
    let higher = cfg.rank + 1..cfg.size;
    let mut missing = higher.clone().filter(|&j| wait.plan.wanted[j]).count() * k;
    while missing > 0 || wait.dialing.load(Ordering::SeqCst) {
        if let Some(reason) = shared.abort_reason() {
            return Err(failed(CommError::Aborted { reason }));
        }
        if stop.load(Ordering::SeqCst) {
            return Err(Stopped::Halted);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let waiting: Vec<usize> = higher
            .clone()
            .filter(|&j| wait.plan.wanted[j] && slots[j].iter().any(Option::is_none))
            .collect();
        // With every higher rank in, the dialing thread's own deadline names the late peer.
        if let (true, Some(&late)) = (left.is_zero(), waiting.first()) {
            return Err(failed(CommError::Connect {
                rank: late,
                addr: peers.get(late).map_or_else(String::new, |a| a.to_string()),
                detail: format!(
                    "ranks {waiting:?} did not connect within {:?}",
                    wait.plan.within
                ),
            }));
        }
        // With every higher rank in, only the dialing thread's end is waited for.
        let pause = if missing > 0 {
            CHECK_EVERY
        } else {
            DIALER_CHECK
        };
        let found = wait_for_dialers(listener, &slots, wait, &mut dialed, left.min(pause));
        refusals.log_summary("peer", Instant::now());
        if let Some(j) = found.map_err(failed)? {
            return Err(failed(CommError::PeerLost {
                rank: j,
                op: "connect",
                source: io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    "the peer closed its connection while connections were being made",
                ),
            }));
        }
        loop {
            match listener.accept() {
                Ok((mut s, from)) => {
                    tune(&s).map_err(|e| failed(io_err("accepted socket", e)))?;
                    shared
                        .register(&s)
                        .map_err(|e| failed(io_err("registering a connection", e)))?;
                    match admit(cfg, &mut s) {
                        Ok((j, index)) if slots[j][index].is_none() => {
                            slots[j][index] = Some(s);
                            if wait.plan.wanted[j] {
                                missing -= 1;
                            }
                        }
                        Ok((j, index)) => {
                            shared.unregister(&s);
                            let detail = format!("a second connection {index} from rank {j}");
                            refusals.log("peer", from, "duplicate", &detail);
                        }
                        Err(r) => {
                            shared.unregister(&s);
                            refusals.log("peer", from, r.reason, &r.detail);
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(failed(io_err("accepting peer connections", e))),
            }
            if shared.is_aborted() {
                break;
            }
        }
    }
    Ok(slots)
}

/// Refusals whose counts not logged yet are logged when accepting ends.
struct CountedUntilDropped(Refusals);

impl Drop for CountedUntilDropped {
    fn drop(&mut self) {
        self.0.log_rest("peer");
    }
}

/// Waits up to `wait` for a connection on `listener`, watching the connections already made
/// (accepted ones in `slots`, those from before in `waiting`, and the dialing thread's, of
/// which `dialed` keeps duplicates so that the thread never waits for a poll to end); returns
/// the rank of a peer that closed one.
fn wait_for_dialers(
    listener: &TcpListener,
    slots: &[Vec<Option<TcpStream>>],
    waiting: &Waiting<'_>,
    dialed: &mut Vec<(usize, TcpStream)>,
    wait: Duration,
) -> Result<Option<usize>> {
    {
        let made = waiting
            .dialed
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let known = dialed.len();
        for (j, s) in made
            .iter()
            .flat_map(|(j, per_peer)| per_peer.iter().map(move |s| (*j, s)))
            .skip(known)
        {
            let copy = s
                .try_clone()
                .map_err(|e| io_err("watching a connection", e))?;
            dialed.push((j, copy));
        }
    }
    let made = dialed.iter().map(|(j, s)| (*j, s));
    let accepted = slots
        .iter()
        .enumerate()
        .flat_map(|(j, per_peer)| per_peer.iter().flatten().map(move |s| (j, s)));
    let before = waiting.plan.watch.iter().copied();
    let mut owners = Vec::new();
    let mut fds = vec![PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
    for (j, s) in made.chain(accepted).chain(before) {
        // A peer's early data (it finished its own mesh and moved on) is not a hang-up: only
        // the end of its stream is watched.
        fds.push(PollFd::new(s.as_fd(), rdhup()));
        owners.push(j);
    }
    let timeout =
        PollTimeout::try_from(wait.max(Duration::from_millis(1))).unwrap_or(PollTimeout::MAX);
    match poll(&mut fds, timeout) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => {}
        Err(e) => return Err(io_err("waiting for peer connections", e.into())),
    }
    // `revents` is `None` when the kernel set a flag `nix` does not name: `POLLRDHUP`, the only
    // one asked for that it lacks.
    let gone = |fd: &PollFd<'_>| {
        fd.revents().is_none_or(|r| {
            r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR | PollFlags::POLLNVAL)
        })
    };
    Ok(fds[1..]
        .iter()
        .zip(&owners)
        .find(|(fd, _)| gone(fd))
        .map(|(_, &j)| j))
}

/// `POLLRDHUP` (Linux): the peer closed its end of the stream. `nix` names no constant for it.
fn rdhup() -> PollFlags {
    PollFlags::from_bits_retain(nix::libc::POLLRDHUP)
}

fn io_err(context: &str, source: io::Error) -> CommError {
    CommError::Io {
        context: context.into(),
        source,
    }
}

/// Opens a TCP connection to `addr` without blocking past [`CHECK_EVERY`] at a time, so an
/// abort ends the attempt (a peer whose host is gone may never answer a SYN).
fn open(
    addr: SocketAddr,
    deadline: Instant,
    shared: &Shared,
    stop: &AtomicBool,
) -> io::Result<TcpStream> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrStorage, connect, getsockopt, socket,
        sockopt::SocketError,
    };
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd: OwnedFd = socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    match connect(fd.as_raw_fd(), &SockaddrStorage::from(addr)) {
        Ok(()) => {}
        Err(nix::errno::Errno::EINPROGRESS | nix::errno::Errno::EINTR) => loop {
            if shared.is_aborted() || stop.load(Ordering::SeqCst) {
                return Err(io::Error::new(io::ErrorKind::Interrupted, "aborted"));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "connection timed out",
                ));
            }
            let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLOUT)];
            let wait = left.clamp(Duration::from_millis(1), CHECK_EVERY);
            let timeout = PollTimeout::try_from(wait).unwrap_or(PollTimeout::MAX);
            match poll(&mut fds, timeout) {
                Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
                Ok(_) => {}
                Err(e) => return Err(e.into()),
            }
            match getsockopt(&fd, SocketError)? {
                0 => break,
                code => return Err(io::Error::from_raw_os_error(code)),
            }
        },
        Err(e) => return Err(e.into()),
    }
    let s = TcpStream::from(fd);
    s.set_nonblocking(false)?;
    Ok(s)
}

/// Opens connection `index` to lower rank `j`, retrying while it is not yet listening (when
/// `patient`: a refusal from a listener known to be there means the peer is gone).
#[allow(clippy::too_many_arguments)]
fn dial(
    cfg: &CommConfig,
    j: usize,
    index: usize,
    addr: SocketAddr,
    deadline: Instant,
    shared: &Shared,
    stop: &AtomicBool,
    patient: bool,
) -> Result<TcpStream> {
    let fail = |detail: String| CommError::Connect {
        rank: j,
        addr: addr.to_string(),
        detail,
    };
    let mut s = loop {
        if let Some(reason) = shared.abort_reason() {
            return Err(CommError::Aborted { reason });
        }
        if stop.load(Ordering::SeqCst) {
            return Err(fail("accepting the higher ranks failed".into()));
        }
        match open(addr, deadline, shared, stop) {
            Ok(s) => break s,
            Err(e) if patient && Instant::now() < deadline && !shared.is_aborted() => {
                tracing::debug!(peer = j, %addr, error = %e, "peer not reachable yet; retrying");
                thread::sleep(RETRY_EVERY);
            }
            Err(e) => return Err(fail(e.to_string())),
        }
    };
    // From here an abort shuts the socket down, which ends the wait for the answer below.
    shared
        .register(&s)
        .map_err(|e| io_err("registering a connection", e))?;
    tune(&s).map_err(|e| fail(e.to_string()))?;
    let mut hello = Hello {
        version: PROTOCOL_VERSION,
        from: cfg.rank as u32,
        to: j as u32 | (index as u32) << RANK_BITS | (cfg.streams as u32) << (RANK_BITS + 4),
        generation: cfg.generation,
        nonce: Nonce([0; NONCE_BYTES]),
    };
    let hs = Handshake::new(&cfg.token, &hello.context(), Role::Dialer)
        .map_err(|e| fail(e.to_string()))?;
    hello.nonce = hs.nonce();
    s.write_all(&encode_hello(&hello))
        .map_err(|e| fail(e.to_string()))?;
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(|e| fail(e.to_string()))?;
    let status = read_status(&mut s).map_err(&fail)?;
    if status != Status::Ok as u8 {
        return Err(fail(Status::describe(status).into()));
    }
    let mut challenge = [0u8; NONCE_BYTES + TAG_BYTES];
    s.read_exact(&mut challenge)
        .map_err(|e| fail(format!("no proof from the peer: {e}")))?;
    let (theirs, proof) = split_challenge(&challenge);
    if hs.verify(&theirs, &proof).is_err() {
        return Err(fail(
            "wrong job token: the peer's proof does not match ours (it holds another job's token)"
                .into(),
        ));
    }
    s.write_all(&hs.proof(&theirs).0)
        .map_err(|e| fail(e.to_string()))?;
    let status = read_status(&mut s).map_err(&fail)?;
    if status != Status::Ok as u8 {
        return Err(fail(Status::describe(status).into()));
    }
    Ok(s)
}

fn read_status(s: &mut TcpStream) -> std::result::Result<u8, String> {
    let mut status = [0u8; 1];
    s.read_exact(&mut status)
        .map_err(|e| format!("no handshake answer: {e}"))?;
    Ok(status[0])
}

fn split_challenge(b: &[u8; NONCE_BYTES + TAG_BYTES]) -> (Nonce, Tag) {
    let mut nonce = [0u8; NONCE_BYTES];
    nonce.copy_from_slice(&b[..NONCE_BYTES]);
    let mut tag = [0u8; TAG_BYTES];
    tag.copy_from_slice(&b[NONCE_BYTES..]);
    (Nonce(nonce), Tag(tag))
}

/// Checks an incoming hello and the peer's proof of the job token; returns the peer's rank and
/// the connection's index, or why it was refused (a label for the log's counts, and what
/// happened).
fn admit(cfg: &CommConfig, s: &mut TcpStream) -> std::result::Result<(usize, usize), Refused> {
    s.set_read_timeout(Some(HELLO_TIMEOUT))
        .map_err(|e| Refused::io(&e))?;
    let h = read_hello(s).map_err(|e| Refused::new("bad_hello", format!("bad hello: {e}")))?;
    let to = (h.to & ((1 << RANK_BITS) - 1)) as usize;
    let index = ((h.to >> RANK_BITS) & 0xf) as usize;
    let streams = (h.to >> (RANK_BITS + 4)) as usize;
    let status = if h.version != PROTOCOL_VERSION {
        Status::BadVersion
    } else if h.generation != cfg.generation {
        Status::WrongGeneration
    } else if to != cfg.rank || (h.from as usize) <= cfg.rank || h.from as usize >= cfg.size {
        Status::WrongRank
    } else if streams != cfg.streams || index >= streams {
        Status::WrongStreams
    } else {
        Status::Ok
    };
    let refused = |status: Status| {
        let detail = format!(
            "{} (rank {} gen {})",
            Status::describe(status as u8),
            h.from,
            h.generation
        );
        Refused::new(status.label(), detail)
    };
    if status != Status::Ok {
        // The peer reads this byte to learn why it was refused; if it is already gone, so be it.
        let _ = s.write_all(&[status as u8]);
        return Err(refused(status));
    }
    let hs = Handshake::new(&cfg.token, &h.context(), Role::Listener)
        .map_err(|e| Refused::new("io", e.to_string()))?;
    let mut challenge = [0u8; 1 + NONCE_BYTES + TAG_BYTES];
    challenge[1..=NONCE_BYTES].copy_from_slice(&hs.nonce().0);
    challenge[1 + NONCE_BYTES..].copy_from_slice(&hs.proof(&h.nonce).0);
    s.write_all(&challenge)
        .map_err(|e| Refused::new("io", format!("sending the challenge: {e}")))?;
    let mut proof = [0u8; TAG_BYTES];
    s.read_exact(&mut proof).map_err(|e| {
        let detail = format!("no proof of the job token (rank {}): {e}", h.from);
        Refused::new("silent", detail)
    })?;
    let status = match hs.verify(&h.nonce, &Tag(proof)) {
        Ok(_) => Status::Ok,
        Err(_) => Status::BadToken,
    };
    let _ = s.write_all(&[status as u8]);
    if status == Status::Ok {
        Ok((h.from as usize, index))
    } else {
        Err(refused(status))
    }
}
