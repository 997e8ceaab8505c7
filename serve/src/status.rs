//! The body of the driver's `GET /status`: the one contract the driver writes and the
//! operator reads, so that renaming a field or a phase fails to compile on both sides.

use serde::{Deserialize, Serialize};

/// Where a job stands, as the driver reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DriverPhase {
    /// No round has completed yet.
    Pending,
    /// The workers of the last round are training.
    #[default]
    Running,
    /// A new round is being formed (after a failure or a host change).
    Rescaling,
    /// Every worker of the last round finished training and exited 0.
    Succeeded,
    /// The job failed.
    Failed,
    /// A phase this build does not know (a newer driver): read as [`DriverPhase::Running`]
    /// where a decision needs one, and never written.
    #[serde(other, skip_serializing)]
    Unknown,
}

impl DriverPhase {
    /// Every phase a driver writes, in the order a metric lists them.
    pub const ALL: [DriverPhase; 5] = [
        DriverPhase::Pending,
        DriverPhase::Running,
        DriverPhase::Rescaling,
        DriverPhase::Succeeded,
        DriverPhase::Failed,
    ];

    /// The phase's name, as the body and the metrics' `phase` label write it.
    pub fn name(self) -> &'static str {
        match self {
            DriverPhase::Pending => "Pending",
            DriverPhase::Running => "Running",
            DriverPhase::Rescaling => "Rescaling",
            DriverPhase::Succeeded => "Succeeded",
            DriverPhase::Failed => "Failed",
            DriverPhase::Unknown => "Unknown",
        }
    }
}

/// The driver's view of the job (`GET /status`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DriverStatus {
    /// Where the job stands.
    #[serde(default)]
    pub phase: DriverPhase,
    /// The last completed rendezvous round (0: none yet).
    #[serde(default)]
    pub generation: u64,
    /// Worker processes in the current round.
    #[serde(default)]
    pub workers: u64,
    /// Hosts in the current round.
    #[serde(default)]
    pub hosts: Vec<StatusHost>,
    /// Hosts kept out of the job, and until when.
    #[serde(default)]
    pub blacklisted: Vec<BlacklistedHost>,
    /// Elastic resets so far.
    #[serde(default)]
    pub resets: u64,
    /// The last rounds, oldest first, each with what caused it: the world size over time.
    #[serde(default)]
    pub rounds: Vec<StatusRound>,
    /// Hosts kept out after a notice, and until when.
    #[serde(default)]
    pub noticed: Vec<NoticedHost>,
    /// How much each rank of the current round holds the others up, as rank 0 last reported.
    #[serde(default)]
    pub lateness: Vec<RankLateness>,
    /// The driver's recent log lines, oldest first.
    #[serde(default)]
    pub log: Vec<String>,
}

/// A completed rendezvous round.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusRound {
    /// Its number (1: the first).
    pub generation: u64,
    /// When it completed, in Unix milliseconds.
    #[serde(default)]
    pub at_ms: u64,
    /// Its workers.
    #[serde(default)]
    pub workers: u64,
    /// What made the job leave the round before it (none for the first round).
    #[serde(default)]
    pub causes: Vec<ResetCause>,
}

/// Why the job left a round for a new one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResetCause {
    /// What kind of event.
    pub kind: CauseKind,
    /// The host it concerns (empty when none does).
    #[serde(default)]
    pub host: String,
    /// What happened, in a person's words.
    #[serde(default)]
    pub detail: String,
}

/// The kinds of event that reset an elastic job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CauseKind {
    /// A worker failed (exited non-zero, killed, or did not register or join in time).
    Failure,
    /// A worker stopped answering the driver's heartbeats.
    Frozen,
    /// A host gave notice that it is going away (SIGTERM, a cloud's preemption notice).
    Notice,
    /// A straggler's host was evicted.
    Straggler,
    /// Hosts or slots were added.
    ScaleUp,
    /// Hosts or slots left discovery.
    ScaleDown,
    /// A worker asked for a new round by itself (its collective failed).
    Requested,
    /// A kind this build does not know (a newer driver).
    #[serde(other)]
    Unknown,
}

