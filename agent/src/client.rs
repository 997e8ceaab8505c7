//! The driver's side of an agent connection: connect, prove the secret and check the agent's
//! proof, then send requests and read what the agent reports.

use std::time::Duration;

use hvd_rendezvous::{MAX_LINE, ProtocolError, decode_line, encode_line};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use crate::lines::{Line, LineReader};
use crate::proto::{FromAgent, ToAgent};
use crate::{auth, net};

/// Why talking to an agent failed; every variant names the agent's address.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Nothing accepted the connection.
    #[error("cannot reach the hvd agent at {addr}: {source}")]
    Unreachable {
        /// `host:port`.
        addr: String,
        /// The connect error.
        #[source]
        source: std::io::Error,
    },
    /// The agent did not connect or answer in time.
    #[error("the hvd agent at {addr} did not answer within {after:?}")]
    Timeout {
        /// `host:port`.
        addr: String,
        /// How long it was given.
        after: Duration,
    },
    /// The agent refused the connection.
    #[error(
        "the hvd agent at {addr} refused the connection: {reason} (is HVD_AGENT_SECRET the same for the driver and the agent?)"
    )]
    Refused {
        /// `host:port`.
        addr: String,
        /// Its reason.
        reason: String,
    },
    /// The peer did not prove it knows the secret.
    #[error(
        "the peer at {addr} is not an hvd agent with this secret (its answer to our challenge was wrong)"
    )]
    Impostor {
        /// `host:port`.
        addr: String,
    },
    /// The peer broke the protocol.
    #[error("the hvd agent at {addr} sent {what}")]
    Protocol {
        /// `host:port`.
        addr: String,
        /// What arrived.
        what: String,
    },
    /// A line could not be decoded.
    #[error("the hvd agent at {addr} sent a bad message: {source}")]
    Malformed {
        /// `host:port`.
        addr: String,
        /// The decode error.
        #[source]
        source: ProtocolError,
    },
    /// Reading or writing the connection failed.
    #[error("the connection to the hvd agent at {addr} failed: {source}")]
    Io {
        /// `host:port`.
        addr: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The agent closed the connection.
    #[error("the hvd agent at {addr} closed the connection")]
    Closed {
        /// `host:port`.
        addr: String,
    },
    /// The handshake could not be made or read (no randomness, a malformed nonce or proof).
    #[error("authenticating with the hvd agent at {addr}: {source}")]
    Auth {
        /// `host:port`.
        addr: String,
        /// What went wrong.
        #[source]
        source: auth::AuthError,
    },
}

/// Messages from one agent.
#[derive(Debug)]
pub struct Events {
    addr: String,
    reader: LineReader<OwnedReadHalf>,
}

/// Requests to one agent.
#[derive(Debug)]
pub struct Requests {
    addr: String,
    writer: OwnedWriteHalf,
}

/// Connects to the agent at `addr` and authenticates both ways; `timeout` bounds the connect
/// and the handshake together.
///
/// # Errors
/// [`AgentError`], naming `addr`: unreachable, timed out, refused (wrong secret), or a peer
/// that does not know the secret.
pub async fn connect(
    addr: &str,
    secret: &str,
    timeout: Duration,
) -> Result<(Events, Requests), AgentError> {
    let timed_out = || AgentError::Timeout {
        addr: addr.to_string(),
        after: timeout,
    };
    tokio::time::timeout(timeout, handshake(addr, secret))
        .await
        .map_err(|_| timed_out())?
}

async fn handshake(addr: &str, secret: &str) -> Result<(Events, Requests), AgentError> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|source| AgentError::Unreachable {
            addr: addr.to_string(),
            source,
        })?;
    let _ = stream.set_nodelay(true);
    if let Err(e) = net::keepalive(&stream) {
        tracing::warn!(%addr, error = %e, "cannot turn on TCP keepalive");
    }
    let (r, w) = stream.into_split();
    let mut events = Events {
        addr: addr.to_string(),
        reader: LineReader::new(r),
    };
    let mut requests = Requests {
        addr: addr.to_string(),
        writer: w,
    };
    let theirs = match events.next().await? {
        Some(FromAgent::Challenge { nonce }) => nonce,
        other => return Err(events.unexpected(other)),
    };
    let failed = |source| AgentError::Auth {
        addr: addr.to_string(),
        source,
    };
    let theirs = auth::Nonce::from_hex(&theirs).map_err(failed)?;
    let hs = auth::Handshake::new(secret, auth::CONTEXT, auth::Role::Dialer).map_err(failed)?;
    requests
        .send(&ToAgent::Auth {
            mac: hs.proof(&theirs).to_hex(),
            nonce: hs.nonce().to_hex(),
        })
        .await?;
    match events.next().await? {
        Some(FromAgent::Welcome { mac }) => {
            // A malformed proof is as wrong as a false one.
            match auth::Tag::from_hex(&mac).and_then(|proof| hs.verify(&theirs, &proof)) {
                Ok(_session) => Ok((events, requests)),
                Err(_) => Err(AgentError::Impostor {
                    addr: addr.to_string(),
                }),
            }
        }
        other => Err(events.unexpected(other)),
    }
}

impl Events {
    /// The next message; `None` when the agent closed the connection.
    ///
    /// Cancel safe: dropped before it completes (another `select!` branch won), it keeps
    /// what it read of a message, and the next call returns that message whole.
    ///
    /// # Errors
    /// A failed read or a line that is not a message.
    pub async fn next(&mut self) -> Result<Option<FromAgent>, AgentError> {
        let line = self
            .reader
            .next(MAX_LINE)
            .await
            .map_err(|source| AgentError::Io {
                addr: self.addr.clone(),
                source,
            })?;
        let malformed = |source| AgentError::Malformed {
            addr: self.addr.clone(),
            source,
        };
        match line {
            Line::Eof => Ok(None),
            Line::TooLong(n) => Err(malformed(ProtocolError::TooLong(n))),
            Line::Full(buf) => decode_line(buf).map(Some).map_err(malformed),
        }
    }

    /// The agent's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn unexpected(&self, got: Option<FromAgent>) -> AgentError {
        let addr = self.addr.clone();
        match got {
            None => AgentError::Closed { addr },
            Some(FromAgent::Refused { reason }) => AgentError::Refused { addr, reason },
            Some(other) => AgentError::Protocol {
                addr,
                what: format!("{other:?} during the handshake"),
            },
        }
    }
}

impl Requests {
    /// Sends one request.
    ///
    /// # Errors
    /// A failed write.
    pub async fn send(&mut self, msg: &ToAgent) -> Result<(), AgentError> {
        let line = encode_line(msg).map_err(|source| AgentError::Malformed {
            addr: self.addr.clone(),
            source,
        })?;
        self.writer
            .write_all(&line)
            .await
            .map_err(|source| AgentError::Io {
                addr: self.addr.clone(),
                source,
            })
    }

    /// The agent's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }
}
