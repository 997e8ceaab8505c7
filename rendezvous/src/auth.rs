//! The rendezvous connection's authentication, through the job's one module ([`hvd_auth`]):
//! a handshake of three lines in which each side proves it holds the job secret without
//! sending it, then every line sealed with a tag bound to that connection's session.
//!
//! ```text
//! worker → driver   {"type":"hello","nonce":…}
//! driver → worker   {"type":"challenge","nonce":…,"proof":…}
//! worker → driver   {"type":"proof","proof":…}      (only once the driver's proof checked out)
//! then, each way    <message JSON>\t<tag hex>\n
//! ```
//!
//! A refusal before the session exists (a malformed hello, a wrong proof) is an unsealed
//! `{"type":"refused","reason":…}` line, the same shape as [`crate::DriverMsg::Refused`]. After
//! it, a line whose tag does not check out (tampered, replayed, reordered, taken from another
//! connection) is an error before its JSON is parsed.

use hvd_auth::{Handshake, Nonce, Opener, Role, Sealer, Session, Tag};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::msg::{MAX_LINE, ProtocolError, decode_line, encode_line};

/// The context both sides name in their proofs: a proof made for another service of the job
/// (an agent, the collective mesh) is refused here.
pub const CONTEXT: &str = "hvd-rendezvous";

/// Separates a sealed line's message from its tag; JSON escapes every tab inside strings.
const TAG_SEPARATOR: u8 = b'\t';

/// The handshake's lines, unsealed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum AuthMsg {
    /// The worker's opening: its fresh nonce (hex).
    Hello {
        /// 16 bytes of hex.
        nonce: String,
    },
    /// The driver's answer: its fresh nonce and its proof over both nonces (hex).
    Challenge {
        /// 16 bytes of hex.
        nonce: String,
        /// 32 bytes of hex.
        proof: String,
    },
    /// The worker's proof over both nonces (hex).
    Proof {
        /// 32 bytes of hex.
        proof: String,
    },
    /// The connection was refused before a session existed.
    Refused {
        /// Why.
        reason: String,
    },
}

/// The worker's side of a handshake in progress.
#[derive(Debug)]
pub struct DialerAuth {
    hs: Handshake,
}

impl DialerAuth {
    /// Draws the worker's nonce; returns the handshake and the hello line to send.
    ///
    /// # Errors
    /// [`ProtocolError::Auth`] when no randomness can be read.
    pub fn start(secret: &str) -> Result<(Self, Vec<u8>), ProtocolError> {
        let hs = Handshake::new(secret, CONTEXT, Role::Dialer)?;
        let line = encode_line(&AuthMsg::Hello {
            nonce: hs.nonce().to_hex(),
        })?;
        Ok((Self { hs }, line))
    }

    /// Checks the driver's challenge; returns the proof line to send and the session.
    ///
    /// # Errors
    /// [`ProtocolError::Refused`] when the driver refused, [`ProtocolError::Auth`] when its
    /// proof does not check out (it holds another job's secret), [`ProtocolError::Unexpected`]
    /// for any other line.
    pub fn finish(self, line: &[u8]) -> Result<(Vec<u8>, Session), ProtocolError> {
        let (nonce, proof) = match decode_line::<AuthMsg>(line)? {
            AuthMsg::Challenge { nonce, proof } => (nonce, proof),
            AuthMsg::Refused { reason } => return Err(ProtocolError::Refused(reason)),
            _ => return Err(ProtocolError::Unexpected("a challenge")),
        };
        let theirs = Nonce::from_hex(&nonce)?;
        let session = self.hs.verify(&theirs, &Tag::from_hex(&proof)?)?;
        let line = encode_line(&AuthMsg::Proof {
            proof: self.hs.proof(&theirs).to_hex(),
        })?;
        Ok((line, session))
    }
}

/// The driver's side of a handshake in progress.
#[derive(Debug)]
pub struct ListenerAuth {
    hs: Handshake,
    theirs: Nonce,
}

impl ListenerAuth {
    /// Answers a worker's hello; returns the handshake and the challenge line to send.
    ///
    /// # Errors
    /// [`ProtocolError::Malformed`], [`ProtocolError::Unexpected`] or
    /// [`ProtocolError::Auth`] for a line that is not a well-formed hello.
    pub fn answer(secret: &str, line: &[u8]) -> Result<(Self, Vec<u8>), ProtocolError> {
        let AuthMsg::Hello { nonce } = decode_line::<AuthMsg>(line)? else {
            return Err(ProtocolError::Unexpected("a hello"));
        };
        let theirs = Nonce::from_hex(&nonce)?;
        let hs = Handshake::new(secret, CONTEXT, Role::Listener)?;
        let line = encode_line(&AuthMsg::Challenge {
            nonce: hs.nonce().to_hex(),
            proof: hs.proof(&theirs).to_hex(),
        })?;
        Ok((Self { hs, theirs }, line))
    }

