//! The job's one authentication, used on every connection: the driver's to its agents, the
//! workers' to the driver's rendezvous, and the ranks' collective mesh.
//!
//! **Handshake.** Both sides prove they know the job secret without sending it, each over
//! both sides' fresh nonces, so a recorded handshake is useless on any later connection:
//!
//! ```text
//! dialer   → listener   dialer's nonce
//! listener → dialer     listener's nonce, listener's proof
//! dialer   → listener   dialer's proof          (only once the listener's proof checked out)
//! ```
//!
//! A proof is HMAC-SHA256 under the secret of the protocol version, the connection's
//! `context` (which service, which job or round), the prover's role and both nonces; proofs
//! are compared in constant time. The two roles' proofs differ, so a side's own proof can't
//! be reflected back at it.
//!
//! **Session.** A completed handshake yields a [`Session`] whose key is derived the same way
//! (its own label). Every message after the handshake carries a tag: HMAC-SHA256 under the
//! session key of the direction, the message's number in that direction and the message. A
//! tampered message, one replayed or reordered within the connection, or one taken from
//! another connection (another key) fails [`Session::open`].
//!
//! **Refusals.** [`refusals::Refusals`] decides how a service reports the connections it
//! refuses, so that strangers cannot flood its log.

pub mod refusals;

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a nonce.
pub const NONCE_BYTES: usize = 16;
/// Bytes of a proof or a message tag.
pub const TAG_BYTES: usize = 32;

const VERSION: &str = "hvd-auth/1";

/// Why a peer was not accepted, or a message not taken.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    /// Reading randomness for a nonce failed.
    #[error("cannot read random bytes from /dev/urandom: {0}")]
    Random(String),
    /// The peer's proof does not match: it does not know the job secret, or the handshake
    /// was replayed from another connection.
    #[error(
        "the peer's proof does not match: wrong secret, or a handshake replayed from another connection"
    )]
    BadProof,
    /// A message's tag does not match: tampered, replayed, reordered, or from another
    /// connection.
    #[error("message #{number} failed its check: tampered, replayed, or from another connection")]
    BadTag {
        /// The message's number on this connection in this direction.
        number: u64,
    },
    /// A nonce, proof or tag is not the hex of the right number of bytes.
    #[error("malformed {what}: expected {bytes} bytes of hex")]
    Malformed {
        /// Which field.
        what: &'static str,
        /// How many bytes it should hold.
        bytes: usize,
    },
}

/// Which end of a connection this side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that connected.
    Dialer,
    /// The side that accepted.
    Listener,
}

impl Role {
    fn label(self) -> &'static str {
        match self {
            Self::Dialer => "dialer",
            Self::Listener => "listener",
        }
    }

    fn other(self) -> Self {
        match self {
            Self::Dialer => Self::Listener,
            Self::Listener => Self::Dialer,
        }
    }
}

/// A fresh random nonce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nonce(pub [u8; NONCE_BYTES]);

impl Nonce {
    /// Draws a nonce from the system's random source.
    ///
    /// # Errors
    /// [`AuthError::Random`] when it can't be read.
    pub fn fresh() -> Result<Self, AuthError> {
        use std::io::Read;
        let mut b = [0u8; NONCE_BYTES];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut b))
            .map_err(|e| AuthError::Random(e.to_string()))?;
        Ok(Self(b))
    }

    /// Lower-case hex, for text protocols.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses [`Nonce::to_hex`]'s output.
    ///
    /// # Errors
    /// [`AuthError::Malformed`] for anything else.
    pub fn from_hex(s: &str) -> Result<Self, AuthError> {
        Ok(Self(fixed(s, "nonce")?))
    }
}

/// A proof of the secret, or a message's tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tag(pub [u8; TAG_BYTES]);

impl Tag {
    /// Lower-case hex, for text protocols.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses [`Tag::to_hex`]'s output.
    ///
    /// # Errors
    /// [`AuthError::Malformed`] for anything else.
    pub fn from_hex(s: &str) -> Result<Self, AuthError> {
        Ok(Self(fixed(s, "tag")?))
    }
}

