//! Notices that a host is going away (a spot preemption, a drained node, an evicted pod): who
//! gave one, and how long the host has left. Workers and agents send them, the driver acts on
//! them; this is the one home of their vocabulary.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Where a notice came from; its name is the `source` label of
/// `hvd_preemption_notices_total` and of the driver's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NoticeSource {
    /// A SIGTERM to a worker (a drained node, an evicted pod, systemd on ACPI shutdown).
    Sigterm,
    /// AWS instance metadata: `spot/instance-action` or a rebalance recommendation.
    Aws,
    /// GCE or GKE metadata: `instance/preempted`.
    Gce,
    /// Azure Scheduled Events: a `Preempt` event.
    Azure,
    /// Kubernetes: a worker pod with the `DisruptionTarget` condition or a deletion timestamp.
    Kubernetes,
}

impl NoticeSource {
    /// Every source, in the order of their names.
    pub const ALL: [Self; 5] = [
        Self::Aws,
        Self::Azure,
        Self::Gce,
        Self::Kubernetes,
        Self::Sigterm,
    ];

    /// The source's name: `sigterm`, `aws`, `gce`, `azure`, `kubernetes`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Sigterm => "sigterm",
            Self::Aws => "aws",
            Self::Gce => "gce",
            Self::Azure => "azure",
            Self::Kubernetes => "kubernetes",
        }
    }
}

impl fmt::Display for NoticeSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A cloud whose instance metadata a worker watches for preemption notices
/// (`--preemption-watch`, [`crate::ENV_PREEMPTION_WATCH`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cloud {
    /// AWS EC2: `spot/instance-action` and the rebalance recommendation, over IMDSv2.
    Aws,
    /// Google Compute Engine and GKE: `instance/preempted`.
    Gce,
    /// Azure: Scheduled Events of type `Preempt`.
    Azure,
}

impl Cloud {
    /// Every cloud.
    pub const ALL: [Self; 3] = [Self::Aws, Self::Gce, Self::Azure];

    /// The cloud's name, as flags and the environment spell it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Aws => "aws",
            Self::Gce => "gce",
            Self::Azure => "azure",
        }
    }

    /// The source its notices are counted under.
    pub const fn source(self) -> NoticeSource {
        match self {
            Self::Aws => NoticeSource::Aws,
            Self::Gce => NoticeSource::Gce,
            Self::Azure => NoticeSource::Azure,
        }
    }
}

impl fmt::Display for Cloud {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Cloud {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|c| c.name() == s.trim())
            .ok_or_else(|| format!("'{s}' is not a cloud hvd watches: use aws, gce or azure"))
    }
}

/// How long a host is kept out of the job after a notice that named no deadline: AWS's two
/// minutes, the longest any cloud gives.
pub const NOTICE_HOLD_DEFAULT: Duration = Duration::from_secs(120);

/// How long a worker that got a SIGTERM may take to leave before it ends at once, unless
/// [`crate::ENV_NOTICE_GRACE`] says otherwise: Kubernetes' default termination grace.
pub const SIGTERM_GRACE_DEFAULT: Duration = Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_source_is_written_and_read_by_its_name() {
        for s in NoticeSource::ALL {
            let json = serde_json::to_string(&s).expect("a source serializes");
            assert_eq!(json, format!("\"{}\"", s.name()));
            assert_eq!(serde_json::from_str::<NoticeSource>(&json).ok(), Some(s));
            assert_eq!(s.to_string(), s.name());
        }
        let mut names: Vec<&str> = NoticeSource::ALL.iter().map(|s| s.name()).collect();
        let sorted = names.clone();
        names.sort_unstable();
        assert_eq!(names, sorted, "ALL is in the order of the names");
        assert!(serde_json::from_str::<NoticeSource>("\"ibm\"").is_err());
    }

    #[test]
    fn clouds_are_read_by_name_and_a_wrong_one_is_named() {
        for c in Cloud::ALL {
            assert_eq!(c.name().parse::<Cloud>(), Ok(c));
            assert_eq!(c.source().name(), c.name());
        }
        let err = "ibm".parse::<Cloud>().unwrap_err();
        assert!(
            err.contains("'ibm'") && err.contains("aws, gce or azure"),
            "{err}"
        );
    }
}