/// A host that gave notice.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NoticedHost {
    /// Host name or address, as discovery gave it.
    pub host: String,
    /// Who gave the notice (`sigterm`, `aws`, `gce`, `azure`, `kubernetes`).
    #[serde(default)]
    pub source: String,
    /// When it may come back, in Unix milliseconds.
    #[serde(default)]
    pub until_ms: u64,
}

/// How much one rank holds the others up.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankLateness {
    /// The rank.
    pub rank: u64,
    /// Its host.
    #[serde(default)]
    pub host: String,
    /// Seconds a step the median rank waits for it.
    #[serde(default)]
    pub seconds: f64,
    /// How many times the median rank's step its step takes.
    #[serde(default)]
    pub factor: f64,
}

/// A host of the current round.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusHost {
    /// Host name or address, as discovery gave it.
    pub host: String,
    /// Its slots.
    #[serde(default)]
    pub slots: usize,
}

/// A blacklisted host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlacklistedHost {
    /// Host name or address, as discovery gave it.
    pub host: String,
    /// End of its cooldown in Unix milliseconds (wall-clock time); absent when it is out for
    /// good.
    #[serde(default)]
    pub until_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_reads_back_as_written() {
        let s = DriverStatus {
            phase: DriverPhase::Rescaling,
            generation: 3,
            workers: 4,
            hosts: vec![StatusHost {
                host: "10.0.0.1".into(),
                slots: 2,
            }],
            blacklisted: vec![BlacklistedHost {
                host: "10.0.0.2".into(),
                until_ms: Some(1_795_000_000_000),
            }],
            resets: 2,
            rounds: vec![StatusRound {
                generation: 2,
                at_ms: 1_795_000_000_000,
                workers: 3,
                causes: vec![ResetCause {
                    kind: CauseKind::Notice,
                    host: "10.0.0.3".into(),
                    detail: "aws, 120 s".into(),
                }],
            }],
            noticed: vec![NoticedHost {
                host: "10.0.0.3".into(),
                source: "aws".into(),
                until_ms: 1_795_000_180_000,
            }],
            lateness: vec![RankLateness {
                rank: 1,
                host: "10.0.0.1".into(),
                seconds: 0.25,
                factor: 1.5,
            }],
            log: vec!["a line".into()],
        };
        let text = serde_json::to_string(&s).unwrap_or_default();
        assert!(text.contains("\"phase\":\"Rescaling\""), "{text}");
        assert_eq!(serde_json::from_str::<DriverStatus>(&text).ok(), Some(s));
    }

    #[test]
    fn every_phase_is_written_by_its_name() {
        for p in DriverPhase::ALL {
            let text = serde_json::to_string(&p).unwrap_or_default();
            assert_eq!(text, format!("\"{}\"", p.name()));
        }
    }

    #[test]
    fn a_phase_from_a_newer_driver_reads_as_unknown() {
        let s: Option<DriverStatus> = serde_json::from_str(r#"{"phase":"Draining"}"#).ok();
        assert_eq!(s.map(|s| s.phase), Some(DriverPhase::Unknown));
        let s: Option<DriverStatus> = serde_json::from_str("{}").ok();
        assert_eq!(s.map(|s| s.phase), Some(DriverPhase::Running));
    }

    #[test]
    fn causes_are_written_in_snake_case_and_a_newer_one_reads_as_unknown() {
        let c = ResetCause {
            kind: CauseKind::ScaleUp,
            host: String::new(),
            detail: String::new(),
        };
        let text = serde_json::to_string(&c).unwrap_or_default();
        assert!(text.contains("\"kind\":\"scale_up\""), "{text}");
        let c: Option<ResetCause> = serde_json::from_str(r#"{"kind":"meteor"}"#).ok();
        assert_eq!(c.map(|c| c.kind), Some(CauseKind::Unknown));
    }
}