    /// Checks the worker's proof and opens the session.
    ///
    /// # Errors
    /// [`ProtocolError::Auth`] when the proof does not check out (a wrong secret, or a
    /// handshake recorded on another connection), or another error for a line that is no
    /// proof.
    pub fn finish(self, line: &[u8]) -> Result<Session, ProtocolError> {
        let AuthMsg::Proof { proof } = decode_line::<AuthMsg>(line)? else {
            return Err(ProtocolError::Unexpected("a proof"));
        };
        Ok(self.hs.verify(&self.theirs, &Tag::from_hex(&proof)?)?)
    }
}

/// An unsealed refusal, for a connection that has no session (yet).
///
/// # Errors
/// Never in practice: a refusal always encodes.
pub fn refusal_line(reason: &str) -> Result<Vec<u8>, ProtocolError> {
    encode_line(&AuthMsg::Refused {
        reason: reason.to_string(),
    })
}

/// Encodes `msg` as a sealed line: its JSON, a tab, its tag, a newline.
///
/// # Errors
/// [`ProtocolError::Malformed`] if `msg` does not encode.
pub fn seal_line<T: Serialize>(sealer: &mut Sealer, msg: &T) -> Result<Vec<u8>, ProtocolError> {
    let mut line = serde_json::to_vec(msg)?;
    let tag = sealer.seal(&line);
    line.push(TAG_SEPARATOR);
    line.extend_from_slice(tag.to_hex().as_bytes());
    line.push(b'\n');
    Ok(line)
}

