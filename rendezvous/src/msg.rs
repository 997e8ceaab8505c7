//! Rendezvous messages and their line codec.

use serde::{Deserialize, Serialize};

/// Longest line either side accepts; a longer one is an error, not an allocation.
pub const MAX_LINE: usize = 1 << 20;

/// What a worker sends the driver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum WorkerMsg {
    /// Joins the rendezvous: the worker listens for its peers at `addr`.
    Register {
        /// The job's secret.
        secret: String,
        /// The rank the launcher gave this worker.
        rank: usize,
        /// `ip:port` of the worker's collective listener.
        addr: String,
        /// The host the worker runs on, as the launcher named it.
        host: String,
        /// The worker's process id, for the driver's log.
        pid: u32,
    },
    /// The worker is leaving cleanly (`hvd::shutdown`).
    Goodbye {
        /// The job's secret.
        secret: String,
        /// The worker's rank.
        rank: usize,
    },
}

/// What the driver sends a worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum DriverMsg {
    /// Every rank has registered: here is where each one listens.
    World {
        /// The rendezvous round; peers from other rounds refuse each other.
        generation: u64,
        /// `peers[r]` is rank `r`'s listener address.
        peers: Vec<String>,
        /// `hosts[r]` is rank `r`'s host.
        hosts: Vec<String>,
    },
    /// The registration was refused; the worker reports `reason` and fails.
    Refused {
        /// Why.
        reason: String,
    },
}

/// A line that is not a valid message.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// Not JSON, or not a message of this protocol.
    #[error("malformed message: {0}")]
    Malformed(#[from] serde_json::Error),
    /// Longer than [`MAX_LINE`].
    #[error("message of {0} bytes exceeds the {MAX_LINE}-byte limit")]
    TooLong(usize),
}

/// Encodes one message as a JSON line (with the trailing newline).
pub fn encode_line<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtocolError> {
    let mut v = serde_json::to_vec(msg)?;
    v.push(b'\n');
    Ok(v)
}

/// Decodes one line (with or without its newline).
pub fn decode_line<'a, T: Deserialize<'a>>(line: &'a [u8]) -> Result<T, ProtocolError> {
    if line.len() > MAX_LINE {
        return Err(ProtocolError::TooLong(line.len()));
    }
    Ok(serde_json::from_slice(line.trim_ascii_end())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let m = WorkerMsg::Register {
            secret: "s".into(),
            rank: 3,
            addr: "127.0.0.3:5000".into(),
            host: "127.0.0.3".into(),
            pid: 42,
        };
        let line = encode_line(&m).unwrap();
        assert!(line.ends_with(b"\n"));
        assert_eq!(decode_line::<WorkerMsg>(&line).unwrap(), m);
        let w = DriverMsg::World {
            generation: 1,
            peers: vec!["a:1".into()],
            hosts: vec!["a".into()],
        };
        assert_eq!(
            decode_line::<DriverMsg>(&encode_line(&w).unwrap()).unwrap(),
            w
        );
    }

    #[test]
    fn rejects_unknown_and_oversized() {
        assert!(decode_line::<WorkerMsg>(br#"{"type":"register"}"#).is_err());
        assert!(decode_line::<WorkerMsg>(br#"{"type":"exec","cmd":"rm"}"#).is_err());
        assert!(decode_line::<WorkerMsg>(b"not json").is_err());
        let huge = vec![b' '; MAX_LINE + 1];
        assert!(matches!(
            decode_line::<WorkerMsg>(&huge),
            Err(ProtocolError::TooLong(_))
        ));
    }
}
