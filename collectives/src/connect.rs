//! Building the full mesh of connections, with a handshake that authenticates every peer.
//!
//! Rank `i` connects to every lower rank and accepts from every higher one, `streams` times
//! each. The connecting side sends a hello (protocol magic, its rank, the rank it expects with
//! the stream's index and the stream count, the rendezvous generation and the job token); the
//! accepting side answers with one status byte, so a refused peer learns why.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use crate::config::CommConfig;
use crate::error::{CommError, Result};
use crate::link::read_full;

const HELLO_MAGIC: u32 = 0x4856_4448; // "HVDH"
const PROTOCOL_VERSION: u8 = 4;
/// The hello's `to` word: the rank in the low 24 bits, the stream's index in the next 4, the
/// stream count in the top 4.
const RANK_BITS: u32 = 24;
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

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
    token: Vec<u8>,
}

fn encode_hello(h: &Hello) -> Vec<u8> {
    let mut b = Vec::with_capacity(23 + h.token.len());
    b.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
    b.push(h.version);
    b.extend_from_slice(&h.from.to_le_bytes());
    b.extend_from_slice(&h.to.to_le_bytes());
    b.extend_from_slice(&h.generation.to_le_bytes());
    b.extend_from_slice(&(h.token.len() as u16).to_le_bytes());
    b.extend_from_slice(&h.token);
    b
}

fn read_hello(s: &mut TcpStream) -> io::Result<Hello> {
    let mut head = [0u8; 23];
    read_full(s, &mut head)?;
    let word = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
    if word(0) != HELLO_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not an hvd peer",
        ));
    }
    let mut g = [0u8; 8];
    g.copy_from_slice(&head[13..21]);
    let token_len = u16::from_le_bytes([head[21], head[22]]) as usize;
    let mut token = vec![0u8; token_len];
    read_full(s, &mut token)?;
    Ok(Hello {
        version: head[4],
        from: word(5),
        to: word(9),
        generation: u64::from_le_bytes(g),
        token,
    })
}

/// Compares without an early exit, so timing does not reveal how much of a token matched.
fn same_token(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn tune(s: &TcpStream) -> io::Result<()> {
    s.set_nodelay(true)?;
    s.set_nonblocking(false)
}

/// The connections to every peer.
pub(crate) struct Mesh {
    /// The first connection to each rank (`None` at this rank's own index): it carries every
    /// opening and all but the ring's data.
    pub(crate) primary: Vec<Option<TcpStream>>,
    /// The further connections to each rank (`streams - 1` of them; none at its own index).
    pub(crate) extra: Vec<Vec<TcpStream>>,
}

/// Connects to every peer, `cfg.streams` times each.
pub(crate) fn mesh(cfg: &CommConfig, listener: &TcpListener, peers: &[SocketAddr]) -> Result<Mesh> {
    let deadline = Instant::now() + cfg.connect_timeout;
    let k = cfg.streams;
    let mut slots: Vec<Vec<Option<TcpStream>>> = (0..cfg.size)
        .map(|_| (0..k).map(|_| None).collect())
        .collect();
    for (j, addr) in peers.iter().enumerate().take(cfg.rank) {
        for (index, slot) in slots[j].iter_mut().enumerate() {
            *slot = Some(dial(cfg, j, index, *addr, deadline)?);
        }
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| io_err("listener", e))?;
    let mut missing = (cfg.size - cfg.rank - 1) * k;
    while missing > 0 {
        match listener.accept() {
            Ok((mut s, from)) => {
                tune(&s).map_err(|e| io_err("accepted socket", e))?;
                match admit(cfg, &mut s) {
                    Ok((j, index)) if slots[j][index].is_none() => {
                        slots[j][index] = Some(s);
                        missing -= 1;
                    }
                    Ok((j, index)) => {
                        tracing::warn!(peer = j, index, %from, "duplicate connection refused");
                    }
                    Err(why) => tracing::warn!(%from, %why, "peer connection refused"),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let waiting: Vec<usize> = (cfg.rank + 1..cfg.size)
                        .filter(|&j| slots[j].iter().any(Option::is_none))
                        .collect();
                    return Err(CommError::Connect {
                        rank: waiting[0],
                        addr: peers
                            .get(waiting[0])
                            .map_or_else(String::new, |a| a.to_string()),
                        detail: format!(
                            "ranks {waiting:?} did not connect within {:?}",
                            cfg.connect_timeout
                        ),
                    });
                }
                thread::sleep(Duration::from_millis(1));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err("accepting peer connections", e)),
        }
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

fn io_err(context: &str, source: io::Error) -> CommError {
    CommError::Io {
        context: context.into(),
        source,
    }
}

/// Opens connection `index` to lower rank `j`, retrying while it is not yet listening.
fn dial(
    cfg: &CommConfig,
    j: usize,
    index: usize,
    addr: SocketAddr,
    deadline: Instant,
) -> Result<TcpStream> {
    let fail = |detail: String| CommError::Connect {
        rank: j,
        addr: addr.to_string(),
        detail,
    };
    let mut s = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(peer = j, %addr, error = %e, "peer not reachable yet; retrying");
                thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(fail(e.to_string())),
        }
    };
    tune(&s).map_err(|e| fail(e.to_string()))?;
    let hello = Hello {
        version: PROTOCOL_VERSION,
        from: cfg.rank as u32,
        to: j as u32 | (index as u32) << RANK_BITS | (cfg.streams as u32) << (RANK_BITS + 4),
        generation: cfg.generation,
        token: cfg.token.as_bytes().to_vec(),
    };
    s.write_all(&encode_hello(&hello))
        .map_err(|e| fail(e.to_string()))?;
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(|e| fail(e.to_string()))?;
    let mut status = [0u8; 1];
    s.read_exact(&mut status)
        .map_err(|e| fail(format!("no handshake answer: {e}")))?;
    if status[0] != Status::Ok as u8 {
        return Err(fail(Status::describe(status[0]).into()));
    }
    Ok(s)
}

/// Checks an incoming hello; returns the peer's rank and the connection's index.
fn admit(cfg: &CommConfig, s: &mut TcpStream) -> std::result::Result<(usize, usize), String> {
    s.set_read_timeout(Some(HELLO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let h = read_hello(s).map_err(|e| format!("bad hello: {e}"))?;
    let to = (h.to & ((1 << RANK_BITS) - 1)) as usize;
    let index = ((h.to >> RANK_BITS) & 0xf) as usize;
    let streams = (h.to >> (RANK_BITS + 4)) as usize;
    let status = if h.version != PROTOCOL_VERSION {
        Status::BadVersion
    } else if !same_token(&h.token, cfg.token.as_bytes()) {
        Status::BadToken
    } else if h.generation != cfg.generation {
        Status::WrongGeneration
    } else if to != cfg.rank || (h.from as usize) <= cfg.rank || h.from as usize >= cfg.size {
        Status::WrongRank
    } else if streams != cfg.streams || index >= streams {
        Status::WrongStreams
    } else {
        Status::Ok
    };
    // The peer reads this byte to learn why it was refused; if it is already gone, so be it.
    let _ = s.write_all(&[status as u8]);
    if status == Status::Ok {
        Ok((h.from as usize, index))
    } else {
        Err(format!(
            "{} (rank {} gen {})",
            Status::describe(status as u8),
            h.from,
            h.generation
        ))
    }
}