/// One side of a handshake in progress: it holds the secret and this side's nonce.
pub struct Handshake {
    secret: Vec<u8>,
    context: String,
    role: Role,
    ours: Nonce,
}

impl std::fmt::Debug for Handshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret.
        f.debug_struct("Handshake")
            .field("context", &self.context)
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

impl Handshake {
    /// Begins a handshake as `role` on a connection of `context` (which service and job: both
    /// sides must name the same), drawing this side's nonce.
    ///
    /// # Errors
    /// [`AuthError::Random`].
    pub fn new(secret: &str, context: &str, role: Role) -> Result<Self, AuthError> {
        Ok(Self::with_nonce(secret, context, role, Nonce::fresh()?))
    }

    /// [`Handshake::new`] with a given nonce (tests, and replays in them).
    pub fn with_nonce(secret: &str, context: &str, role: Role, ours: Nonce) -> Self {
        Self {
            secret: secret.as_bytes().to_vec(),
            context: context.to_string(),
            role,
            ours,
        }
    }

    /// This side's nonce, to send.
    pub fn nonce(&self) -> Nonce {
        self.ours
    }

    fn nonces(&self, theirs: &Nonce) -> (Nonce, Nonce) {
        match self.role {
            Role::Dialer => (self.ours, *theirs),
            Role::Listener => (*theirs, self.ours),
        }
    }

    fn keyed(&self, what: &str, theirs: &Nonce) -> HmacSha256 {
        let (d, l) = self.nonces(theirs);
        let mut m = hmac(&self.secret);
        for part in [VERSION.as_bytes(), self.context.as_bytes(), what.as_bytes()] {
            m.update(&(part.len() as u64).to_le_bytes());
            m.update(part);
        }
        m.update(&d.0);
        m.update(&l.0);
        m
    }

    /// This side's proof, once the peer's nonce is known.
    pub fn proof(&self, theirs: &Nonce) -> Tag {
        Tag(self
            .keyed(self.role.label(), theirs)
            .finalize()
            .into_bytes()
            .into())
    }

    /// Checks the peer's proof (in constant time) and, when it holds, opens the session.
    ///
    /// # Errors
    /// [`AuthError::BadProof`].
    pub fn verify(&self, theirs: &Nonce, proof: &Tag) -> Result<Session, AuthError> {
        self.keyed(self.role.other().label(), theirs)
            .verify_slice(&proof.0)
            .map_err(|_| AuthError::BadProof)?;
        let key: [u8; TAG_BYTES] = self.keyed("session", theirs).finalize().into_bytes().into();
        Ok(Session {
            key,
            role: self.role,
            sent: 0,
            received: 0,
        })
    }
}

/// An authenticated connection: tags the messages this side sends and checks those it
/// receives, in order.
pub struct Session {
    key: [u8; TAG_BYTES],
    role: Role,
    sent: u64,
    received: u64,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("Session")
            .field("role", &self.role)
            .field("sent", &self.sent)
            .field("received", &self.received)
            .finish_non_exhaustive()
    }
}

impl Session {
    fn tag(&self, from: Role, number: u64, msg: &[u8]) -> HmacSha256 {
        let mut m = hmac(&self.key);
        m.update(from.label().as_bytes());
        m.update(&number.to_le_bytes());
        m.update(msg);
        m
    }

    /// Splits the session into its sending and receiving halves, for a connection written
    /// and read by different threads.
    pub fn split(self) -> (Sealer, Opener) {
        (
            Sealer {
                session: Self { ..self },
            },
            Opener { session: self },
        )
    }

    /// The tag of the next message this side sends.
    pub fn seal(&mut self, msg: &[u8]) -> Tag {
        let t = self.tag(self.role, self.sent, msg);
        self.sent += 1;
        Tag(t.finalize().into_bytes().into())
    }

    /// Checks the next message received from the peer against its tag.
    ///
    /// # Errors
    /// [`AuthError::BadTag`]; the expected number does not advance, so a connection that
    /// saw one should be closed.
    pub fn open(&mut self, msg: &[u8], tag: &Tag) -> Result<(), AuthError> {
        let number = self.received;
        self.tag(self.role.other(), number, msg)
            .verify_slice(&tag.0)
            .map_err(|_| AuthError::BadTag { number })?;
        self.received += 1;
        Ok(())
    }
}