/// Checks a sealed line's tag, then decodes its message. The tag is checked before any JSON
/// is parsed, so a stranger's bytes never reach the parser.
///
/// # Errors
/// [`ProtocolError::TooLong`], [`ProtocolError::Unsealed`] (no tag: a refusal's reason is
/// carried when the line is one), [`ProtocolError::Auth`] for a tag that does not check out,
/// [`ProtocolError::Malformed`] for a sealed line that is not a message.
pub fn open_line<T: DeserializeOwned>(
    opener: &mut Opener,
    line: &[u8],
) -> Result<T, ProtocolError> {
    if line.len() > MAX_LINE {
        return Err(ProtocolError::TooLong(line.len()));
    }
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let Some(at) = line.iter().rposition(|&b| b == TAG_SEPARATOR) else {
        return Err(match decode_line::<AuthMsg>(line) {
            Ok(AuthMsg::Refused { reason }) => ProtocolError::Refused(reason),
            _ => ProtocolError::Unsealed,
        });
    };
    let (msg, tag) = (&line[..at], &line[at + 1..]);
    let tag = std::str::from_utf8(tag).map_err(|_| hvd_auth::AuthError::Malformed {
        what: "message tag",
        bytes: hvd_auth::TAG_BYTES,
    })?;
    opener.open(msg, &Tag::from_hex(tag)?)?;
    Ok(serde_json::from_slice(msg)?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::{DriverMsg, WorkerMsg};

    /// A full handshake between a worker holding `worker_secret` and a driver holding
    /// `driver_secret`: the sessions, or the first error either side saw.
    fn handshake(
        worker_secret: &str,
        driver_secret: &str,
    ) -> Result<(Session, Session), ProtocolError> {
        let (dialer, hello) = DialerAuth::start(worker_secret)?;
        let (listener, challenge) = ListenerAuth::answer(driver_secret, &hello)?;
        let (proof, worker) = dialer.finish(&challenge)?;
        let driver = listener.finish(&proof)?;
        Ok((worker, driver))
    }

    fn register() -> WorkerMsg {
        WorkerMsg::Register {
            worker: 3,
            addr: "127.0.0.3:5000".into(),
            host: "127.0.0.3".into(),
            pid: 42,
            resume: None,
        }
    }

    #[test]
    fn sealed_lines_go_both_ways_in_order() {
        let (worker, driver) = handshake("s", "s").unwrap();
        let ((mut w_seal, mut w_open), (mut d_seal, mut d_open)) = (worker.split(), driver.split());
        for _ in 0..3 {
            let line = seal_line(&mut w_seal, &register()).unwrap();
            assert!(line.ends_with(b"\n") && !line[..line.len() - 1].contains(&b'\n'));
            assert_eq!(
                open_line::<WorkerMsg>(&mut d_open, &line).unwrap(),
                register()
            );
            let line = seal_line(&mut d_seal, &DriverMsg::Ping).unwrap();
            assert_eq!(
                open_line::<DriverMsg>(&mut w_open, &line).unwrap(),
                DriverMsg::Ping
            );
        }
        // Tabs and newlines inside strings are escaped, so the last tab is the tag's.
        let odd = WorkerMsg::Join {
            worker: 1,
            generation: 2,
            reason: "a\tb\nc".into(),
        };
        let line = seal_line(&mut w_seal, &odd).unwrap();
        assert_eq!(open_line::<WorkerMsg>(&mut d_open, &line).unwrap(), odd);
    }

    #[test]
    fn a_wrong_secret_fails_on_the_side_that_checks_first() {
        // The worker checks the driver's proof before it proves anything itself.
        let e = handshake("mine", "theirs").unwrap_err();
        assert!(
            matches!(e, ProtocolError::Auth(hvd_auth::AuthError::BadProof)),
            "{e}"
        );
        // A worker that skips the check and sends a proof anyway is refused by the driver.
        let (_, hello) = DialerAuth::start("mine").unwrap();
        let (listener, _) = ListenerAuth::answer("theirs", &hello).unwrap();
        let forged = encode_line(&AuthMsg::Proof {
            proof: "00".repeat(32),
        })
        .unwrap();
        assert!(matches!(
            listener.finish(&forged),
            Err(ProtocolError::Auth(hvd_auth::AuthError::BadProof))
        ));
    }

    #[test]
    fn a_recorded_handshake_replayed_on_a_new_connection_is_refused() {
        let (dialer, hello) = DialerAuth::start("s").unwrap();
        let (listener, challenge) = ListenerAuth::answer("s", &hello).unwrap();
        let (proof, _) = dialer.finish(&challenge).unwrap();
        listener.finish(&proof).unwrap();
        // The same hello and proof, later: the driver's nonce is fresh, the proof worthless.
        let (listener, _) = ListenerAuth::answer("s", &hello).unwrap();
        assert!(matches!(
            listener.finish(&proof),
            Err(ProtocolError::Auth(hvd_auth::AuthError::BadProof))
        ));
    }

    #[test]
    fn tampered_replayed_reordered_and_foreign_lines_are_refused() {
        let (worker, driver) = handshake("s", "s").unwrap();
        let (mut seal, _) = worker.split();
        let (_, mut open) = driver.split();
        let first = seal_line(&mut seal, &register()).unwrap();
        let second = seal_line(&mut seal, &WorkerMsg::Pong { worker: 3 }).unwrap();
        // Out of order.
        assert!(matches!(
            open_line::<WorkerMsg>(&mut open, &second),
            Err(ProtocolError::Auth(hvd_auth::AuthError::BadTag {
                number: 0
            }))
        ));
        // Tampered: the worker id changed on the way.
        let tampered =
            String::from_utf8(first.clone())
                .unwrap()
                .replacen("\"worker\":3", "\"worker\":4", 1);
        assert!(open_line::<WorkerMsg>(&mut open, tampered.as_bytes()).is_err());
        open_line::<WorkerMsg>(&mut open, &first).unwrap();
        // Replayed.
        assert!(open_line::<WorkerMsg>(&mut open, &first).is_err());
        open_line::<WorkerMsg>(&mut open, &second).unwrap();
        // From another connection of the same job: another session key.
        let (other, _) = handshake("s", "s").unwrap();
        let (mut other_seal, _) = other.split();
        let _ = seal_line(&mut other_seal, &register()).unwrap();
        let _ = seal_line(&mut other_seal, &register()).unwrap();
        let foreign = seal_line(&mut other_seal, &WorkerMsg::Goodbye { worker: 3 }).unwrap();
        assert!(open_line::<WorkerMsg>(&mut open, &foreign).is_err());
    }

    #[test]
    fn unsealed_lines_are_refused_and_a_refusal_is_read() {
        let (_, driver) = handshake("s", "s").unwrap();
        let (_, mut open) = driver.split();
        let plain = encode_line(&WorkerMsg::Goodbye { worker: 1 }).unwrap();
        assert!(matches!(
            open_line::<WorkerMsg>(&mut open, &plain),
            Err(ProtocolError::Unsealed)
        ));
        let refused = refusal_line("wrong job secret").unwrap();
        match open_line::<DriverMsg>(&mut open, &refused) {
            Err(ProtocolError::Refused(r)) => assert_eq!(r, "wrong job secret"),
            other => panic!("{other:?}"),
        }
        let mut bad_tag = encode_line(&DriverMsg::Ping).unwrap();
        bad_tag.pop();
        bad_tag.extend_from_slice(b"\tnot hex\n");
        assert!(matches!(
            open_line::<DriverMsg>(&mut open, &bad_tag),
            Err(ProtocolError::Auth(hvd_auth::AuthError::Malformed { .. }))
        ));
        let huge = vec![b'\t'; MAX_LINE + 1];
        assert!(matches!(
            open_line::<DriverMsg>(&mut open, &huge),
            Err(ProtocolError::TooLong(_))
        ));
    }

    #[test]
    fn handshake_lines_out_of_place_are_errors() {
        assert!(matches!(
            ListenerAuth::answer("s", br#"{"type":"proof","proof":"00"}"#),
            Err(ProtocolError::Unexpected("a hello"))
        ));
        assert!(ListenerAuth::answer("s", br#"{"type":"hello","nonce":"zz"}"#).is_err());
        let (dialer, _) = DialerAuth::start("s").unwrap();
        match dialer.finish(&refusal_line("the job is over").unwrap()) {
            Err(ProtocolError::Refused(r)) => assert_eq!(r, "the job is over"),
            other => panic!("{other:?}"),
        }
    }
}
