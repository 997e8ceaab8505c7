//! The agent's wire messages: JSON lines over TCP, tagged by `"type"`, with the line codec of
//! the rendezvous protocol ([`hvd_rendezvous::encode_line`], [`hvd_rendezvous::decode_line`]).
//!
//! A connection opens with a challenge–response in both directions (see [`crate::auth`]):
//! the agent sends [`FromAgent::Challenge`], the driver answers [`ToAgent::Auth`] with the MAC
//! of the agent's nonce and a nonce of its own, and the agent answers [`FromAgent::Welcome`]
//! with the MAC of that one, or [`FromAgent::Refused`] and closes. Only then are requests read.
//!
//! A driver with a state store then claims its job ([`ToAgent::Claim`]): the processes it
//! starts outlive its connection for the grace it names, and the next connection that claims
//! the job (the driver that took over) receives them, with what they wrote meanwhile.

use serde::{Deserialize, Serialize};

/// What the driver sends an agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ToAgent {
    /// The answer to the agent's challenge; the first message of a connection.
    Auth {
        /// Hex HMAC-SHA256 of the agent's nonce under the shared secret.
        mac: String,
        /// A fresh nonce the agent must answer in its welcome, proving it knows the secret too.
        nonce: String,
    },
    /// Act for job `job` (before any start): when this connection ends, its processes run
    /// on for `grace_ms` and go to the next connection that claims the job; the processes a
    /// previous connection of the job left are handed to this one now.
    Claim {
        /// The job's name, the same for every driver of the job (its state store prefix).
        job: String,
        /// Milliseconds the processes outlive a lost connection before they are stopped.
        grace_ms: u64,
    },
    /// Start a process in its own process group.
    Start {
        /// The driver's name for the process; unique among the connection's live processes.
        id: u64,
        /// Program and arguments.
        argv: Vec<String>,
        /// Variables added to the agent's environment.
        env: Vec<(String, String)>,
        /// Working directory; the agent's own when absent.
        cwd: Option<String>,
    },
    /// Stop a process: SIGTERM to its process group, SIGKILL after `grace_ms` (at once when 0).
    Stop {
        /// The process.
        id: u64,
        /// Milliseconds between SIGTERM and SIGKILL.
        grace_ms: u64,
    },
}

/// Which pipe an output line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// What an agent sends the driver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum FromAgent {
    /// The first message of a connection: the driver must answer with its MAC.
    Challenge {
        /// Hex random bytes, fresh for every connection.
        nonce: String,
    },
    /// The driver's answer was right; `mac` is the agent's answer to the driver's nonce.
    Welcome {
        /// Hex HMAC-SHA256 of the driver's nonce under the shared secret.
        mac: String,
    },
    /// The connection is refused (wrong secret, or a request before authentication) and closed.
    Refused {
        /// Why.
        reason: String,
    },
    /// The answer to [`ToAgent::Claim`]: the processes of the job this connection now has
    /// (none for a new job). What they wrote while no driver was connected, and the exits of
    /// those that ended meanwhile, follow as [`FromAgent::Output`] and [`FromAgent::Exited`].
    Claimed {
        /// Each process handed over: the driver's id and the process id.
        processes: Vec<Held>,
        /// Output lines dropped, oldest first, because more was written than the agent keeps
        /// while no driver is connected.
        dropped_lines: u64,
    },
    /// A process started.
    Started {
        /// The driver's id for it.
        id: u64,
        /// Its process id (and process group id).
        pid: u32,
    },
    /// A process could not be started.
    StartFailed {
        /// The driver's id for it.
        id: u64,
        /// Why, naming the program or directory.
        error: String,
    },
    /// One line a process wrote, without its newline (invalid UTF-8 replaced).
    Output {
        /// The process.
        id: u64,
        /// Which pipe.
        stream: Stream,
        /// The line.
        line: String,
    },
    /// A process began to die of a failure (a signal, or a nonzero exit code); its
    /// [`FromAgent::Exited`] follows once the kernel has freed its memory and its last lines
    /// are sent. Sent at most once per process, and never for an exit 0.
    Dying {
        /// The process.
        id: u64,
        /// Its exit code, when it is exiting.
        code: Option<i32>,
        /// The signal that is killing it, when one is.
        signal: Option<i32>,
    },
    /// A process ended; every line it wrote was sent before this.
    Exited {
        /// The process.
        id: u64,
        /// Its exit code, when it exited.
        code: Option<i32>,
        /// The signal that killed it, when one did.
        signal: Option<i32>,
    },
    /// A request could not be carried out (for example, a second start with a live id).
    Error {
        /// Why.
        reason: String,
    },
}

/// A process an agent kept for a job while no driver was connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Held {
    /// The driver's id for it.
    pub id: u64,
    /// Its process id (and process group id).
    pub pid: u32,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use hvd_rendezvous::{decode_line, encode_line};

    use super::*;

    #[test]
    fn messages_round_trip_as_tagged_json_lines() {
        let start = ToAgent::Start {
            id: 7,
            argv: vec!["python".into(), "train.py".into()],
            env: vec![("HOROVOD_RANK".into(), "0".into())],
            cwd: Some("/work".into()),
        };
        let line = encode_line(&start).unwrap();
        assert!(line.starts_with(br#"{"type":"start","id":7"#));
        assert_eq!(decode_line::<ToAgent>(&line).unwrap(), start);
        let out = FromAgent::Output {
            id: 7,
            stream: Stream::Stderr,
            line: "loss 0.5".into(),
        };
        let text = String::from_utf8(encode_line(&out).unwrap()).unwrap();
        assert!(text.contains(r#""stream":"stderr""#), "{text}");
        assert_eq!(decode_line::<FromAgent>(text.as_bytes()).unwrap(), out);
    }

    #[test]
    fn unknown_messages_and_fields_are_rejected() {
        assert!(decode_line::<ToAgent>(br#"{"type":"exec","cmd":"sh"}"#).is_err());
        assert!(decode_line::<ToAgent>(br#"{"type":"stop","id":1,"grace_ms":0,"x":1}"#).is_err());
        assert!(decode_line::<ToAgent>(br#"{"type":"stop","id":1}"#).is_err());
    }
}
