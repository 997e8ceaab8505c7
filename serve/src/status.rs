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
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
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
}