/// The sending half of a [`Session`].
#[derive(Debug)]
pub struct Sealer {
    session: Session,
}

impl Sealer {
    /// See [`Session::seal`].
    pub fn seal(&mut self, msg: &[u8]) -> Tag {
        self.session.seal(msg)
    }
}

/// The receiving half of a [`Session`].
#[derive(Debug)]
pub struct Opener {
    session: Session,
}

impl Opener {
    /// See [`Session::open`].
    ///
    /// # Errors
    /// [`AuthError::BadTag`].
    pub fn open(&mut self, msg: &[u8], tag: &Tag) -> Result<(), AuthError> {
        self.session.open(msg, tag)
    }
}

fn hmac(key: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length: this never fails.
    match HmacSha256::new_from_slice(key) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC-SHA256 accepts keys of any length"),
    }
}

fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 * b.len());
    for &x in b {
        s.push(char::from(DIGITS[usize::from(x >> 4)]));
        s.push(char::from(DIGITS[usize::from(x & 15)]));
    }
    s
}

fn fixed<const N: usize>(s: &str, what: &'static str) -> Result<[u8; N], AuthError> {
    let bad = AuthError::Malformed { what, bytes: N };
    let raw = s.as_bytes();
    if raw.len() != 2 * N {
        return Err(bad);
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        match (digit(raw[2 * i]), digit(raw[2 * i + 1])) {
            (Some(h), Some(l)) => *o = h << 4 | l,
            _ => return Err(bad),
        }
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const CTX: &str = "rendezvous job-1";

    /// Runs a whole handshake between two sides; returns their sessions.
    fn shake(dialer_secret: &str, listener_secret: &str) -> Result<(Session, Session), AuthError> {
        let d = Handshake::new(dialer_secret, CTX, Role::Dialer)?;
        let l = Handshake::new(listener_secret, CTX, Role::Listener)?;
        // dialer → listener: nonce; listener → dialer: nonce + proof.
        let l_proof = l.proof(&d.nonce());
        let ds = d.verify(&l.nonce(), &l_proof)?;
        // dialer → listener: proof.
        let ls = l.verify(&d.nonce(), &d.proof(&l.nonce()))?;
        Ok((ds, ls))
    }

    #[test]
    fn the_same_secret_opens_a_session_both_ways() {
        let (mut d, mut l) = shake("s3cret", "s3cret").unwrap();
        for i in 0..3 {
            let msg = format!("message {i}");
            let t = d.seal(msg.as_bytes());
            l.open(msg.as_bytes(), &t).unwrap();
            let t = l.seal(msg.as_bytes());
            d.open(msg.as_bytes(), &t).unwrap();
        }
    }

    #[test]
    fn a_wrong_secret_is_refused_by_whichever_side_checks_first() {
        // The dialer checks the listener's proof first: a listener without the secret is
        // refused before the dialer proves anything.
        assert_eq!(shake("s3cret", "guess").err(), Some(AuthError::BadProof));
        let d = Handshake::new("guess", CTX, Role::Dialer).unwrap();
        let l = Handshake::new("s3cret", CTX, Role::Listener).unwrap();
        assert_eq!(
            l.verify(&d.nonce(), &d.proof(&l.nonce())).err(),
            Some(AuthError::BadProof)
        );
    }

    #[test]
    fn a_replayed_handshake_is_refused() {
        // An eavesdropper recorded a whole dialer side, then replays it against a listener,
        // whose fresh nonce makes the recorded proof worthless.
        let d = Handshake::new("s3cret", CTX, Role::Dialer).unwrap();
        let l1 = Handshake::new("s3cret", CTX, Role::Listener).unwrap();
        let recorded = (d.nonce(), d.proof(&l1.nonce()));
        assert!(l1.verify(&recorded.0, &recorded.1).is_ok());
        let l2 = Handshake::new("s3cret", CTX, Role::Listener).unwrap();
        assert_eq!(
            l2.verify(&recorded.0, &recorded.1).err(),
            Some(AuthError::BadProof)
        );
    }

    #[test]
    fn a_proof_reflected_back_or_from_another_context_is_refused() {
        let d = Handshake::new("s3cret", CTX, Role::Dialer).unwrap();
        let l = Handshake::new("s3cret", CTX, Role::Listener).unwrap();
        // The listener's own proof sent back to it as the dialer's.
        let reflected = l.proof(&d.nonce());
        assert_eq!(
            l.verify(&d.nonce(), &reflected).err(),
            Some(AuthError::BadProof)
        );
        // A dialer of another service (or another job's round) with the same secret.
        let other = Handshake::new("s3cret", "mesh job-1 round 3", Role::Dialer).unwrap();
        assert_eq!(
            l.verify(&other.nonce(), &other.proof(&l.nonce())).err(),
            Some(AuthError::BadProof)
        );
    }

    #[test]
    fn tampered_replayed_reordered_and_foreign_messages_are_refused() {
        let (mut d, mut l) = shake("s3cret", "s3cret").unwrap();
        let t0 = d.seal(b"join round 2");
        let t1 = d.seal(b"synced round 2");
        assert_eq!(
            l.open(b"join round 3", &t0),
            Err(AuthError::BadTag { number: 0 }),
            "tampered"
        );
        assert_eq!(
            l.open(b"synced round 2", &t1),
            Err(AuthError::BadTag { number: 0 }),
            "reordered"
        );
        l.open(b"join round 2", &t0).unwrap();
        assert_eq!(
            l.open(b"join round 2", &t0),
            Err(AuthError::BadTag { number: 1 }),
            "replayed"
        );
        l.open(b"synced round 2", &t1).unwrap();
        // A message sealed on another connection of the same job.
        let (mut d2, _) = shake("s3cret", "s3cret").unwrap();
        let foreign = d2.seal(b"goodbye");
        assert_eq!(
            l.open(b"goodbye", &foreign),
            Err(AuthError::BadTag { number: 2 }),
            "another connection's"
        );
        // A side's own message reflected back to it.
        let mine = l.seal(b"abort round 2");
        assert!(l.open(b"abort round 2", &mine).is_err(), "reflected");
    }

    #[test]
    fn split_halves_keep_their_own_counts() {
        let (d, l) = shake("s3cret", "s3cret").unwrap();
        let ((mut ds, mut dr), (mut ls, mut lr)) = (d.split(), l.split());
        let a = ds.seal(b"one");
        let b = ls.seal(b"two");
        lr.open(b"one", &a).unwrap();
        dr.open(b"two", &b).unwrap();
        let c = ds.seal(b"three");
        lr.open(b"three", &c).unwrap();
        assert!(lr.open(b"three", &c).is_err());
    }

    #[test]
    fn hex_round_trips_and_rejects_malformed_input() {
        let n = Nonce::fresh().unwrap();
        assert_eq!(Nonce::from_hex(&n.to_hex()).unwrap(), n);
        assert_ne!(Nonce::fresh().unwrap(), n, "fresh");
        let t = Tag([0xab; TAG_BYTES]);
        assert_eq!(Tag::from_hex(&t.to_hex().to_uppercase()).unwrap(), t);
        for bad in [
            "",
            "zz",
            &"0".repeat(2 * NONCE_BYTES + 1),
            &"g".repeat(2 * NONCE_BYTES),
            "é",
        ] {
            assert_eq!(
                Nonce::from_hex(bad),
                Err(AuthError::Malformed {
                    what: "nonce",
                    bytes: NONCE_BYTES
                }),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn proofs_match_an_independently_computed_vector() {
        // HMAC-SHA256 under "s3cret" of the length-prefixed version, context and role, then
        // the dialer's and the listener's nonces (bytes 0x00.. and 0x10..), as computed by
        // Python's hmac module.
        let d = Handshake::with_nonce("s3cret", CTX, Role::Dialer, Nonce([0; NONCE_BYTES]));
        let l_nonce = Nonce([0x10; NONCE_BYTES]);
        assert_eq!(d.proof(&l_nonce).to_hex(), VECTOR);
    }

    const VECTOR: &str = "f79cb5501c76f1e4334d54b80093d1dfd0873c4560732a877852ef26a42e204b";
}
